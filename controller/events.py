"""Double-buffered event queue for `chunk_complete` / `cache_evict` (docs/architecture.md).

Producers (result handling, aborts, preemptions) append to the front buffer while the consumer
(the worker's step loop, once per step) takes the back buffer; `drain()` swaps the two under a
lock. Every event appended before a `drain()` is in that drain's batch and every later one in a
later batch: none is lost or handled twice. The consumer never iterates a list a producer is
appending to, so producers never wait for event handling, only for a pointer swap.

`on_append` is called after every append outside the lock: the controller uses it to wake the
step loop, so a `cache_evict` that arrives while the loop is parked is never missed.
Torch-free and Ray-free; thread-safe (the lock costs nothing in the single-threaded actor and
keeps the class correct for threaded producers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

E = TypeVar("E")


class DoubleBufferedEventQueue(Generic[E]):
    def __init__(self, on_append: Callable[[], None] | None = None) -> None:
        self._front: list[E] = []  # producers write here
        self._back: list[E] = []  # handed to the consumer by the last drain
        self._lock = threading.Lock()
        self._on_append = on_append
        self.num_appended = 0
        self.num_drained = 0

    def append(self, event: E) -> None:
        with self._lock:
            self._front.append(event)
            self.num_appended += 1
        if self._on_append is not None:
            self._on_append()

    def extend(self, events: Iterable[E]) -> None:
        batch = list(events)
        if not batch:
            return
        with self._lock:
            self._front.extend(batch)
            self.num_appended += len(batch)
        if self._on_append is not None:
            self._on_append()

    def drain(self) -> list[E]:
        """Swap the buffers and return every event appended since the previous drain.

        The returned list is the consumer's until the next drain; the old back buffer is
        reused as the new front (cleared first), so steady state allocates nothing."""
        with self._lock:
            self._back.clear()
            self._front, self._back = self._back, self._front
            self.num_drained += len(self._back)
            return self._back

    def __len__(self) -> int:
        """Events waiting for the next drain."""
        with self._lock:
            return len(self._front)

    def __bool__(self) -> bool:
        return len(self) > 0
