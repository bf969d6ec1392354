"""Flow control and protections through `ControllerCore` with the real scheduler, a
scripted worker, injected time (deterministic)."""

from __future__ import annotations

from controller.core import ControllerCore, PoolSpec
from controller.flow import FlowConfig, Mode
from controller.messages import SamplingParams, StepPlan
from controller.options import ControllerOptions
from controller.protections import ProtectionConfig
from controller.scheduler import SchedulerConfig
from tests.unit.fake_runner import FakeRunner

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class Harness:
    """The core's step verb, as LocalEngine and the Ray step loop call it, in virtual time."""

    def __init__(self, num_blocks=100, budget=64, chunk_cost=None, bandwidth=None,
                 protections=None, dt=0.5, max_chunk_tokens=None, **scheduler):
        self.now = 0.0
        self.dt = dt
        self.core = ControllerCore(
            [PoolSpec(num_blocks, 4, False)], ControllerOptions(
                scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                          max_chunk_tokens=max_chunk_tokens, **scheduler),
                flow=FlowConfig(), protections=protections or ProtectionConfig()),
            clock=lambda: self.now)
        self.sched = self.core.scheduler(0)
        self.runner = FakeRunner(self.sched, chunk_cost=chunk_cost, bandwidth=bandwidth)
        self.plans: list[StepPlan] = []
        self.outputs: list = []

    @property
    def flow(self):
        return self.core.workers[0].flow

    def add(self, rid: str, prompt_len: int, max_tokens: int = 40):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.core.add_request(list(range(1, prompt_len + 1)), params, request_id=rid)

    def step(self) -> StepPlan:
        plan = self.core.begin_step(0)
        outputs = self.core.finish_step(0, plan, self.runner.execute(plan))
        self.plans.append(plan)
        self.outputs.extend(outputs)
        self.now += self.dt
        return plan


def test_cache_pressure_stops_prefill_keeps_decodes_and_wakes_on_evict():
    h = Harness(num_blocks=100, budget=64)
    # 4 requests of 84 tokens (21 blocks each): 84 % of the pool once decoding starts.
    for i in range(4):
        h.add(f"d{i}", 84, max_tokens=12 + 8 * i)
    while h.flow.mode != Mode.CACHE_PRESSURE_WAIT:
        h.step()
        assert h.now < 100
    h.add("late", 40)  # arrives while the cache is under pressure
    steps_in_pressure = 0
    while h.flow.mode == Mode.CACHE_PRESSURE_WAIT:
        plan = h.step()
        steps_in_pressure += 1
        assert "late" not in plan.num_scheduled_tokens  # no new prefill chunk ...
        assert all(n == 1 for n in plan.num_scheduled_tokens.values())  # ... decodes only
        assert plan.num_scheduled_tokens  # decodes go on
    assert steps_in_pressure > 1
    # the evict that lowered usage below 79 % was handled before the next plan:
    # the waiting request is admitted in the very next step (no lost wake-up)
    assert h.flow.kv_usage < 0.79
    plan = h.step()
    assert "late" in plan.num_scheduled_tokens
    while h.core.has_unfinished():
        h.step()
    h.core.check_integrity()
    assert h.sched.kv.pool.num_used == 0


def test_throttle_levels_set_chunk_concurrency_and_pause_recovers():
    level = {"value": 0.5}
    h = Harness(num_blocks=5000, budget=4096, bandwidth=lambda: level["value"],
                max_chunk_tokens=128, max_long_partial_prefills=8)
    for i in range(8):
        h.add(f"p{i}", 2000, max_tokens=2)

    def chunks(plan: StepPlan) -> int:
        return sum(1 for n in plan.num_scheduled_tokens.values() if n > 1)

    assert chunks(h.step()) == 4  # NORMAL: 4 concurrent chunks
    level["value"] = 0.93
    while h.flow.mode != Mode.BANDWIDTH_THROTTLE:
        h.step()
    assert chunks(h.step()) == 2
    level["value"] = 0.97
    while h.flow.throttle_level != 1:
        h.step()
    assert chunks(h.step()) == 1
    level["value"] = 0.99
    while h.flow.mode != Mode.PREFILL_PAUSED:
        h.step()
    plan = h.step()
    assert chunks(plan) == 0  # emergency: no prefill at all
    level["value"] = 0.3
    while h.flow.mode != Mode.NORMAL:
        h.step()
        assert h.now < 200
    for i in range(4):
        h.add(f"q{i}", 1000, max_tokens=2)
    assert chunks(h.step()) == 4
    assert h.flow.stats.transitions >= 4


def test_chunk_timeout_aborts_with_error_and_frees_blocks():
    slow = {"s1"}

    def cost(rid: str, start: int, n: int) -> float:
        return 50.0 if rid in slow and start > 0 else 1e-3

    h = Harness(num_blocks=200, budget=32, chunk_cost=cost,
                protections=ProtectionConfig(chunk_timeout_base_s=10.0))
    h.add("s1", 200)
    h.add("ok", 20, max_tokens=5)
    while h.core.has_unfinished():
        h.step()
    aborted = [o for o in h.outputs if o.request_id == "s1" and o.finished]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert "timeout" in aborted[0].error
    ok = [o for o in h.outputs if o.request_id == "ok" and o.finished]
    assert ok and ok[0].finish_reason == "length"
    h.step()  # tells the worker to drop the aborted request
    assert not h.runner.held or all(not v for v in h.runner.held.values())
    assert h.sched.kv.pool.num_used == 0
    h.core.check_integrity()
    assert h.core.workers[0].protections.stats.num_timeouts == 1


def test_repeated_timeouts_switch_to_degraded_path_that_keeps_serving():
    h = Harness(num_blocks=400, budget=64, chunk_cost=lambda rid, s, n: 50.0 if
                rid.startswith("slow") else 1e-3,
                protections=ProtectionConfig(chunk_timeout_base_s=10.0,
                                             degrade_after_timeouts=2))
    for i in range(2):
        h.add(f"slow{i}", 30)
    while h.core.has_unfinished():
        h.step()
    assert h.core.workers[0].protections.is_degraded(h.now)
    h.add("after", 100, max_tokens=3)
    plan = h.step()
    assert h.core.workers[0].degraded
    assert plan.num_scheduled_tokens["after"] == 4  # smallest chunk: one block
    while h.core.has_unfinished():
        h.step()
    assert [o.finish_reason for o in h.outputs if o.request_id == "after" and o.finished] \
        == ["length"]


def test_worker_stats_is_one_snapshot_of_every_counter():
    h = Harness(num_blocks=100, budget=64)
    h.core.add_request(list(range(1, 30)), PARAMS, request_id="a", tenant="t1")
    h.core.add_request(list(range(1, 90)), PARAMS, request_id="b", tenant="t2")
    for _ in range(3):
        h.step()
    stats = h.core.worker_stats(0)
    assert stats.num_steps == 3 and stats.flow_mode == h.flow.mode.name
    assert stats.num_prefill_tokens == 29 + 89
    assert stats.tenant_to_prefill_tokens == {"t1": 29, "t2": 89}
    assert stats.num_decode_tokens == h.core.scheduler(0).stats.num_decode_tokens > 0
    assert stats.num_chunk_complete >= 3  # a: 1 chunk, b: 2 chunks at least
    assert stats.num_used_blocks + stats.num_free_blocks + stats.num_cached_blocks == 100
