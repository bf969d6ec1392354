"""A worker's results side (a part of `Worker`): a step's `StepResult` with its sampled
tokens, one `ChunkComplete` per prefill chunk, the bytes the step moved (the model's
config prices them), the telemetry sample taken on it, a decode burst's further steps
(controller/decode_burst.py), the log-probabilities its requests ask for
(workers/logprobs.py), and the grammar masks of constrained requests
(workers/structured/): log-probabilities are always of the raw logits, before the mask.

Bytes-moved estimate (feeds the CPU bandwidth telemetry), per step:
    weights read   = every weight matrix once (the embedding table only for its T gathered
                     rows, unless it doubles as lm_head)
  + KV read        = sum over spans of context_len * kv_bytes_per_token
  + KV written     = T * kv_bytes_per_token
  + activations    = T * act_bytes_per_token + S * vocab * 4 (fp32 logits)
where kv_bytes_per_token and act_bytes_per_token come from the model's config
(`ModelConfig.kv_bytes_per_token`, `ModelConfig.activation_bytes_per_token`).
A chunk's `bytes_moved` uses the same terms for its own tokens plus its pro-rata share of weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from controller.messages import ChunkComplete, StepPlan, StepResult
from workers.attention import AttentionBackend, HostStaging, SeqSpan, StepMetadata
from workers.decode_loop import run_decode_loop
from workers.greedy_head import GreedyHead
from workers.logprobs import score_rows
from workers.model_config import ModelConfig
from workers.sampled_rows import SampledRows, sampled_rows
from workers.step_state import PendingStep, RequestState
from workers.telemetry import TelemetrySource

if TYPE_CHECKING:  # xgrammar (which imports pydantic) loads with the first grammar only
    from workers.structured.mask import GrammarMasks


class StepResults:
    telemetry: TelemetrySource | None
    _requests: dict[str, RequestState]
    _kv_bytes_per_token: int
    _act_bytes_per_token: int
    _matmul_weight_bytes: int
    _config: ModelConfig
    model: Any
    dtype: torch.dtype
    vocab_size: int
    _grammars: GrammarMasks | None
    _host_ids: Tensor
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    _launch: Callable[[StepPlan], PendingStep]
    keep_logits: bool
    is_sampled_last_layer: bool
    greedy_head: GreedyHead | None
    _staging: HostStaging
    backend: AttentionBackend

    @property
    def grammars(self) -> GrammarMasks:
        """Constrained requests' matchers; the grammar cache is built on first use."""
        if self._grammars is None:
            from workers.structured.compiler import cache_for
            from workers.structured.mask import GrammarMasks

            self._grammars = GrammarMasks(cache_for(self.tokenizer, self.vocab_size,
                                                    list(self.eos_token_ids)))
        return self._grammars

    def _apply_grammars(self, logits: Tensor, sampling_ids: list[str]) -> Tensor:
        """Mask, in place, the tokens the grammars forbid (before either sampler). -> the
        logits to score: log-probabilities are the model's own, before the mask, so a step
        where a constrained request is masked and some request asks for them keeps a copy."""
        grammars = self._grammars
        if grammars is None or not len(grammars):
            return logits
        wants_scores = any(self._requests[rid].sampling_params.logprobs is not None
                           for rid in sampling_ids)
        raw_logits = logits.clone() if wants_scores else logits
        grammars.apply(logits, sampling_ids)
        return raw_logits

    def _pinned_ids(self, num: int) -> Tensor:
        """[num] int64 in pinned host memory; one buffer, reused: a launched step's ids are
        read (`wait`) before the next step is launched."""
        if self._host_ids.numel() < num:
            self._host_ids = torch.empty(max(num, 2 * self._host_ids.numel()),
                                         dtype=torch.int64, pin_memory=True)
        return self._host_ids[:num]

    def _sample_telemetry(self, result: StepResult) -> StepResult:
        if self.telemetry is not None:
            sample = self.telemetry.sample(result.bytes_moved, result.elapsed_s, time.monotonic())
            result.bandwidth_utilization = sample.bandwidth_utilization
        return result

    def _wait_one(self, pending: PendingStep) -> StepResult:
        """`wait` for one launched step, without its telemetry sample."""
        if pending.done is not None:
            pending.done.synchronize()
            assert pending.start_event is not None and pending.host_ids is not None
            pending.tokens = pending.host_ids.tolist()
            elapsed_s = pending.start_event.elapsed_time(pending.done) / 1e3
        else:
            assert pending.end_s is not None
            elapsed_s = pending.end_s - pending.start_s
        plan = pending.plan
        if not pending.spans:
            return StepResult(step_id=plan.step_id, elapsed_s=elapsed_s)
        sampled = dict(zip(pending.sampling_ids, pending.tokens, strict=True))
        result = self._finish_step(plan, pending.spans, sampled, elapsed_s)
        return self._add_logprobs(result, pending, sampled)

    @staticmethod
    def _check_burst(plan: StepPlan, scheduled: list[tuple[str, RequestState, int, int]]
                     ) -> None:
        """A burst runs its spans `num_steps` times: decodes of 1 token and at most one
        chunk, which must not reach its prompt's end (it would sample, then decode) before
        the burst's last step. Checked before the first step runs."""
        if plan.num_steps == 1:
            return
        chunks = [(rid, state, begin, n) for rid, state, begin, n in scheduled if n > 1]
        if len(chunks) > 1:
            raise ValueError(f"step {plan.step_id}: a burst carries one chunk at most")
        for request_id, state, begin, num_tokens in chunks:
            if begin + plan.num_steps * num_tokens >= len(state.token_ids):
                raise ValueError(f"{request_id}: a chunk burst reaches the prompt's end")

    @torch.inference_mode()
    def _run_burst(self, pending: PendingStep, result: StepResult) -> None:
        """Steps 2.. of a burst (`StepPlan.num_steps`), into `result`: each decodes every
        decoding request of the plan once more, on the token the step before sampled, and
        runs the chunk's next span of the prompt (its own `chunk_complete`). The controller
        allocated the blocks for all of them and drops what follows a stop, so every
        request runs every step (its state stays the one the controller planned). Greedy
        decodes on the C++ stack run in one loop (workers/decode_loop.py)."""
        plan = pending.plan
        if run_decode_loop(self, pending, result, plan.num_steps - 1):
            return
        again = StepPlan(plan.step_id, num_scheduled_tokens=dict(plan.num_scheduled_tokens),
                         total_num_scheduled_tokens=plan.total_num_scheduled_tokens)
        for _ in range(plan.num_steps - 1):
            step = self._wait_one(self._launch(again))
            for request_id, tokens in step.sampled_token_ids.items():
                result.sampled_token_ids[request_id].extend(tokens)
            result.chunk_events.extend(step.chunk_events)
            result.elapsed_s += step.elapsed_s
            result.bytes_moved += step.bytes_moved
            result.num_tokens += step.num_tokens

    def _finish_step(
        self, plan: StepPlan, spans: dict[str, SeqSpan], sampled: dict[str, int], elapsed_s: float
    ) -> StepResult:
        num_tokens = sum(span.num_query_tokens for span in spans.values())
        result = StepResult(step_id=plan.step_id, elapsed_s=elapsed_s, num_tokens=num_tokens)
        total_bytes = self._fixed_bytes(len(sampled))
        for request_id, span in spans.items():
            state = self._requests[request_id]
            begin = span.context_len - span.num_query_tokens
            # KV read + KV written + this span's activations (weights excluded)
            span_bytes = self._token_bytes(span.context_len + span.num_query_tokens,
                                           span.num_query_tokens)
            total_bytes += span_bytes
            if span.num_query_tokens > 1 or begin < state.num_admitted_tokens:
                weight_share = self._matmul_weight_bytes * span.num_query_tokens // num_tokens
                result.chunk_events.append(
                    ChunkComplete(
                        request_id=request_id,
                        chunk_index=state.num_chunks,
                        start=begin,
                        num_tokens=span.num_query_tokens,
                        elapsed_s=elapsed_s,
                        bytes_moved=span_bytes + weight_share,
                    )
                )
                state.num_chunks += 1
            state.num_computed = span.context_len
            token = sampled.get(request_id)
            result.sampled_token_ids[request_id] = [] if token is None else [token]
            if token is not None:
                state.token_ids.append(token)
                state.num_output_tokens += 1
                if self._grammars is not None:
                    self._grammars.accept(request_id, token)
        result.bytes_moved = total_bytes
        return result

    def _fixed_bytes(self, num_sampled: int) -> int:
        """A step's bytes whatever its spans: the weights, and the fp32 logits of its
        `num_sampled` sampling rows."""
        return self._matmul_weight_bytes + num_sampled * self.vocab_size * 4

    def _token_bytes(self, num_kv_tokens: int, num_query_tokens: int) -> int:
        """KV read + KV written (`num_kv_tokens` in all) and the activations of
        `num_query_tokens` new tokens: the bytes model is linear, so one span's, or the sum
        over any number of spans (the burst loop's, workers/decode_loop.py)."""
        embed_row = self._config.hidden_size * self.dtype.itemsize
        return (num_kv_tokens * self._kv_bytes_per_token
                + num_query_tokens * (self._act_bytes_per_token + embed_row))

    def _greedy_head(self, wanted: bool) -> GreedyHead | None:
        """The bf16 screen of a CPU fp32 lm_head for greedy rows (`_screen`), where wanted
        and where it applies (workers/greedy_head.py)."""
        return GreedyHead.build(self.model.lm_head.weight) if wanted else None

    def _screen(self, pending: PendingStep, hidden: Tensor, rows: Tensor) -> PendingStep:
        """A CPU fp32 step's ids from the bf16 screen of its lm_head (workers/greedy_head.py)
        for sampling rows [S, hidden] that need no logits (`_is_screened`)."""
        assert self.greedy_head is not None
        ids = self.greedy_head.ids(rows)  # [S]
        pending.tokens = ids.tolist()
        self._score(pending, hidden, None, ids)  # prompt log-probs only: none sampled
        pending.end_s = time.perf_counter()
        return pending

    def _is_screened(self, sampling_ids: list[str]) -> bool:
        """Whether the worker has a `greedy_head` and the step's sampling rows need only
        their argmax: all greedy, none asking for log-probs, none constrained by a grammar."""
        params = (self._requests[rid].sampling_params for rid in sampling_ids)
        return self.greedy_head is not None and all(
            p.is_greedy and p.logprobs is None and not p.grammar_kind for p in params)

    def _sampled_rows(self, meta: StepMetadata, spans: dict[str, SeqSpan],
                      sampling_ids: list[str]) -> SampledRows | None:
        """The step's last layer on its sampled rows only (workers/sampled_rows.py): where
        some row does not sample, the worker runs it so, keeps no row's logits and no
        request scores its prompt."""
        if len(sampling_ids) == meta.num_real_tokens or not self.is_sampled_last_layer \
                or self.keep_logits or any(
                    self._requests[rid].sampling_params.prompt_logprobs is not None
                    for rid in spans):
            return None
        return sampled_rows(meta, [spans[rid] for rid in sampling_ids], self._staging,
                            self.backend)

    def _score(self, pending: PendingStep, hidden: Tensor, logits: Tensor | None,
               ids: Tensor) -> None:
        """Queue the log-probabilities the step's requests ask for: their sampled tokens'
        (rows of `logits`, which has one per sampling request) and, for echo requests, the
        prompt tokens their span predicts (row i of a span predicts position begin + i + 1;
        extra logits rows only for those requests)."""
        rows = [j for j, rid in enumerate(pending.sampling_ids)
                if self._requests[rid].sampling_params.logprobs is not None]
        if rows:
            assert logits is not None, "a request asks for log-probs: the step has logits"
            index = torch.tensor(rows, dtype=torch.long).to(logits.device)
            nums_top = [self._requests[pending.sampling_ids[j]].sampling_params.logprobs or 0
                        for j in rows]
            pending.sampled_scores = ([pending.sampling_ids[j] for j in rows], score_rows(
                logits.index_select(0, index), ids.to(logits.device).index_select(0, index),
                nums_top))
        for rid, span in pending.spans.items():
            state = self._requests[rid]
            num_top = state.sampling_params.prompt_logprobs
            begin = span.context_len - span.num_query_tokens
            end = min(span.context_len, state.num_prompt_tokens - 1)  # last position scored
            if num_top is None or end <= begin:
                continue
            targets = state.token_ids[begin + 1 : end + 1]
            span_logits = self.model.compute_logits(
                hidden[span.query_start : span.query_start + end - begin])
            target_ids = torch.tensor(targets, dtype=torch.long).to(span_logits.device)
            pending.prompt_scores.append(
                (rid, begin + 1, targets,
                 score_rows(span_logits, target_ids, [num_top] * len(targets))))

    @staticmethod
    def _add_logprobs(result: StepResult, pending: PendingStep,
                      sampled: dict[str, int]) -> StepResult:
        """The queued scores on the host, into the step's result (the step has run)."""
        if pending.sampled_scores is not None:
            rids, scored = pending.sampled_scores
            entries = scored.to_entries([sampled[rid] for rid in rids])
            result.sampled_logprobs.update(zip(rids, entries, strict=True))
        for rid, start, targets, scored in pending.prompt_scores:
            result.prompt_logprobs[rid] = (start, scored.to_entries(targets))
        return result
