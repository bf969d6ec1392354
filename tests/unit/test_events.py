"""The double-buffered event queue: nothing lost, nothing handled twice, wake-ups fire."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from controller.events import DoubleBufferedEventQueue


def test_drain_returns_events_in_order_and_swaps() -> None:
    queue: DoubleBufferedEventQueue[int] = DoubleBufferedEventQueue()
    queue.append(1)
    queue.extend([2, 3])
    assert len(queue) == 3
    assert queue.drain() == [1, 2, 3]
    assert not queue and queue.drain() == []
    queue.append(4)
    assert queue.drain() == [4]
    assert (queue.num_appended, queue.num_drained) == (4, 4)


def test_appends_during_consumption_go_to_the_next_batch() -> None:
    queue: DoubleBufferedEventQueue[str] = DoubleBufferedEventQueue()
    queue.extend(["a", "b"])
    batch = queue.drain()
    seen = []
    for event in batch:  # a producer appends while the consumer walks its batch
        seen.append(event)
        queue.append(event.upper())
    assert seen == ["a", "b"] and batch == ["a", "b"]
    assert queue.drain() == ["A", "B"]


def test_on_append_fires_for_every_non_empty_append() -> None:
    calls = []
    queue: DoubleBufferedEventQueue[int] = DoubleBufferedEventQueue(lambda: calls.append(1))
    queue.append(1)
    queue.extend([])
    queue.extend([2, 3])
    assert len(calls) == 2


@given(st.lists(st.lists(st.integers(), max_size=5), max_size=30), st.data())
def test_interleaved_appends_and_drains_lose_nothing(batches: list[list[int]],
                                                     data: st.DataObject) -> None:
    queue: DoubleBufferedEventQueue[int] = DoubleBufferedEventQueue()
    drained: list[int] = []
    for batch in batches:
        queue.extend(batch)
        if data.draw(st.booleans()):
            drained += queue.drain()
    drained += queue.drain()
    assert drained == [e for batch in batches for e in batch]


def test_threaded_producers_lose_nothing() -> None:
    queue: DoubleBufferedEventQueue[tuple[int, int]] = DoubleBufferedEventQueue()
    num_threads, per_thread = 4, 2000
    drained: list[tuple[int, int]] = []
    done = threading.Event()

    def produce(t: int) -> None:
        for i in range(per_thread):
            queue.append((t, i))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    while not done.is_set():
        drained += queue.drain()
        if not any(thread.is_alive() for thread in threads):
            done.set()
    drained += queue.drain()
    assert sorted(drained) == sorted((t, i) for t in range(num_threads)
                                     for i in range(per_thread))
    for t in range(num_threads):  # each producer's events stay in its order
        assert [i for tt, i in drained if tt == t] == list(range(per_thread))
