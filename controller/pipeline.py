"""`StepPipeline`: one worker's steps in process, the controller's work hidden behind the
device's (async scheduling for `LocalEngine` and the GPU benchmark's engine).

Serially a step is plan, run, apply, and the device idles while the host plans and
applies. Here the worker's step is split in two: `launch(plan)` queues the step on the
device and returns, `wait(pending)` blocks until its result is on the host. One call of
`step()`, with step n launched on entry:

    plan n+1 (ahead)         while the device runs n
    wait n
    launch n+1               the device starts n+1 at once
    apply n, return n's outputs, while the device runs n+1

so the device only idles for the worker's own launch of the next step. Launching n+1 after
waiting for n is what keeps the worker simple: n's sampled tokens are on the host before
n+1's inputs are built, as they are in the worker actor, whose steps run one at a time.
The plan made ahead is the Ray step loop's (`ControllerCore.begin_step(is_ahead=True)`):
the tokens step n samples are pending in it, nobody is preempted in it, a request that
stops early was planned one step too far and that step's token is dropped. The outputs are
the same tokens as stepping serially (tests/engine/test_step_pipeline.py). On CPU `launch`
runs the whole step, so nothing overlaps but nothing changes either.

Torch-free: the worker is duck-typed (`launch`, `wait`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.core import ControllerCore
from controller.messages import RequestOutput, StepPlan, StepResult


@dataclass(frozen=True)
class PipelinedStep:
    """What one `StepPipeline.step` did: the step whose result it applied (None when
    there was nothing to run), and the host's time for the controller's two parts."""

    outputs: list[RequestOutput]
    plan: StepPlan | None
    result: StepResult | None
    plan_ahead_s: float  # planning the next step while this one ran
    apply_s: float  # applying this step's result while the next one runs


class StepPipeline:
    def __init__(self, core: ControllerCore, worker: int, launch: Callable[[StepPlan], Any],
                 wait: Callable[[Any], StepResult],
                 clock: Callable[[], float] | None = None) -> None:
        self.core, self.worker = core, worker
        self.launch, self.wait = launch, wait
        self.clock = clock or time.perf_counter
        self._in_flight: tuple[StepPlan, Any] | None = None  # launched, result not applied

    @property
    def is_in_flight(self) -> bool:
        return self._in_flight is not None

    def has_work(self) -> bool:
        return self._in_flight is not None or self.core.has_work(self.worker)

    def step(self) -> PipelinedStep:
        """Apply one step's result (launching it first when none runs); the next step is
        planned and launched before this one's result is applied."""
        core, w, clock = self.core, self.worker, self.clock
        if self._in_flight is None:
            state = core.workers[w]
            if not core.has_work(w):
                outputs, state.outbox = state.outbox, []
                return PipelinedStep(outputs, None, None, 0.0, 0.0)
            plan = core.begin_step(w)
            self._in_flight = (plan, self.launch(plan))
        plan, pending = self._in_flight
        t0 = clock()
        ahead = None
        if core.can_plan_ahead(w):
            ahead = core.begin_step(w, is_ahead=True)
            if ahead.is_empty and not ahead.finished_request_ids:
                core.discard_step(w, ahead)
                ahead = None
        t1 = clock()
        self._in_flight = None
        result = self.wait(pending)
        if ahead is not None:
            self._in_flight = (ahead, self.launch(ahead))
        t2 = clock()
        outputs = core.finish_step(w, plan, result)
        return PipelinedStep(outputs, plan, result, t1 - t0, clock() - t2)

    def drain(self) -> list[RequestOutput]:
        """Apply the step in flight, if any, launching nothing after it."""
        if self._in_flight is None:
            return []
        plan, pending = self._in_flight
        self._in_flight = None
        return self.core.finish_step(self.worker, plan, self.wait(pending))
