"""Greedy streams through the controller's one protocol, with a process killed mid-run.

Shared by the chaos tests (`tests/integration/test_*_restart.py`) and the chaos benchmark:
every stream's tokens, finish reason, error, the longest wait between two of its deltas
(the pause a client saw) and the worker it was admitted to.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.controller_client import RayControllerClient
from controller.messages import SamplingParams, TokenLogprob


@dataclass
class StreamResult:
    token_ids: list[int]
    finish_reason: str | None
    error: str | None
    longest_wait_s: float
    # One per token when the params ask; None once a delta with tokens came without them.
    logprobs: list[TokenLogprob] | None = field(default_factory=list)
    worker: int = -1  # the worker it was admitted to


async def stream(client: RayControllerClient, prompt: list[int], params: SamplingParams,
                 request_id: str, on_started: Callable[[int], None] | None = None
                 ) -> StreamResult:
    """One request to its end; `on_started(its worker)` once it has 2 tokens."""
    ack, deltas = await client.submit(prompt, params, request_id, 0, "default")
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
    finish, error = None, None
    last, longest_wait = time.monotonic(), 0.0
    async for delta in deltas:
        now = time.monotonic()
        longest_wait, last = max(longest_wait, now - last), now
        tokens.extend(delta.token_ids)
        if logprobs is not None and delta.token_ids:
            if delta.logprobs is None or len(delta.logprobs) != len(delta.token_ids):
                raise AssertionError(f"{request_id}: a delta's tokens without log-probabilities")
            logprobs.extend(delta.logprobs)
        finish = delta.finish_reason or finish
        error = delta.error or error
        if on_started is not None and len(tokens) >= 2 > len(tokens) - len(delta.token_ids):
            on_started(ack.worker)
    return StreamResult(tokens, finish, error, longest_wait, logprobs, ack.worker)


async def run_streams(client: RayControllerClient, prompts: list[list[int]],
                      params: SamplingParams, tag: str,
                      kill: Callable[[], Awaitable[None]] | None = None,
                      num_started_before_kill: int = 4, timeout_s: float = 300.0,
                      kill_after_worker: int | None = None) -> list[StreamResult]:
    """Every prompt at once; with `kill`, call it once `num_started_before_kill` streams
    have 2 tokens (the kill lands mid-stream), counting only the streams admitted to
    `kill_after_worker` when given (the kill then lands while that worker streams)."""
    started = asyncio.Event()
    num_started = [0]

    def on_started(worker: int) -> None:
        if kill_after_worker is not None and worker != kill_after_worker:
            return
        num_started[0] += 1
        if num_started[0] >= num_started_before_kill:
            started.set()

    tasks = [asyncio.create_task(stream(client, prompt, params, f"{tag}-{j}", on_started))
             for j, prompt in enumerate(prompts)]
    if kill is not None:
        await asyncio.wait_for(started.wait(), 120)
        await kill()
    return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout_s))


def summary(pauses: list[float], runs: list[list[StreamResult]],
            reference: list[StreamResult]) -> dict[str, Any]:
    """A chaos scenario's row: the pause (the longest wait of any stream per repetition,
    P50 / max over them), requests lost (errors or unfinished; goal 0) and outputs
    identical to the reference (goal: all)."""
    num_lost = sum(1 for run in runs for r in run
                   if r.error is not None or r.finish_reason is None)
    num_identical = sum(1 for run in runs for r, ref in zip(run, reference, strict=True)
                        if r.token_ids == ref.token_ids)
    return {"num_repetitions": len(runs), "num_requests": sum(len(run) for run in runs),
            "pause_s": {"p50": statistics.median(pauses), "max": max(pauses),
                        "each": pauses},
            "num_requests_lost": num_lost, "num_outputs_identical": num_identical,
            "all_identical": num_identical == sum(len(run) for run in runs)}
