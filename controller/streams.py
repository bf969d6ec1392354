"""Where the controller parks request deltas until their consumer takes them.

One `Subscriber` per ingress replica (or batch runner): it holds the deltas of every request
submitted for it, and `subscribe` yields one `DeltaBatch` per wake-up (about one per step)
instead of one item per request and token: a Ray streaming-generator item costs an
object and a report RPC on both sides, which on a busy node is as much CPU as a small
model's decode step. Deltas that pile up while a consumer is slow are merged, never dropped.
"""

from __future__ import annotations

import asyncio

from controller.messages import Delta, DeltaBatch, RequestOutput


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
