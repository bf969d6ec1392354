"""`StepGate`: a worker actor takes two calls at once, yet runs its steps one at a time in
the order the controller numbered them (real threads, as Ray's thread pool runs them)."""

from __future__ import annotations

import threading

import pytest

from workers.step_gate import RetiredSenderError, StepGate

TIMEOUT_S = 30.0


def _start(gate: StepGate, order: list[str], name: str, sender: str | None,
           seq: int | None, hold: threading.Event | None = None) -> threading.Thread:
    """A call on its own thread; with `hold`, it keeps its turn until `hold` is set and
    returns only once it has its turn."""
    entered = threading.Event()

    def run() -> None:
        with gate.turn(sender, seq):
            order.append(name)
            entered.set()
            if hold is not None:
                assert hold.wait(TIMEOUT_S)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if hold is not None:
        assert entered.wait(TIMEOUT_S)
    return thread


def _joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()


def _waiting(gate: StepGate, num: int) -> None:
    assert gate.wait_for_waiting(num, TIMEOUT_S), f"{gate.num_waiting} waiting, not {num}"


def test_steps_that_arrive_out_of_order_run_in_the_order_numbered() -> None:
    gate, order, hold = StepGate(), [], threading.Event()
    threads = [_start(gate, order, "s0", "a", 0, hold)]
    # Ray hands the next calls to threads in any order: 3 and 2 arrive before 1.
    for seq in (3, 2, 1):
        threads.append(_start(gate, order, f"s{seq}", "a", seq))
    _waiting(gate, 3)
    assert order == ["s0"]  # step 0 still runs: nothing else may
    hold.set()
    _joined(threads)
    assert order == ["s0", "s1", "s2", "s3"]


def test_a_later_step_waits_for_its_predecessor_even_when_nothing_runs() -> None:
    gate, order = StepGate(), []
    with gate.turn("a", 0):
        pass
    later = _start(gate, order, "s2", "a", 2)
    _waiting(gate, 1)
    assert order == []  # step 1 has not come
    _joined([_start(gate, order, "s1", "a", 1), later])
    assert order == ["s1", "s2"]


def test_a_new_sender_starts_at_zero_and_its_later_steps_wait_for_it() -> None:
    """A restarted controller (or a transport reopened on a new incarnation) numbers
    from 0 again under a new name; its step 1 must not overtake its step 0."""
    gate, order = StepGate(), []
    for seq in range(5):
        with gate.turn("old", seq):
            pass
    second = _start(gate, order, "new1", "new", 1)
    _waiting(gate, 1)
    _joined([_start(gate, order, "new0", "new", 0), second])
    assert order == ["new0", "new1"]


@pytest.mark.parametrize("call", ["reset", "held_block_ids"])
def test_an_unnumbered_call_waits_for_the_running_step(call: str) -> None:
    gate, order, hold = StepGate(), [], threading.Event()
    step = _start(gate, order, "s0", "a", 0, hold)
    other = _start(gate, order, call, None, None)
    _waiting(gate, 1)
    assert order == ["s0"]
    hold.set()
    _joined([step, other])
    assert order == ["s0", call]


def test_a_step_that_raises_releases_the_gate() -> None:
    gate, order = StepGate(), []
    with pytest.raises(RuntimeError, match="step failed"), gate.turn("a", 0):
        raise RuntimeError("step failed")
    _joined([_start(gate, order, "s1", "a", 1)])
    assert order == ["s1"]


def test_a_reset_refuses_the_steps_its_gone_controller_still_queued() -> None:
    """A restarted controller resets the worker: a step the dead one sent (here 2, waiting
    for 1, which never comes) must not run on the cleared state, even once 1 is due; a new
    sender numbers from 0 and runs."""
    gate, order = StepGate(), []
    with gate.turn("old", 0):
        pass
    errors: list[BaseException] = []

    def stale() -> None:
        try:
            with gate.turn("old", 2):
                order.append("old2")
        except RetiredSenderError as err:
            errors.append(err)

    thread = threading.Thread(target=stale, daemon=True)
    thread.start()
    _waiting(gate, 1)
    with gate.turn():  # the reset
        gate.retire()
    _joined([thread])
    assert order == [] and len(errors) == 1
    with pytest.raises(RetiredSenderError), gate.turn("old", 1):
        order.append("old1")
    _joined([_start(gate, order, "new0", "new", 0)])
    assert order == ["new0"]
