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
answer from outside the worker (`burst_len`).

A chunk burst (`scheduler.chunk_steps`, `chunk_burst`) is the same for the steps
that chunk one prompt beside the decodes: the plan's one chunk span of `n` tokens runs
`num_steps` times too, each time on the prompt's next `n` tokens (the worker's state
advances as in single steps), with the same decodes each time. Its last chunk is never in
one (it samples, and would decode after), so the chunk's request has no pending output.
Torch-free.
"""

from __future__ import annotations

from typing import Protocol

from controller.request import Request
from controller.scheduler_config import SchedulerConfig, StepLimits, StepShape
from controller.tenants import TenantStats
from kvcache.manager import KVCacheManager


class Planning(Protocol):
    """What `burst_len` and `chunk_burst` read of the scheduler planning the step."""

    max_decode_steps: int
    max_chunk_steps: int
    config: SchedulerConfig
    waiting: dict[str, Request]
    running: list[Request]
    kv: KVCacheManager
    last_shape: StepShape
    tenant_stats: TenantStats
    requests: dict[str, Request]


def burst_len(sched: Planning, limits: StepLimits) -> int:
    """Decode steps the next plan runs in a row: more than one only when every running
    request decodes and nobody waits who could be admitted (a burst delays them), flow
    control does not throttle, no request asks for what is checked token by token outside
    the worker's loop (log-probabilities, a grammar, stop strings), never past a request's
    max_tokens or the model's length, and only when the pool holds every request's blocks
    for the whole burst (the allocations then cannot preempt anyone)."""
    steps, config = sched.max_decode_steps, sched.config
    if (steps <= 1 or _could_admit(sched) or not sched.running
            or len(sched.running) > config.max_num_batched_tokens or _is_throttled(sched, limits)):
        return 1
    for request in sched.running:
        if not request.is_decoding:
            return 1
        steps = _decode_steps(request, steps)
        if steps <= 1:
            return 1
    needed = sum(sched.kv.num_blocks_needed(r.request_id, r.num_computed_tokens + steps)
                 for r in sched.running)
    return steps if sched.kv.pool.can_allocate(needed) else 1


def chunk_burst(sched: Planning, limits: StepLimits, scheduled: dict[str, int]) -> int:
    """Turn a planned single step (before its plan is filled) into a chunk burst when it
    may be one; -> its steps. One: the step carries one chunk and every running request,
    nobody waits who could be admitted, flow control does not throttle, the decodes pass
    `burst_len`'s checks, the chunk leaves the prompt unfinished after the whole burst and
    scores no prompt, and the pool holds every request's blocks for it. Then their blocks
    are allocated for all the steps and the tenants' counts take the extra steps."""
    steps = sched.max_chunk_steps
    chunks = sched.last_shape.chunks
    if (steps <= 1 or len(chunks) != 1 or len(scheduled) != len(sched.running)
            or _could_admit(sched) or _is_throttled(sched, limits)):
        return 1
    for request_id, num_new in scheduled.items():
        request = sched.requests[request_id]
        if request_id in chunks:
            if request.sampling_params.prompt_logprobs is not None:
                return 1
            # Strictly: a chunk that ends the prompt samples (and decodes after).
            steps = min(steps, (request.num_tokens_to_compute - 1) // num_new)
        else:
            steps = _decode_steps(request, steps)
        if steps <= 1:
            return 1
    totals = {rid: sched.requests[rid].num_computed_tokens + steps * num_new
              for rid, num_new in scheduled.items()}
    needed = sum(sched.kv.num_blocks_needed(rid, total) for rid, total in totals.items())
    if not sched.kv.pool.can_allocate(needed):
        return 1
    for request_id, total in totals.items():
        allocated = sched.kv.allocate_slots(request_id, total)
        assert allocated is not None  # the pool was asked for all of them just now
        request = sched.requests[request_id]
        sched.tenant_stats.add(request.tenant, (steps - 1) * scheduled[request_id],
                               is_prefill=request_id in chunks)
    return steps


def _could_admit(sched: Planning) -> bool:
    """Someone waits who could be admitted now: a burst would delay them."""
    return bool(sched.waiting) and len(sched.running) < sched.config.max_num_seqs


def _is_throttled(sched: Planning, limits: StepLimits) -> bool:
    return limits.max_chunks is not None and limits.max_chunks < sched.config.max_concurrent_chunks


def _decode_steps(request: Request, steps: int) -> int:
    """The burst a decoding request allows, at most `steps`: 1 for what is checked token by
    token outside the worker's loop, never past its max_tokens or the model's length."""
    params = request.sampling_params
    if (params.logprobs is not None or params.prompt_logprobs is not None
            or params.grammar_kind or params.stop):
        return 1
    steps = min(steps, params.max_tokens - request.num_outputs_planned)
    if request.max_model_len is not None:
        steps = min(steps, request.max_model_len - request.num_tokens
                    - request.num_pending_outputs)
    return steps
