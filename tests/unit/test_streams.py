"""`Subscriber` (controller/streams.py): outputs parked per request until the consumer takes
a batch; one output goes into the batch's columns as it is, several are merged, and a
finished request leaves the subscriber."""

from __future__ import annotations

import asyncio

from controller.messages import Delta, FinishReason, RequestOutput
from controller.streams import Subscriber


def test_a_batch_carries_every_token_once_merged_per_request() -> None:
    sub = Subscriber()
    sub.add("a", 0)
    sub.add("b", 1)
    sub.push(RequestOutput("a", [5], None, 3, 1))
    sub.push(RequestOutput("b", [7], None, 4, 1, 2))
    sub.push(RequestOutput("a", [6], None, 3, 2, error="slow"))  # the consumer fell behind
    sub.push(RequestOutput("a", [9], FinishReason.LENGTH, 3, 3))
    batch = asyncio.run(sub.next_batch())
    assert list(batch) == [Delta("a", 0, [5, 6, 9], FinishReason.LENGTH, 3, 3, 0, "slow"),
                           Delta("b", 1, [7], None, 4, 1, 2, None)]
    assert batch.finished_ids() == ["a"]
    assert sub.request_to_worker == {"b": 1}  # the finished one is gone
    assert sub.pending == {} and not sub.ready.is_set()
    sub.push(RequestOutput("b", [], FinishReason.ABORT, 4, 1, error="aborted"))
    (delta,) = asyncio.run(sub.next_batch())
    assert delta == Delta("b", 1, [], FinishReason.ABORT, 4, 1, 0, "aborted")
    assert sub.request_to_worker == {}
