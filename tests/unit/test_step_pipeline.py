"""`StepLoop` (controller/step_loop.py), serial and planned ahead, against a fake worker
that keeps its own state.

`LaunchWaitWorker` splits a `FakeRunner` (which checks every plan diff against the state
its own diffs built) into `launch` and `wait` as the real worker does, and records the
order of the calls: at most one step launched and not waited for, step n+1 planned before
step n is waited for and launched before step n is applied. Tokens are a function of the
tokens so far (as greedy and seeded sampling are), so pipelined and serial stepping must
give every request the same tokens, including requests that stop early on a stop token
(planned one step too far) and under KV pressure (nobody preempted in a plan made ahead).
"""

from __future__ import annotations

from controller.core import ControllerCore, ModelFacts, PoolSpec
from controller.messages import FinishReason, SamplingParams, StepPlan, StepResult
from controller.options import ControllerOptions
from controller.scheduler import SchedulerConfig
from controller.step_loop import StepLoop
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_async_scheduling import VOCAB, next_token, workload


class LaunchWaitWorker:
    def __init__(self, core: ControllerCore) -> None:
        self.runner = FakeRunner(vocab_size=VOCAB, block_size=4, sample=next_token)
        self.core = core
        self.launched: list[int] = []  # step ids launched and not waited for
        self.events: list[tuple[str, int]] = []
        self.max_planned_ahead = 0

    def launch(self, plan: StepPlan) -> StepPlan:
        assert not self.launched, "a step launched before the last one was waited for"
        self.launched.append(plan.step_id)
        self.events.append(("launch", plan.step_id))
        return plan

    def wait(self, plan: StepPlan) -> StepResult:
        assert self.launched == [plan.step_id]
        self.launched.clear()
        # Steps planned but not applied yet: this one and, pipelined, the next.
        planned = self.core.workers[0].step_started
        self.max_planned_ahead = max(self.max_planned_ahead, len(planned))
        self.events.append(("wait", plan.step_id))
        return self.runner.execute(plan)


def run(is_pipelined: bool, num_blocks: int = 24
        ) -> tuple[dict[str, tuple[list[int], FinishReason | None]], LaunchWaitWorker,
                   ControllerCore]:
    core = ControllerCore([PoolSpec(num_blocks, 4, True)], ControllerOptions(
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                  max_chunk_tokens=8)), ModelFacts((0,), vocab_size=VOCAB))
    worker = LaunchWaitWorker(core)
    ids = [core.add_request(prompt, params).request_id for _, prompt, params in workload()]
    got: dict[str, tuple[list[int], FinishReason | None]] = {rid: ([], None) for rid in ids}
    loop = StepLoop(core, 0, worker.launch, worker.wait, is_ahead=is_pipelined)
    while loop.has_work():
        outputs = loop.step().outputs
        for out in outputs:
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return got, worker, core


def test_pipelined_steps_overlap_and_change_no_token() -> None:
    serial, serial_worker, _ = run(False)
    assert serial_worker.max_planned_ahead == 1
    assert any(reason == FinishReason.STOP for _, reason in serial.values())
    pipelined, worker, core = run(True)
    assert worker.max_planned_ahead == 2  # the next step was planned while one ran
    assert pipelined == serial
    for (_, prompt, params), (tokens, _) in zip(workload(), pipelined.values(), strict=True):
        expected = list(prompt)
        for _ in range(params.max_tokens):
            expected.append(next_token(expected))
            if expected[-1] in params.stop_token_ids:
                break
        assert tokens == expected[len(prompt):]
    # Launch n+1 comes right after wait n: the device idles only for the launch.
    events = worker.events
    for i, (kind, step_id) in enumerate(events[:-1]):
        if kind == "wait" and events[i + 1][0] == "launch":
            assert events[i + 1][1] > step_id
    assert not core.has_unfinished()
    core.check_integrity()
    assert core.scheduler(0).kv.pool.stats().num_used == 0


def test_pipelined_under_kv_pressure_preempts_nobody_ahead_and_matches() -> None:
    """12 blocks of 4 tokens for 8 running requests: blocks run out."""
    serial, _, serial_core = run(False, num_blocks=12)
    pipelined, _, core = run(True, num_blocks=12)
    assert serial_core.scheduler(0).stats.num_preemptions > 0
    assert pipelined == serial
    core.check_integrity()


def test_an_abort_while_a_step_runs_releases_its_blocks() -> None:
    core = ControllerCore([PoolSpec(24, 4, False)], ControllerOptions(
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)),
        ModelFacts((0,), vocab_size=VOCAB))
    worker = LaunchWaitWorker(core)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = [core.add_request([i + 1] * 6, params).request_id for i in range(3)]
    pipeline = StepLoop(core, 0, worker.launch, worker.wait, is_ahead=True)
    for _ in range(3):
        pipeline.step()
    assert pipeline.is_in_flight
    out = core.abort(ids[0])  # between steps, with the next one on the device
    assert out is not None and out.finish_reason == FinishReason.ABORT
    got: dict[str, int] = {}
    while pipeline.has_work():
        for o in pipeline.step().outputs:
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    assert ids[0] not in got or got[ids[0]] == 0
    assert all(rid in got for rid in ids[1:])
    pipeline.step()  # tells the worker the finished ids: it drops their tables
    assert worker.runner.requests == {}
    assert core.scheduler(0).kv.pool.stats().num_used == 0
