"""Scheduler unit and property tests: no torch, a fake runner output."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.messages import SamplingParams
from controller.request import Request
from controller.scheduler import Scheduler, SchedulerConfig
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager
from tests.unit.fake_runner import FakeRunner


def make_scheduler(budget=64, num_blocks=64, block_size=4, max_num_seqs=8, prefix=False,
                   chunks=4):
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=prefix)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_concurrent_chunks=chunks)
    return Scheduler(config, KVCacheManager(pool))


def make_request(rid, prompt_len, max_tokens, priority=0, base=0):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, [(base + i) % 97 for i in range(prompt_len)], params, priority=priority)


def test_long_prompt_is_chunked_while_decodes_continue():
    sched = make_scheduler(budget=16, num_blocks=128)
    runner = FakeRunner(sched)
    sched.add_request(make_request("short", 3, 20))
    runner.step()  # short prefilled, samples its first token
    sched.add_request(make_request("long", 100, 1))
    plan = sched.schedule()
    assert plan.num_scheduled_tokens["short"] == 1  # decode first
    # the long prompt gets the rest of the budget, its end on the block grid
    assert plan.num_scheduled_tokens["long"] == 12
    runner.scheduler.update_from_output(plan, runner.execute(plan))
    for _ in range(10):
        plan = sched.schedule()
        assert plan.total_num_scheduled_tokens <= 16
        if "short" in sched.requests:
            assert plan.num_scheduled_tokens.get("short") == 1
        sched.update_from_output(plan, runner.execute(plan))


def test_preemption_by_recompute_frees_latest_lowest_priority():
    sched = make_scheduler(budget=64, num_blocks=6, block_size=4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, 12))
    sched.add_request(make_request("b", 8, 12))
    finished = set()
    for _ in range(200):
        for out in runner.step():
            if out.finished:
                finished.add(out.request_id)
        sched.kv.pool.check_integrity()
        if not sched.has_unfinished():
            break
    assert finished == {"a", "b"}
    assert sched.stats.num_preemptions > 0
    assert sched.kv.pool.num_used == 0


def test_abort_frees_blocks_and_tells_worker():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 10, 5))
    runner.step()
    out = sched.abort_request("a")
    assert out is not None and out.finish_reason == "abort"
    assert sched.kv.pool.num_used == 0
    assert "a" in sched.schedule().finished_request_ids


def test_request_larger_than_pool_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    try:
        sched.add_request(make_request("big", 8, 4))
    except ValueError as err:
        assert "KV capacity" in str(err)
    else:
        raise AssertionError("expected ValueError")


requests_strategy = st.lists(
    st.tuples(st.integers(0, 40),  # arrival step
              st.integers(1, 60),  # prompt len
              st.integers(1, 12),  # max tokens
              st.integers(0, 2)),  # priority
    min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=requests_strategy, budget=st.integers(1, 96), num_blocks=st.integers(20, 80),
       block_size=st.sampled_from([1, 2, 4, 8]), max_num_seqs=st.integers(1, 8),
       prefix=st.booleans(), chunks=st.integers(1, 4))
def test_property_budget_order_completion_integrity(specs, budget, num_blocks, block_size,
                                                    max_num_seqs, prefix, chunks):
    sched = make_scheduler(budget, num_blocks, block_size, max_num_seqs, prefix, chunks)
    runner = FakeRunner(sched)
    pending = sorted(enumerate(specs), key=lambda x: x[1][0])
    expected, finished = set(), set()
    for step in range(1000):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, priority) = pending.pop(0)
            request = make_request(f"r{i}", prompt_len, max_tokens, priority, base=i % 3)
            try:
                sched.add_request(request)
                expected.add(request.request_id)
            except ValueError:
                assert prompt_len + max_tokens > num_blocks * block_size
        decoding_before = {r.request_id for r in sched.running if r.is_decoding}
        plan = sched.schedule()
        assert plan.total_num_scheduled_tokens <= budget
        assert len(plan.num_scheduled_tokens) <= max_num_seqs
        # Decode first: a decode may only be left out when the budget was spent on
        # other decodes (or it was preempted); never in favour of any prefill, a new
        # request's or a running request's next chunk.
        prefill_ids = set(plan.num_scheduled_tokens) - decoding_before
        skipped = {rid for rid in decoding_before if rid not in plan.num_scheduled_tokens
                   and rid in sched.requests and sched.requests[rid] in sched.running}
        if skipped:
            assert not prefill_ids, (skipped, prefill_ids)
        for out in sched.update_from_output(plan, runner.execute(plan)):
            if out.finished:
                finished.add(out.request_id)
        sched.kv.pool.check_integrity()
        if not pending and not sched.has_unfinished():
            break
    assert finished == expected, f"unfinished: {expected - finished}"
    assert sched.kv.pool.num_used == 0


def test_fake_runner_rejects_a_diff_that_disagrees_with_what_it_computed():
    """The fake worker builds its state from the diffs alone, so a wrong diff fails."""
    import dataclasses

    sched = make_scheduler(64, 32, 4, 8, False, 4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 12, 4))
    runner.step()  # the whole prompt, 3 full blocks: "a" now decodes into a 4th block
    plan = sched.schedule()
    (cached,) = plan.cached_requests  # a diff: the new block
    plan.cached_requests = [dataclasses.replace(
        cached, num_computed_tokens=cached.num_computed_tokens - 1)]
    with pytest.raises(AssertionError):
        runner.execute(plan)
    unknown = sched.schedule()
    unknown.cached_requests = [dataclasses.replace(cached, request_id="ghost")]
    unknown.num_scheduled_tokens = {"ghost": 1}
    with pytest.raises(AssertionError, match="never got"):
        runner.execute(unknown)


def test_a_decode_inside_its_last_block_sends_no_diff():
    """The plan carries what the worker cannot know: a decode that stays inside its last
    block is its span alone; one that opens a block sends that block only."""
    sched = make_scheduler(64, 32, 4, 8, False, 4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 9, 8))
    runner.step()  # 9 prompt tokens in 3 blocks (12 slots), the first token sampled
    diffs = []
    for _ in range(6):  # positions 9..14: blocks 3 and 4 fill, block 4 opens at 12
        plan = sched.schedule()
        assert plan.num_scheduled_tokens == {"a": 1} and not plan.new_requests
        diffs.append([(c.new_block_ids, c.num_computed_tokens) for c in plan.cached_requests])
        sched.update_from_output(plan, runner.execute(plan))
    blocks = sched.kv.block_ids("a")
    assert diffs == [[], [], [], [([blocks[3]], 12)], [], []]
    fake = runner.requests["a"]
    assert fake.num_computed_tokens == 15 == len(fake.token_ids) - 1


def test_step_context_len_is_the_longest_context_the_plan_reads():
    sched = make_scheduler(budget=16, num_blocks=128)
    runner = FakeRunner(sched)
    sched.add_request(make_request("short", 3, 20))
    runner.step()  # prefilled: decodes from now on, its context 4 in the next step
    sched.add_request(make_request("long", 100, 1))
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"short": 1, "long": 12}
    assert sched.step_context_len(plan.step_id) == 12  # the chunk reads keys 0..11
    sched.update_from_output(plan, runner.execute(plan))
    plan = sched.schedule()
    assert sched.step_context_len(plan.step_id) == 12 + plan.num_scheduled_tokens["long"]
    running = max(r.num_tokens for r in sched.running)
    assert sched.step_context_len(-1) == running  # no shape: every running request
