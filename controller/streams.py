"""Where the controller parks request deltas until their consumer takes them.

Two shapes, because a Ray streaming-generator item costs an object and a report RPC on both
sides, which on a busy node is as much CPU as a small model's decode step:
- `RequestStream`: one request, one consumer (`generate`, the batch runner);
- `Subscriber`: every request of one ingress replica; `subscribe` yields one list of deltas
  per wake-up (about one per step) instead of one item per request and token.
Deltas that pile up while a consumer is slow are merged, never dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from controller.request import RequestOutput


def merge_deltas(items: list[RequestOutput], worker: int) -> dict[str, Any]:
    """Several deltas of one request as one message (the last one's counters win)."""
    last = items[-1]
    return {"request_id": last.request_id, "worker": worker,
            "token_ids": [t for out in items for t in out.new_token_ids],
            "finish_reason": last.finish_reason, "num_prompt_tokens": last.num_prompt_tokens,
            "num_output_tokens": last.num_output_tokens,
            "num_cached_tokens": last.num_cached_tokens,
            "error": next((out.error for out in items if out.error), None)}


def ack(request_id: str, worker: int, num_prompt_tokens: int) -> dict[str, Any]:
    """The admission acknowledgement: an empty delta naming the worker."""
    return merge_deltas([RequestOutput(request_id, [], None, num_prompt_tokens, 0)], worker)


class RequestStream:
    def __init__(self) -> None:
        self.items: list[RequestOutput] = []
        self.ready = asyncio.Event()

    def push(self, out: RequestOutput) -> None:
        self.items.append(out)
        self.ready.set()

    async def next_delta(self, worker: int) -> dict[str, Any]:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return merge_deltas(items, worker)


class Subscriber:
    def __init__(self) -> None:
        self.workers: dict[str, int] = {}  # its unfinished requests -> their worker
        self.pending: dict[str, list[RequestOutput]] = {}
        self.ready = asyncio.Event()

    def add(self, request_id: str, worker: int) -> None:
        self.workers[request_id] = worker

    def push(self, out: RequestOutput) -> None:
        self.pending.setdefault(out.request_id, []).append(out)
        self.ready.set()

    async def next_batch(self) -> list[dict[str, Any]]:
        await self.ready.wait()
        self.ready.clear()
        pending, self.pending = self.pending, {}
        batch = []
        for request_id, items in pending.items():
            delta = merge_deltas(items, self.workers.get(request_id, -1))
            if delta["finish_reason"] is not None:
                self.workers.pop(request_id, None)
            batch.append(delta)
        return batch
