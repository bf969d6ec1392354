"""Where the controller parks request deltas until their consumer takes them.

One `Subscriber` per ingress replica (or batch runner): it holds the deltas of every request
submitted for it, and `subscribe` yields one `DeltaBatch` per wake-up (about one per step)
instead of one item per request and token: a Ray streaming-generator item costs an
object and a report RPC on both sides, which on a busy node is as much CPU as a small
model's decode step. Deltas that pile up while a consumer is slow are merged, never dropped.

`Streams` routes every output to its request's subscriber: through the journal and the
resume bookkeeping first, measuring latencies where the outputs leave. It is what the
step loops hand their outputs to (their `SlotListener`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from controller.core import ControllerCore
from controller.messages import Delta, DeltaBatch, RequestOutput, StepResult
from controller.request_metrics import RequestMetrics
from controller.resume import Resume


class Subscriber:
    def __init__(self) -> None:
        self.request_to_worker: dict[str, int] = {}  # its unfinished requests
        # Outputs not taken yet, with the worker each came from. Kept as they are: a
        # consumer that keeps up gets one per request per wake-up, written straight into
        # the batch's columns (no `Delta` object per token on the step loop).
        self.pending: dict[str, list[tuple[RequestOutput, int]]] = {}
        self.ready = asyncio.Event()

    def add(self, request_id: str, worker: int) -> None:
        self.request_to_worker[request_id] = worker

    def push(self, out: RequestOutput) -> None:
        worker = self.request_to_worker.get(out.request_id, -1)
        queued = self.pending.get(out.request_id)
        if queued is None:
            self.pending[out.request_id] = [(out, worker)]
        else:
            queued.append((out, worker))
        self.ready.set()

    async def next_batch(self) -> DeltaBatch:
        await self.ready.wait()
        self.ready.clear()
        pending, self.pending = self.pending, {}
        batch = DeltaBatch()
        for request_id, outs in pending.items():
            if len(outs) == 1:
                out, worker = outs[0]
                batch.append_output(out, worker)
                is_finished = out.finished
            else:
                delta = Delta.merge([Delta.from_output(out, w) for out, w in outs])
                batch.append(delta)
                is_finished = delta.is_finished
            if is_finished:
                self.request_to_worker.pop(request_id, None)
        return batch


class Streams:
    def __init__(self, resume: Resume, wake: Callable[[list[int]], None]) -> None:
        """`wake`: notify these workers' step loops (they received a failed worker's
        requests)."""
        self.resume = resume
        self.wake = wake
        self.subscribers: dict[str, Subscriber] = {}
        self.subscriber_of: dict[str, Subscriber] = {}  # request id -> its subscriber
        self.request_metrics = RequestMetrics()  # latencies measured where deltas leave

    def subscriber(self, name: str) -> Subscriber:
        """Get or create: Ray may start a `submit` before the subscriber's `subscribe`."""
        return self.subscribers.setdefault(name, Subscriber())

    def attach(self, request_id: str, sub: Subscriber, worker: int) -> None:
        sub.add(request_id, worker)
        self.subscriber_of[request_id] = sub

    def close(self, name: str, sub: Subscriber) -> list[str]:
        """The subscriber went away; returns its unfinished requests (to abort)."""
        self.subscribers.pop(name, None)
        for request_id in sub.request_to_worker:
            self.subscriber_of.pop(request_id, None)
        return list(sub.request_to_worker)

    def resume_stream(self, core: ControllerCore, sub: Subscriber, request_id: str,
                      num_delivered: int) -> bool:
        """Attach one journaled request to `sub`, its tokens from `num_delivered` on; False
        when this controller has none of that id."""
        unclaimed = self.resume.unclaimed.pop(request_id, None)
        if unclaimed is None:
            # Not journaled (admitted just before the crash, no journal, or one that could
            # not be read): nothing is pushed, the caller submits it again (its seed comes
            # from its id, so it runs to the same tokens).
            return False
        self.resume.num_resumed_streams += 1
        tokens, last = unclaimed.token_ids, unclaimed.last
        logprobs = unclaimed.logprobs
        out = RequestOutput(request_id, tokens[num_delivered:],
                            last.finish_reason if last else None,
                            unclaimed.num_prompt_tokens, len(tokens),
                            last.num_cached_tokens if last else 0,
                            last.error if last else None,
                            None if logprobs is None else logprobs[num_delivered:],
                            # echo's came with the first token: a consumer with one has them
                            unclaimed.prompt_logprobs if num_delivered == 0 else None)
        sub.add(request_id, core.request_to_worker.get(request_id, -1))
        if num_delivered > 0 and not out.finished:
            self.resume.has_prompt_logprobs.add(request_id)
        if num_delivered > len(tokens) and not out.finished:  # else nothing would pop it
            self.resume.num_to_skip[request_id] = num_delivered - len(tokens)
        if not out.finished:
            self.subscriber_of[request_id] = sub
        if out.new_token_ids or out.finished:
            sub.push(out)
        return True

    # -- the step loops' SlotListener ----------------------------------------------------
    def deliver(self, outputs: list[RequestOutput]) -> None:
        journal = self.resume.journal
        if journal is not None:
            journal.record_outputs(outputs)  # one lock per step, not per request
        now = asyncio.get_running_loop().time()  # the core's clock in the actor
        for out in outputs:
            taken = self.resume.intercept(out)
            if taken is None:
                continue
            self.request_metrics.on_output(taken, now)
            subscriber = self.subscriber_of.get(taken.request_id)
            if subscriber is not None and (taken.new_token_ids or taken.finished):
                subscriber.push(taken)

    def on_step(self, result: StepResult) -> None:
        self.resume.on_step(result)

    def on_requests_moved(self, workers: list[int]) -> None:
        self.wake(workers)
