"""Tenant isolation, simulated with the real scheduler: time is counted in steps."""

from controller.messages import SamplingParams
from controller.request import Request
from controller.scheduler import Scheduler, SchedulerConfig
from controller.tenants import split_budget
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager
from tests.unit.fake_runner import FakeRunner

SHORT_EVERY = 5


# Admission fairness off: every prompt counts as long and any number is chunked at once.
UNFAIR = {"long_prefill_token_threshold": 1, "max_long_partial_prefills": 64}


def run(flood: bool, isolate: bool, num_steps: int = 150, fair: bool = True) -> list[int]:
    """TTFT in steps of tenant B's short requests, while tenant A floods 8k prompts."""
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                             max_concurrent_chunks=4, **({} if fair else UNFAIR))
    sched = Scheduler(config, KVCacheManager(BlockPool(8192, 16)))
    runner = FakeRunner(sched)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    if flood:
        for i in range(30):
            sched.add_request(Request(f"a{i}", [i % 50 + 1] * 8192, params,
                                      tenant="a" if isolate else "b"))
    arrival: dict[str, int] = {}
    first_token: dict[str, int] = {}
    for step in range(num_steps):
        if step % SHORT_EVERY == 0 and step < num_steps - 20:
            rid = f"b{step}"
            sched.add_request(Request(rid, list(range(1, 65)), params, tenant="b"))
            arrival[rid] = step
        for out in runner.step():
            if out.request_id in arrival and out.num_output_tokens == 1:
                first_token[out.request_id] = step + 1
        sched.kv.pool.check_integrity()
    # A request still waiting at the end counts with the steps it has waited so far.
    return [first_token.get(rid, num_steps) - t for rid, t in arrival.items()]


def test_flooding_tenant_at_most_doubles_other_tenants_ttft():
    alone = run(flood=False, isolate=True)
    flooded = run(flood=True, isolate=True)
    assert max(flooded) <= 2 * max(alone)
    assert sum(flooded) / len(flooded) <= 2 * sum(alone) / len(alone)


def test_without_tenants_or_admission_fairness_the_flood_delays_short_requests():
    """The same flood from the same tenant, admission fairness off: FCFS puts the short
    prompts behind it. This is what isolation and the short-prompt reserve prevent (and
    shows the measurement can fail)."""
    alone = run(flood=False, isolate=True, fair=False)
    shared = run(flood=True, isolate=False, fair=False)
    assert max(shared) > 2 * max(alone)


def test_short_prompt_reserve_protects_short_requests_within_one_tenant():
    """Same tenant, fairness on: long prompts leave the short ones their reserve, so a
    short prompt is admitted in the step after it arrives and the flood still moves."""
    alone = run(flood=False, isolate=False)
    shared = run(flood=True, isolate=False)
    assert max(shared) <= 2 * max(alone)


def test_unused_share_is_lent():
    shares = split_budget(100, ["a", "b", "a"], {"a": 3.0})
    assert shares is not None and shares["a"].max == 75 and shares["b"].max == 25
    assert split_budget(100, ["a", "a"], {}) is None  # one tenant: nothing to split
