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
        self.plans: list[StepPlan] = []  # launched, in order
        self.max_planned_ahead = 0

    def launch(self, plan: StepPlan) -> StepPlan:
        assert not self.launched, "a step launched before the last one was waited for"
        self.launched.append(plan.step_id)
        self.events.append(("launch", plan.step_id))
        self.plans.append(plan)
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


def test_a_step_that_only_moves_blocks_is_sent_not_dropped() -> None:
    """A step planned ahead may schedule no token (the last running request's final token
    is pending) and still carry defragmentation moves, which the controller has already
    applied to its block tables and prefix hashes. Dropped, the worker never copied the
    blocks: a later prefix hit read another request's KV (found on the shared cluster as a
    changed greedy answer). B frees the low blocks, A's are moved down by every step's
    compaction, then C, with A's prompt, hits A's moved blocks; the worker checks every KV
    slot it reads. Over a range of A's lengths and defragmentation periods so that the
    compaction lands on such a step."""
    num_move_only = 0
    for every in range(1, 7):
        for max_tokens in range(1, 6):
            core = ControllerCore([PoolSpec(16, 4, True)], ControllerOptions(
                scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8,
                                          defrag_threshold=0.1, defrag_every_steps=every)),
                ModelFacts((0,), vocab_size=VOCAB))
            worker = LaunchWaitWorker(core)
            worker.runner.kv = {}  # FakeRunner(check_kv=True)'s slots
            loop = StepLoop(core, 0, worker.launch, worker.wait, is_ahead=True)
            a_prompt = [(5 * j + 3) % 90 + 1 for j in range(9)]
            core.add_request([7] * 9, SamplingParams(max_tokens=1, temperature=0.0,
                                                     ignore_eos=True))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            a = core.add_request(a_prompt, params).request_id
            c = None
            got: list[int] = []
            while loop.has_work():
                for out in loop.step().outputs:
                    if out.request_id == c:
                        got += out.new_token_ids
                    elif out.request_id == a and out.finished:
                        c = core.add_request(a_prompt, params).request_id
            launched = [p for kind, p in worker.events if kind == "launch"]
            assert launched == sorted(set(launched)), "every step planned is sent, in order"
            num_move_only += sum(1 for plan in worker.plans if plan.block_moves
                                 and plan.is_empty)
            expected = list(a_prompt)
            for _ in range(max_tokens):
                expected.append(next_token(expected))
            assert got == expected[len(a_prompt):], (every, max_tokens)
            assert worker.runner.num_kv_checked > 0
    assert num_move_only > 0  # the case under test happened
