"""`StepLoop`: one worker's steps, the one place that sequences plan, launch, wait, apply.

Chosen once, when the loop is built: one step at a time, or planned ahead
(`scheduler.async_scheduling`), as vLLM's engine core picks its step function once. One
step, with `launched` the step to wait for:

    begin()        the step launched ahead, else plan one and launch it now
    plan_ahead()   planned ahead only: plan step n+1 and launch it behind n
    wait(n)        the worker's result of n (the device starts n+1 at once)
    finish(n)      apply n, handle its events, return its outputs

so planning n+1 and applying n overlap the device. The step planned ahead is
`ControllerCore.begin_step(is_ahead=True)`'s: the tokens n samples are pending in it,
nobody is preempted in it, and a request that stops early was planned one step too far
(that step's token is dropped): the tokens are those of stepping serially
(tests/unit/test_step_pipeline.py). A plan ahead that carries nothing (no token, finished
id or block move: `StepPlan.carries_nothing`) is discarded, never launched.

The worker is a `launch` / `wait` pair. `launch(plan)` submits a step behind any step
already submitted and returns what `wait` takes. A worker actor orders its calls itself
(`workers/step_gate.py`), so the Ray loop hands its transport's `send` as `launch` and
awaits the result on its own (`begin`, `plan_ahead`, `finish` are the phases it calls, in
this order, with its failure handling between them). An in-process worker holds one
launched step at a time (`Worker.launch` refuses a second): given `wait` too, the loop
queues the step launched ahead and launches it as soon as the running one is waited for,
which keeps the worker's inputs on the host (n's tokens are known when n+1's are built).
`step()` then runs the whole sequence synchronously: `LocalEngine`, the benchmarks and
the tests drive that.

Torch-free and Ray-free: the worker is duck-typed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.core import ControllerCore
from controller.messages import RequestOutput, StepPlan, StepResult


@dataclass(frozen=True)
class Launched:
    """A step handed to the worker: its plan, what `launch` returned, and when planning it
    began (the host clock)."""

    plan: StepPlan
    pending: Any
    planned_at: float


@dataclass(frozen=True)
class StepOutcome:
    """What one synchronous `StepLoop.step` did: the step whose result it applied (None
    when there was nothing to run) and the host's time for its parts."""

    outputs: list[RequestOutput]
    plan: StepPlan | None
    result: StepResult | None
    plan_s: float  # planning in this call: the step itself (serially) and the one ahead
    execute_s: float  # the worker's launch and wait of this step, planning ahead excluded
    apply_s: float  # applying this step's result (with planning ahead: while the next runs)


class _OneAtATime:
    """The launch / wait pair of a worker that holds one launched step: a step launched
    while another runs is held here and launched once the running one is waited for."""

    def __init__(self, launch: Callable[[StepPlan], Any], wait: Callable[[Any], StepResult]
                 ) -> None:
        self._launch, self._wait = launch, wait
        self._running: tuple[StepPlan, Any] | None = None
        self._queued: StepPlan | None = None

    def launch(self, plan: StepPlan) -> StepPlan:
        if self._running is None:
            self._running = (plan, self._launch(plan))
        else:
            assert self._queued is None, "at most one step waits behind the running one"
            self._queued = plan
        return plan

    def wait(self, plan: StepPlan) -> StepResult:
        assert self._running is not None and self._running[0] is plan, "waited out of order"
        _, pending = self._running
        self._running = None
        result = self._wait(pending)
        if self._queued is not None:
            queued, self._queued = self._queued, None
            self._running = (queued, self._launch(queued))
        return result


class StepLoop:
    def __init__(self, core: ControllerCore, worker: int, launch: Callable[[StepPlan], Any],
                 wait: Callable[[Any], StepResult] | None = None, *, is_ahead: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        """`launch` submits a step behind those submitted before (a worker actor's
        transport); with `wait`, the worker holds one launched step at a time (in process)
        and `step()` drives it synchronously. `is_ahead`: plan each step while the one
        before it runs."""
        self.core, self.worker, self.is_ahead = core, worker, is_ahead
        self.clock = clock or time.perf_counter
        self.wait: Callable[[Any], StepResult] | None = None
        if wait is not None:
            one = _OneAtATime(launch, wait)
            launch, self.wait = one.launch, one.wait
        self._launch = launch
        self._ahead: Launched | None = None  # launched ahead, not waited for yet
        self._planning_s = 0.0  # host time spent planning since `step` last read it

    @classmethod
    def serial(cls, core: ControllerCore, worker: int,
               execute: Callable[[StepPlan], StepResult]) -> StepLoop:
        """One step at a time over a worker's `execute` (a test's or a benchmark's)."""
        return cls(core, worker, execute, lambda result: result)

    @property
    def is_in_flight(self) -> bool:
        return self._ahead is not None

    def has_work(self) -> bool:
        return self._ahead is not None or self.core.has_work(self.worker)

    # -- the phases ------------------------------------------------------------------------
    def begin(self, force: bool = True) -> Launched | None:
        """The step to wait for next: the one launched ahead, else one planned and launched
        now. None when there is nothing to run: no work, or (unless `force`) a plan that
        carries nothing, which is discarded (flow control holds everything back)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return ahead
        core, w = self.core, self.worker
        if not core.has_work(w):
            return None
        planned_at = self.clock()
        plan = core.begin_step(w)
        self._planning_s += self.clock() - planned_at
        if not force and plan.carries_nothing:
            core.discard_step(w, plan)
            return None
        return Launched(plan, self._launch(plan), planned_at)

    def plan_ahead(self) -> None:
        """With planning ahead, while the step just begun runs: plan the next one and launch
        it behind it (a plan that carries nothing is discarded)."""
        core, w = self.core, self.worker
        if not self.is_ahead or not core.can_plan_ahead(w):
            return
        planned_at = self.clock()
        plan = core.begin_step(w, is_ahead=True)
        self._planning_s += self.clock() - planned_at
        if plan.carries_nothing:
            core.discard_step(w, plan)
            return
        self._ahead = Launched(plan, self._launch(plan), planned_at)

    def finish(self, launched: Launched, result: StepResult) -> list[RequestOutput]:
        return self.core.finish_step(self.worker, launched.plan, result)

    def take_outbox(self) -> list[RequestOutput]:
        """Outputs waiting with no step to carry them (a protection's aborts)."""
        return self.core.take_outbox(self.worker)

    def forget_in_flight(self) -> None:
        """The worker failed: the step launched ahead is lost with its state."""
        self._ahead = None

    # -- synchronous -----------------------------------------------------------------------
    def step(self) -> StepOutcome:
        """Apply one step's result (launching it first when none runs); with planning
        ahead, the next step is planned and launched before this one's is applied."""
        assert self.wait is not None, "a synchronous loop needs the worker's wait"
        clock = self.clock
        self._planning_s = 0.0
        t0 = clock()
        launched = self.begin()
        if launched is None:
            return StepOutcome(self.take_outbox(), None, None, self._planning_s, 0.0, 0.0)
        self.plan_ahead()
        result = self.wait(launched.pending)
        t1 = clock()
        outputs = self.finish(launched, result)
        plan_s = self._planning_s
        return StepOutcome(outputs, launched.plan, result, plan_s, t1 - t0 - plan_s,
                           clock() - t1)

    def drain(self) -> list[RequestOutput]:
        """Apply the step launched ahead, if any, launching nothing after it."""
        assert self.wait is not None, "a synchronous loop needs the worker's wait"
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return []
        return self.finish(ahead, self.wait(ahead.pending))
