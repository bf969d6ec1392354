"""The engine benchmark's workloads: the same prefill and decode step, ours and transformers'.

Ours go through the public worker entry point, `Worker.execute(StepPlan)`, exactly as the
controller drives it (plan diffs, metadata building, sampling included). Theirs are the forward
calls `transformers.generate` makes: the prefill forward with a fresh `DynamicCache`,
`use_cache=True` and `logits_to_keep=1`, and one decode forward of the whole batch against that
cache, each followed by the greedy argmax (generate's logits processors, stopping criteria and
input bookkeeping are left out, so theirs is if anything flattered).

A decode step is repeated at a fixed context: transformers' cache is cropped back to the
context before every step; our requests are re-sent as `NewRequestData` with
`num_computed_tokens = context` over the same blocks (the prefix-cache-hit path), so every step
attends over exactly `context` earlier tokens and overwrites the same KV slot.
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from controller.messages import NewRequestData, SamplingParams, StepPlan
from workers.worker import Worker

Workload = Callable[[], object]
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Pair:
    """The same workload, ours and transformers'."""

    ours: Workload
    theirs: Workload


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class OurWorkloads:
    """Builds `Worker.execute` workloads; block ranges never overlap between workloads."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._step_ids = itertools.count(1)
        self._next_block = 0
        self._request_ids = itertools.count()

    def _take_blocks(self, num_tokens: int) -> list[int]:
        count = blocks_needed(num_tokens, self.worker.block_size)
        if self._next_block + count > self.worker.num_kv_blocks:
            raise ValueError("benchmark KV pool too small for its workloads")
        self._next_block += count
        return list(range(self._next_block - count, self._next_block))

    def _plan(self, new: list[NewRequestData], finished: set[str]) -> StepPlan:
        schedule = {r.request_id: len(r.token_ids) - r.num_computed_tokens for r in new}
        return StepPlan(step_id=next(self._step_ids), new_requests=new,
                        num_scheduled_tokens=schedule,
                        total_num_scheduled_tokens=sum(schedule.values()),
                        finished_request_ids=finished)

    def prefill(self, prompt: list[int]) -> Workload:
        """One request, its whole prompt as one chunk; the previous run's request is dropped."""
        block_ids = self._take_blocks(len(prompt))
        previous: set[str] = set()

        def run() -> None:
            request_id = f"prefill-{next(self._request_ids)}"
            new = NewRequestData(request_id, prompt, GREEDY, block_ids, 0)
            self.worker.execute(self._plan([new], set(previous)))
            previous.clear()
            previous.add(request_id)

        return run

    def decode(self, prompts: list[list[int]]) -> Workload:
        """A batch of 1-token decodes, each at context `len(prompt)` (prefilled here first)."""
        blocks = [self._take_blocks(len(p) + 1) for p in prompts]
        ids = [f"decode-{next(self._request_ids)}" for _ in prompts]
        new = [NewRequestData(r, p, GREEDY, b, 0) for r, p, b in zip(ids, prompts, blocks,
                                                                     strict=True)]
        sampled = self.worker.execute(self._plan(new, set())).sampled_token_ids
        # Each request now knows prompt + 1 sampled token, with the prompt's KV cached.
        resend = [NewRequestData(r, [*p, sampled[r][0]], GREEDY, b, len(p))
                  for r, p, b in zip(ids, prompts, blocks, strict=True)]
        everyone = set(ids)

        def run() -> None:
            self.worker.execute(self._plan(resend, everyone))

        return run


class TheirWorkloads:
    """`transformers.LlamaForCausalLM` forwards as `generate` issues them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def prefill(self, prompt: list[int]) -> Workload:
        input_ids = torch.tensor([prompt], device=self.device)
        mask = torch.ones_like(input_ids)

        def run() -> None:
            with torch.inference_mode():
                out = self.model(input_ids=input_ids, attention_mask=mask, use_cache=True,
                                 logits_to_keep=1, **{self.cache_kwarg: self._cache()})
                out.logits[:, -1].argmax(-1)

        return run

    def decode(self, prompts: list[list[int]]) -> Workload:
        batch, context = len(prompts), len(prompts[0])
        if any(len(p) != context for p in prompts):
            raise ValueError("transformers' batched decode needs equal lengths (no padding)")
        cache = self._cache()
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor(prompts, device=self.device),
                             use_cache=True, logits_to_keep=1, **{self.cache_kwarg: cache})
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        mask = torch.ones(batch, context + 1, dtype=torch.int64, device=self.device)
        position_ids = torch.full((batch, 1), context, dtype=torch.int64, device=self.device)

        def run() -> None:
            with torch.inference_mode():
                # A negative crop removes tokens in every transformers version.
                extra = cache.get_seq_length() - context
                if extra > 0:
                    cache.crop(-extra)
                out = self.model(input_ids=next_ids, attention_mask=mask,
                                 position_ids=position_ids, use_cache=True, logits_to_keep=1,
                                 **{self.cache_kwarg: cache})
                out.logits[:, -1].argmax(-1)

        return run
