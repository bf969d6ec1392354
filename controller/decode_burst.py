"""Decode bursts (`scheduler.decode_steps`, vLLM's multi-step scheduling): one plan that the
worker runs several decode steps in a row.

Served on a small CPU, a decode step is not only the model's work: the controller plans and
applies it, the plan and its result cross Ray, and those processes take the cores that the
step's threads need (docs/peer.md). A burst pays all of that once for `num_steps` tokens of
every running request. The plan is an ordinary decode-only one (each request 1 token) with
`StepPlan.num_steps` > 1; the scheduler allocates the blocks of every step up front and
counts `num_steps` tokens computed and pending per request; the worker runs the spans
`num_steps` times, each on the token the time before sampled, and returns each request's
tokens as one list; the results side appends them up to the first that stops the request
(an EOS or a stop token id inside the burst: what follows was computed and is dropped, as
a step planned ahead of a stop is). Greedy and seeded tokens are those of single steps.

A burst is planned only when nothing else could run and nothing needs a token-by-token
answer from outside the worker (`burst_len`). Torch-free.
"""

from __future__ import annotations

from typing import Protocol

from controller.request import Request
from controller.scheduler_config import SchedulerConfig, StepLimits
from kvcache.manager import KVCacheManager


class Planning(Protocol):
    """What `burst_len` reads of the scheduler planning the step."""

    max_decode_steps: int
    config: SchedulerConfig
    waiting: dict[str, Request]
    running: list[Request]
    kv: KVCacheManager


def burst_len(sched: Planning, limits: StepLimits) -> int:
    """Decode steps the next plan runs in a row: more than one only when every running
    request decodes and nobody waits who could be admitted (a burst delays them), flow
    control does not throttle, no request asks for what is checked token by token outside
    the worker's loop (log-probabilities, a grammar, stop strings), never past a request's
    max_tokens or the model's length, and only when the pool holds every request's blocks
    for the whole burst (the allocations then cannot preempt anyone)."""
    steps, config = sched.max_decode_steps, sched.config
    could_admit = bool(sched.waiting) and len(sched.running) < config.max_num_seqs
    if (steps <= 1 or could_admit or not sched.running
            or len(sched.running) > config.max_num_batched_tokens
            or (limits.max_chunks is not None
                and limits.max_chunks < config.max_concurrent_chunks)):
        return 1
    for request in sched.running:
        params = request.sampling_params
        if (not request.is_decoding or params.logprobs is not None
                or params.prompt_logprobs is not None or params.grammar_kind or params.stop):
            return 1
        steps = min(steps, params.max_tokens - request.num_outputs_planned)
        if request.max_model_len is not None:
            steps = min(steps, request.max_model_len - request.num_tokens
                        - request.num_pending_outputs)
        if steps <= 1:
            return 1
    needed = sum(sched.kv.num_blocks_needed(r.request_id, r.num_computed_tokens + steps)
                 for r in sched.running)
    return steps if sched.kv.pool.can_allocate(needed) else 1
