"""When the scheduler plans a decode burst (controller/decode_burst.py) and what it counts,
on `FakeRunner` (which runs a burst's spans `num_steps` times and checks every diff and KV
slot), and through the controller actor planning ahead: the tokens of single steps."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from controller.budget import LinearFit, StepCost
from controller.core import ControllerCore
from controller.messages import SamplingParams, TokenLogprob
from controller.options import ControllerOptions
from controller.request import Request
from controller.scheduler import Scheduler, SchedulerConfig
from controller.scheduler_config import DEFAULT_CPU_DECODE_STEPS, StepLimits
from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_async_scheduling import next_token, run_all, workload

PLAIN = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def bursting(num_blocks: int = 64, steps: int = 4) -> tuple[Scheduler, FakeRunner]:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    sched = Scheduler(config, KVCacheManager(BlockPool(num_blocks, 4)))
    sched.max_decode_steps = steps
    return sched, FakeRunner(sched, sample=next_token, check_kv=True)


def add(sched: Scheduler, rid: str, params: SamplingParams = PLAIN, prompt_len: int = 6
        ) -> Request:
    request = Request(rid, [(7 * len(rid) + i) % 90 + 1 for i in range(prompt_len)], params)
    sched.add_request(request)
    return request


def test_decoding_alone_runs_in_bursts_and_gives_single_step_tokens() -> None:
    outputs = {}
    for steps in (1, 4):
        sched, runner = bursting(steps=steps)
        requests = [add(sched, f"r{i}") for i in range(3)]
        num_steps = 0
        while sched.has_unfinished():
            runner.step()
            num_steps += 1
        outputs[steps] = [r.output_token_ids for r in requests]
        assert sched.kv.pool.stats().num_used == 0
        # Each request's 19 fed-back tokens counted, whichever way they were planned.
        assert sched.tenant_stats.tenant_to_decode_tokens["default"] == 3 * 19
        assert sched.stats.num_decode_tokens == 3 * 19
    # The prefill samples 1 of the 20 tokens; bursts of 4, 4, 4, 4 and the last 3.
    assert runner.num_bursts == 5 and num_steps == 1 + 5
    assert outputs[4] == outputs[1]
    assert all(len(ids) == 20 for ids in outputs[4])


def test_a_request_waiting_for_a_free_seat_does_not_stop_bursts() -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2)
    sched = Scheduler(config, KVCacheManager(BlockPool(64, 4)))
    sched.max_decode_steps = 4
    runner = FakeRunner(sched, sample=next_token, check_kv=True)
    for rid in ("a", "b", "c"):
        add(sched, rid)
    runner.step()  # a and b admitted; c waits for one of them to finish
    assert sched.num_waiting == 1
    assert sched.schedule().num_steps == 4


def test_no_burst_while_a_request_waits_or_a_prompt_is_chunked() -> None:
    sched, runner = bursting()
    add(sched, "a")
    runner.step()
    assert sched.schedule().num_steps == 4  # decoding alone: a burst (not run)
    sched2, runner2 = bursting()
    add(sched2, "a")
    runner2.step()
    add(sched2, "late")  # arrives: the next step admits it, one step
    plan = sched2.schedule()
    assert plan.num_steps == 1 and plan.num_scheduled_tokens == {"a": 1, "late": 6}


@pytest.mark.parametrize("params", [
    replace(PLAIN, logprobs=2), replace(PLAIN, stop=("x",)),
    replace(PLAIN, grammar_kind="regex", grammar_spec="a+")],
    ids=["logprobs", "stop-strings", "grammar"])
def test_no_burst_for_what_is_checked_token_by_token(params: SamplingParams) -> None:
    sched, runner = bursting()
    add(sched, "plain")
    add(sched, "special", params)
    plan = sched.schedule()
    result = runner.execute(plan)  # the fake scores nothing: the score a worker sends
    result.sampled_logprobs["special"] = TokenLogprob(result.sampled_token_ids["special"][0],
                                                      -1.0)
    sched.update_from_output(plan, result)
    assert sched.schedule().num_steps == 1


def test_a_burst_is_cut_to_the_fewest_tokens_left_and_to_the_free_blocks() -> None:
    sched, runner = bursting()
    add(sched, "long")
    add(sched, "short", replace(PLAIN, max_tokens=3))  # 1 from the prefill, 2 left
    runner.step()
    plan = sched.schedule()
    assert plan.num_steps == 2
    runner.execute(plan)
    # 4-token blocks: after their prompts (6 and 2 tokens) a and b hold 2 + 1 of a pool of
    # 4; a burst of 4 needs one more each (10 and 6 tokens), a single step none.
    sched, runner = bursting(num_blocks=4)
    add(sched, "a", replace(PLAIN, max_tokens=8))
    add(sched, "b", replace(PLAIN, max_tokens=8), prompt_len=2)
    runner.step()
    assert sched.schedule().num_steps == 1


def test_throttled_flow_control_gets_single_steps() -> None:
    sched, runner = bursting()
    add(sched, "a")
    runner.step()
    assert sched.schedule(StepLimits(max_chunks=1)).num_steps == 1


def test_cpu_workers_burst_by_default_accelerators_do_not() -> None:
    config = SchedulerConfig()
    assert config.max_decode_steps("cpu") == DEFAULT_CPU_DECODE_STEPS > 1
    assert config.max_decode_steps("cuda:0") == 1
    assert SchedulerConfig(decode_steps=2).max_decode_steps("cuda:0") == 2


def test_bursts_planned_ahead_through_the_actor_give_the_serial_tokens() -> None:
    sync, _, _ = run_all(False)
    got, handle, stats = run_all(True, decode_steps=4)
    assert handle.runner.num_bursts > 0 and handle.max_outstanding == 2
    assert got == sync
    for rid, _, params in workload():
        assert len(got[rid][0]) <= params.max_tokens, rid
    assert stats["num_unfinished"] == 0


# -- chunk bursts: a prompt chunked beside decoding requests -----------------------------
def chunking(chunk_steps: int, num_blocks: int = 64) -> tuple[Scheduler, FakeRunner]:
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_chunk_tokens=4)
    sched = Scheduler(config, KVCacheManager(BlockPool(num_blocks, 4)))
    sched.max_decode_steps, sched.max_chunk_steps = 4, chunk_steps
    return sched, FakeRunner(sched, sample=next_token, check_kv=True)


def run_chunked(chunk_steps: int) -> tuple[Scheduler, FakeRunner, list[Request], list[int]]:
    """Two users decode; then a 48-token prompt arrives, cut into 4-token chunks."""
    sched, runner = chunking(chunk_steps)
    users = [add(sched, f"u{i}", replace(PLAIN, max_tokens=30)) for i in range(2)]
    runner.step()
    long = add(sched, "long", replace(PLAIN, max_tokens=4), prompt_len=48)
    plans = []
    while sched.has_unfinished():
        plan = sched.schedule()
        plans.append(plan.num_steps if "long" in plan.num_scheduled_tokens
                     and plan.num_scheduled_tokens["long"] > 1 else 0)
        sched.update_from_output(plan, runner.execute(plan))
    assert sched.kv.pool.stats().num_used == 0
    return sched, runner, [*users, long], plans


def test_a_chunked_prompt_runs_in_chunk_bursts_with_single_step_tokens() -> None:
    single, _, single_requests, single_plans = run_chunked(1)
    sched, runner, requests, plans = run_chunked(2)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids
                                                      for r in single_requests]
    # 48 tokens, 4 a chunk: bursts of 2 while more than 8 are left, then the prompt's last
    # 2 chunks one by one (the one that samples is never in a burst).
    assert single_plans.count(1) == 12 and all(n in (0, 1) for n in single_plans)
    assert plans.count(2) == 5 and plans.count(1) == 2, plans
    assert runner.num_chunk_bursts == 5
    # Every chunk reported (one event a step) and every token counted once.
    assert runner.request_to_num_chunks["long"] == 12
    for got in (single, sched):
        assert got.stats.num_prefill_tokens == 2 * 6 + 48
        assert got.tenant_stats.tenant_to_prefill_tokens["default"] == 2 * 6 + 48
        assert got.stats.num_decode_tokens == 2 * 29 + 3


def test_no_chunk_burst_while_a_request_waits_or_flow_control_throttles() -> None:
    sched, runner = chunking(2)
    add(sched, "u", replace(PLAIN, max_tokens=30))
    runner.step()
    add(sched, "long", prompt_len=48)
    assert sched.schedule(StepLimits(max_chunks=1)).num_steps == 1
    add(sched, "late")  # arrives while the long prompt is chunked: it is admitted next
    plan = sched.schedule()
    assert plan.num_steps == 1 and plan.num_scheduled_tokens["late"] == 4


@pytest.mark.parametrize("params", [
    replace(PLAIN, prompt_logprobs=1), replace(PLAIN, logprobs=1)],
    ids=["chunk-scores-its-prompt", "a-decode-asks-logprobs"])
def test_no_chunk_burst_for_what_is_checked_token_by_token(params: SamplingParams) -> None:
    sched, runner = chunking(2)
    is_prompt = params.prompt_logprobs is not None
    add(sched, "u", PLAIN if is_prompt else params)
    runner.step()
    add(sched, "long", params if is_prompt else PLAIN, prompt_len=48)
    assert sched.schedule().num_steps == 1


def test_a_chunk_burst_needs_the_blocks_of_all_its_steps() -> None:
    # 4-token blocks: the user's 4-token prompt and its next 2 tokens take 2; the long
    # prompt's first chunk (4 tokens) 1 more, a burst of 2 chunks 2: 3 blocks hold the
    # single step, not the burst.
    sched, runner = chunking(2, num_blocks=3)
    add(sched, "u", replace(PLAIN, max_tokens=4), prompt_len=4)
    runner.step()
    add(sched, "long", replace(PLAIN, max_tokens=1), prompt_len=11)
    plan = sched.schedule()
    assert plan.num_steps == 1 and plan.num_scheduled_tokens == {"u": 1, "long": 4}


def test_chunk_bursts_are_off_unless_configured() -> None:
    worker = SimpleNamespace(num_kv_blocks=64, block_size=4, device="cpu")
    assert ControllerCore.pool_of(ControllerOptions(), worker).max_chunk_steps == 1
    options = ControllerOptions(scheduler=SchedulerConfig(chunk_steps=3))
    assert ControllerCore.pool_of(options, worker).max_chunk_steps == 3


def test_chunk_bursts_planned_ahead_through_the_actor_give_the_serial_tokens() -> None:
    # Two users and a 60-token prompt chunked 8 tokens a step beside them.
    requests = [(f"u{i}", [5 + i] * 8, replace(PLAIN, max_tokens=30)) for i in range(2)]
    requests.append(("long", [(3 * j) % 90 + 1 for j in range(60)], PLAIN))
    sync, _, _ = run_all(False, requests=requests)
    # With a cost model: each step of a burst is priced and refitted as its own step.
    fit = LinearFit(1e-4, 1e-6, 0.0)
    got, handle, stats = run_all(True, decode_steps=4, chunk_steps=2, requests=requests,
                                 step_cost=StepCost(fit, fit))
    assert handle.runner.num_chunk_bursts > 0
    assert got == sync
    assert stats["num_unfinished"] == 0
    # Every chunk the fake ran reached flow control and the protections, once.
    (worker,) = stats["workers"]
    assert worker["num_chunk_complete"] == sum(handle.runner.request_to_num_chunks.values())
