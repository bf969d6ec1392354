"""Drive a `LocalEngine` in virtual time whose only source is real step durations.

A serving benchmark wants real-time behaviour (arrivals land while steps run, a request waits
for the step in flight) without sleeping through idle gaps. So every `engine.step()` runs for
real, timed with `perf_counter`, and a virtual clock advances by exactly that duration; an
arrival is handed to the engine once the clock has passed its time (that is, at the end of
the step in flight, as a real server's scheduler would first see it); when nothing runs, the
clock jumps to the next arrival. A busy neighbour on the machine can then only stretch step
durations, never the idle gaps between requests.

Engines under comparison run interleaved, one step each in turn (`drive_together`), each on
its own clock: a burst of load from a neighbour then stretches every policy's steps alike, the
way `benchmarks/timing.py` alternates workloads.

The engine's controller reads the same clock (`LocalEngine(clock=...)`), so flow-control
hold times and chunk timeouts run in virtual time too. A token's timestamp is the virtual
time at the end of the step that produced it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.engine import LocalEngine
from controller.messages import SamplingParams


class VirtualClock:
    """Seconds of virtual time; only `drive` moves it, and only forward."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance_to(self, time_s: float) -> None:
        self.now = max(self.now, time_s)


@dataclass(frozen=True)
class Arrival:
    time_s: float
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestTrace:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    aborted: bool = False


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    duration_s: float
    decode_tokens: int  # requests that had sampled before: 1 token each
    prefill: dict[str, int]  # request id -> prompt tokens computed in this step
    mode: str  # flow-control mode when the step was planned

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefill.values())


@dataclass
class Trace:
    requests: dict[str, RequestTrace] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0

    def ids(self, prefix: str = "") -> list[str]:
        return [rid for rid in self.requests if rid.startswith(prefix)]


# Called after every step with the trace so far; returns arrivals to add (scripted scenes:
# "when everyone decodes, a long prompt lands").
Hook = Callable[[Trace, float], list[Arrival]]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _add(engine: LocalEngine, trace: Trace, arrival: Arrival) -> None:
    params = SamplingParams(max_tokens=arrival.max_tokens, **GREEDY)  # type: ignore[arg-type]
    engine.add_request(arrival.prompt, params, request_id=arrival.request_id)
    trace.requests[arrival.request_id] = RequestTrace(arrival.time_s, len(arrival.prompt),
                                                      arrival.max_tokens)


class Driver:
    """One engine's run through a workload, one real step at a time, so several engines can
    be advanced in turn (`drive_together`) and share whatever load the machine has."""

    def __init__(self, engine: LocalEngine, clock: VirtualClock, arrivals: list[Arrival],
                 hook: Hook | None = None) -> None:
        self.engine, self.clock, self.hook = engine, clock, hook
        self.pending = deque(sorted(arrivals, key=lambda a: a.time_s))
        self.trace = Trace(start_s=clock.now, end_s=clock.now)

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished()

    def _admit_due(self) -> None:
        while self.pending and self.pending[0].time_s <= self.clock.now:
            _add(self.engine, self.trace, self.pending.popleft())

    def step(self) -> None:
        """Hand over due arrivals (jumping over idle time), then run one engine step."""
        self._admit_due()
        while not self.engine.has_unfinished():
            if not self.pending:
                return
            self.clock.advance_to(self.pending[0].time_s)  # idle: nothing to time
            self._admit_due()
        engine, trace = self.engine, self.trace
        engine.keep_step_log = True
        mode = engine.core.workers[0].flow.mode.name
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        step_start = self.clock.now
        self.clock.now += elapsed
        plan, _ = engine.step_log.pop()
        engine.keep_step_log = False
        decodes, prefill = 0, {}
        for rid, num in plan.num_scheduled_tokens.items():
            req = trace.requests.get(rid)
            if req is not None and req.token_times and num == 1:
                decodes += 1
            else:
                prefill[rid] = num
        trace.steps.append(StepRecord(step_start, elapsed, decodes, prefill, mode))
        for out in outputs:
            req = trace.requests[out.request_id]
            req.token_times.extend([self.clock.now] * len(out.new_token_ids))
            req.aborted = req.aborted or out.finish_reason == "abort"
        trace.end_s = self.clock.now
        if self.hook is not None:
            for arrival in self.hook(trace, self.clock.now):
                _add(engine, trace, arrival)


def drive_together(drivers: list[Driver]) -> None:
    """Advance every driver one step in turn until all are done. Engines compared this way
    see the same background load, step by step: a burst on the shared machine stretches
    each policy's steps alike instead of whichever policy happened to run then."""
    while not all(d.done for d in drivers):
        for driver in drivers:
            if not driver.done:
                driver.step()


def drive(engine: LocalEngine, clock: VirtualClock, arrivals: list[Arrival],
          hook: Hook | None = None) -> Trace:
    """Run until every arrival (and every hook arrival) has finished."""
    driver = Driver(engine, clock, arrivals, hook)
    drive_together([driver])
    return driver.trace


def warm_up(engine: LocalEngine, clock: VirtualClock, prompts: list[list[int]],
            max_tokens: int, tag: str) -> Trace:
    """Run a few requests to completion so one-time costs (allocator growth, first kernel
    launches) land here, not in the measurement."""
    arrivals = [Arrival(clock.now, f"{tag}-{i}", p, max_tokens) for i, p in enumerate(prompts)]
    return drive(engine, clock, arrivals)
