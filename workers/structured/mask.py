"""The worker's matchers: one per constrained request, masks applied to a step's logits.

Invariant: a request's matcher has accepted exactly its output tokens, in order. It is built
from them whenever the worker (re)learns the request (`NewRequestData` after admission,
preemption, recompute, a worker restart or a controller resume all carry the tokens), and
advanced by each token the worker samples for it; so the matcher state needs no transport."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch
import xgrammar as xgr
from torch import Tensor

from controller.messages import SamplingParams
from workers.structured.compiler import GrammarCache
from workers.structured.cpu_mask import apply_bitmask

log = logging.getLogger(__name__)


class _Entry:
    def __init__(self, grammar: Future[xgr.CompiledGrammar], output_ids: list[int]) -> None:
        self.grammar = grammar
        self.output_ids = output_ids  # accepted once the matcher exists
        self.matcher: xgr.GrammarMatcher | None = None
        self.is_broken = False  # a token the grammar refused: unconstrained from there

    def ready_matcher(self) -> xgr.GrammarMatcher | None:
        """Blocks until the grammar is compiled (its compile started when the request
        arrived, so usually overlapped with its prefill)."""
        if self.matcher is None and not self.is_broken:
            try:
                self.matcher = xgr.GrammarMatcher(self.grammar.result())
            except Exception as err:
                log.warning("grammar failed on the worker: %s", err)
                self.is_broken = True
                return None
            for token in self.output_ids:
                self.accept(token)
            self.output_ids = []
        return None if self.is_broken else self.matcher

    def accept(self, token: int) -> None:
        if self.matcher is None:
            self.output_ids.append(token)
            return
        if self.is_broken or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            log.warning("token %d refused by the grammar: request unconstrained from here",
                        token)
            self.is_broken = True


class GrammarMasks:
    """All constrained rows of a step at once: their bitmasks filled in one batched call,
    the logits masked in one pass (on CPU, `cpu_mask.apply_bitmask`; else xgrammar's
    kernel where the logits are)."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._entries: dict[str, _Entry] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, cache.info.vocab_size)
        # One thread: filling a step's rows takes microseconds, less than a pool's hand-off.
        self._batch = xgr.BatchGrammarMatcher(1)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, params: SamplingParams, output_ids: list[int]) -> None:
        if not params.grammar_kind:
            return
        future = self.cache.submit(params.grammar_kind, params.grammar_spec)
        self._entries[request_id] = _Entry(future, list(output_ids))

    def drop(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def clear(self) -> None:
        self._entries.clear()

    def accept(self, request_id: str, token: int) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.accept(token)

    def apply(self, logits: Tensor, row_request_ids: list[str]) -> None:
        """logits [S, V] (row i: `row_request_ids[i]`'s next token): tokens the grammars
        forbid set to -inf in place, for all constrained rows at once."""
        if not self._entries:
            return
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for i, request_id in enumerate(row_request_ids):
            entry = self._entries.get(request_id)
            if entry is None:
                continue
            matcher = entry.ready_matcher()
            if matcher is None or matcher.is_terminated():
                continue
            rows.append(i)
            matchers.append(matcher)
        if not rows:
            return
        if logits.dtype != torch.float32:
            raise TypeError("grammar masks need fp32 logits")
        if self._bitmask.shape[0] < len(row_request_ids):
            self._bitmask = xgr.allocate_token_bitmask(len(row_request_ids),
                                                       self.cache.info.vocab_size)
        bitmask = self._bitmask[: len(row_request_ids)]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        if logits.device.type == "cpu":
            apply_bitmask(logits.numpy(), bitmask.numpy(), rows)
            return
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1], indices=rows)
