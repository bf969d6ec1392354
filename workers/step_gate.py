"""`StepGate`: a worker's steps run one at a time, in the order they were sent.

A GPU worker actor takes two calls at once (`WORKER_MAX_CONCURRENCY`) so that Ray's share
of a call, done on the actor's side, overlaps the step before it: while step n runs, Ray
receives and decodes step n+1 (sent ahead by the controller's async scheduling) on a
second thread, and step n's reply is encoded and sent while n+1 already runs. Without it
those costs sit between two steps, serial with the device. A CPU worker takes one call at
a time (`cluster.worker_overlap_calls`): there the overlap takes a core from the step's own
threads. The gate holds either way.

Each plan is a diff on the one before, so the gate restores the order: the sender numbers
its calls (`seq` 0, 1, 2, ...) under a name of its own (`sender`, new for every transport:
a restarted controller or a reopened worker starts again at 0), and call k waits until
call k-1 of the same sender has finished. The first call of a new sender goes once nothing
runs. A call without a number (a compiled graph, which delivers its steps in order on one
thread; `reset`, `held_block_ids`, calibration) only waits until nothing runs. Should a
numbered call's predecessor never come (its sender died mid-send), it waits until the
controller's step deadline restarts the worker.

A reset (a restarted controller forgetting every request) retires the sender whose steps
ran last (`retire`): its calls still queued, planned by a controller that is gone, are
refused (`RetiredSenderError`) instead of running on the state the reset cleared. Without
it such a call could run after the reset, since an unnumbered call and a numbered one
that both wait are let in in no particular order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Ray's `max_concurrency` of a worker actor that overlaps calls: the running step and the
# next one (`cluster.worker_overlap_calls`; a worker that does not takes one call at a time).
WORKER_MAX_CONCURRENCY = 2


class RetiredSenderError(RuntimeError):
    """A step numbered by a sender that a reset retired: its controller is gone."""


class StepGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._is_running = False
        self._sender: str | None = None
        self._next_seq = 0  # of `_sender`
        self._retired: set[str] = set()  # one per reset: bounded by controller restarts
        self.num_waiting = 0  # calls waiting for their turn

    def _is_turn(self, sender: str | None, seq: int | None) -> bool:
        if sender is not None and sender in self._retired:
            return True  # to be refused at once, not to run
        if self._is_running:
            return False
        if seq is None:
            return True
        return seq == (self._next_seq if sender == self._sender else 0)

    @contextmanager
    def turn(self, sender: str | None = None, seq: int | None = None) -> Iterator[None]:
        """Hold the worker for one call; with `seq`, only after the sender's earlier ones."""
        with self._cond:
            self.num_waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._is_turn(sender, seq))
            self.num_waiting -= 1
            if sender is not None and sender in self._retired:
                raise RetiredSenderError(f"step {seq} of sender {sender}, retired by a reset")
            self._is_running = True
            if seq is not None:
                self._sender, self._next_seq = sender, seq + 1
        try:
            yield
        finally:
            with self._cond:
                self._is_running = False
                self._cond.notify_all()

    def retire(self) -> None:
        """Refuse the last sender's steps from now on (call it inside a turn: a reset)."""
        with self._cond:
            if self._sender is not None:
                self._retired.add(self._sender)
            self._sender, self._next_seq = None, 0
            self._cond.notify_all()

    def wait_for_waiting(self, num: int, timeout_s: float) -> bool:
        """Until `num` calls wait for their turn (tests, stats); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.num_waiting >= num, timeout_s)
