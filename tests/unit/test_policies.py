"""Baseline policies: they finish every request and keep their defining rule."""

import random

import pytest

from controller.messages import SamplingParams
from controller.policies import POLICIES, make_scheduler_class
from controller.request import Request
from controller.scheduler import SchedulerConfig
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager
from tests.unit.fake_runner import FakeRunner


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_finishes_everything_and_keeps_its_rule(policy):
    cls = make_scheduler_class(policy)
    sched = cls(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                KVCacheManager(BlockPool(200, 4)))
    runner = FakeRunner(sched)
    rng = random.Random(0)
    ids = set()
    for i in range(12):
        params = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)
        sched.add_request(Request(f"r{i}", [1] * rng.randint(1, 150), params))
        ids.add(f"r{i}")
    finished = set()
    for _ in range(2000):
        decoding = {r.request_id for r in sched.running if r.is_decoding}
        plan = sched.schedule()
        kinds = {("decode" if rid in decoding else "prefill")
                 for rid in plan.num_scheduled_tokens}
        if policy != "tokenflow":
            assert len(kinds) <= 1, "prefill and decode share a step"
        if policy == "prefill-priority-chunked":
            assert plan.total_num_scheduled_tokens <= 64
        for out in sched.update_from_output(plan, runner.execute(plan)):
            if out.finished:
                finished.add(out.request_id)
        sched.kv.pool.check_integrity()
        if not sched.has_unfinished():
            break
    assert finished == ids
    assert sched.kv.pool.num_used == 0


def test_prefill_first_runs_whole_prompts_past_the_budget():
    cls = make_scheduler_class("prefill-first")
    sched = cls(SchedulerConfig(max_num_batched_tokens=16), KVCacheManager(BlockPool(100, 4)))
    sched.add_request(Request("long", [1] * 100, SamplingParams(max_tokens=2)))
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"long": 100}


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_scheduler_class("fastest")
