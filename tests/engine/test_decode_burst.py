"""Decode bursts on the real model (builtin:tiny, CPU): a plan the worker runs
`scheduler.decode_steps` decode steps in a row (controller/decode_burst.py). Every request
gets the tokens of one step a plan, token by token: greedy ones that stop on EOS or on a
stop token inside a burst, seeded random ones, long prompts in chunks beside them, over a
pool small enough to preempt, one step at a time and planned ahead."""

from __future__ import annotations

import pytest

from cluster.engine import LocalEngine
from controller.messages import SamplingParams
from tests.engine.test_step_pipeline import _generate


def _engine(decode_steps: int, is_async: bool, num_kv_blocks: int,
            chunk_steps: int = 1) -> LocalEngine:
    engine = LocalEngine(worker={"model": "builtin:tiny", "telemetry": False},
                         cache={"num_kv_blocks": num_kv_blocks, "block_size": 8},
                         scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 6,
                                    "max_chunk_tokens": 32, "async_scheduling": is_async,
                                    "decode_steps": decode_steps,
                                    "chunk_steps": chunk_steps})
    engine.keep_step_log = True
    return engine


@pytest.mark.parametrize("num_kv_blocks", [48, 20], ids=["roomy", "preempting"])
@pytest.mark.parametrize("is_async", [False, True], ids=["serial", "ahead"])
def test_bursts_give_the_tokens_of_single_steps(num_kv_blocks: int, is_async: bool) -> None:
    single = _engine(1, False, num_kv_blocks)
    expected = _generate(single)
    assert all(plan.num_steps == 1 for plan, _ in single.step_log)
    bursting = _engine(4, is_async, num_kv_blocks)
    got = _generate(bursting)
    bursts = [(plan, result) for plan, result in bursting.step_log if plan.num_steps > 1]
    assert bursts, "the workload's decode-only tail must run in bursts"
    for plan, result in bursts:  # decode-only, every request a token per step
        assert set(plan.num_scheduled_tokens.values()) == {1} and not result.chunk_events
        assert all(len(ids) == plan.num_steps for ids in result.sampled_token_ids.values())
    assert [reason for _, reason in expected].count("stop") >= 2
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"request {i}"
    assert bursting.scheduler.kv.pool.stats().num_used == 0


def test_a_burst_never_passes_max_tokens_and_a_stop_inside_it_ends_the_request() -> None:
    engine = _engine(4, False, 48)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    done = engine.generate([[5, 6, 7, 8]] * 3, plain)
    assert [len(c.output_token_ids) for c in done] == [10, 10, 10]
    assert max(p.num_steps for p, _ in engine.step_log) == 4
    # A stop token sampled inside a burst ends the request there: the tokens the burst
    # computed after it are dropped (the single-step engine never makes them).
    probe = engine.generate([[9, 10, 11]], plain)[0].output_token_ids
    stop_at = probe[5]
    engine.step_log.clear()
    stopping = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,))
    got = engine.generate([[9, 10, 11]], stopping)[0]
    assert got.output_token_ids == probe[: probe.index(stop_at) + 1]
    assert got.finish_reason == "stop"
    num_sampled = sum(len(ids) for _, r in engine.step_log for ids in r.sampled_token_ids.values())
    assert num_sampled > len(got.output_token_ids)  # some were computed, then dropped
    engine.check_integrity()
    assert engine.scheduler.kv.pool.stats().num_used == 0


def _users_then_a_long_prompt(engine: LocalEngine) -> list[list[int]]:
    """Two users decode; a 150-token prompt arrives and is chunked beside them."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([5 + i] * 12, params) for i in range(2)]
    tokens: dict[str, list[int]] = {}
    for step in range(1000):
        if step == 3:
            ids.append(engine.add_request([(7 * j) % 90 + 3 for j in range(150)],
                                          SamplingParams(max_tokens=5, temperature=0.0)))
        elif step > 3 and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.check_integrity()
    assert engine.scheduler.kv.pool.stats().num_used == 0
    return [tokens[rid] for rid in ids]


@pytest.mark.parametrize("is_async", [False, True], ids=["serial", "ahead"])
def test_chunk_bursts_give_the_tokens_of_single_steps(is_async: bool) -> None:
    expected = _users_then_a_long_prompt(_engine(1, False, 64))
    engine = _engine(4, is_async, 64, chunk_steps=2)
    got = _users_then_a_long_prompt(engine)
    assert got == expected  # greedy, token by token
    bursts = [(plan, result) for plan, result in engine.step_log
              if plan.num_steps > 1 and max(plan.num_scheduled_tokens.values()) > 1]
    assert bursts, "the long prompt's chunks beside the users must run in bursts"
    for plan, result in bursts:  # one chunk, its event each step; the users a token a step
        (chunk_id, num_chunk), = [(r, n) for r, n in plan.num_scheduled_tokens.items() if n > 1]
        assert [(e.request_id, e.num_tokens) for e in result.chunk_events] == \
            [(chunk_id, num_chunk)] * plan.num_steps
        starts = [e.start for e in result.chunk_events]
        assert starts == list(range(starts[0], starts[0] + plan.num_steps * num_chunk,
                                    num_chunk))
        assert chunk_id not in result.sampled_token_ids or not result.sampled_token_ids[
            chunk_id]
        assert all(len(ids) == plan.num_steps for rid, ids in result.sampled_token_ids.items()
                   if rid != chunk_id)


def test_the_worker_refuses_a_burst_it_cannot_run_as_single_steps() -> None:
    # Two chunks in one burst; a chunk burst that would reach its prompt's end (and sample,
    # then decode): each refused before the model runs.
    for prompts, error in (([20, 10], "one chunk at most"), ([20], "reaches the prompt's end")):
        engine = _engine(4, False, 48)
        for i, num in enumerate(prompts):
            engine.add_request([3 + i] * num, SamplingParams(max_tokens=3))
        plan = engine.scheduler.schedule()
        assert sorted(plan.num_scheduled_tokens.values(), reverse=True) == prompts
        plan.num_steps = 2
        with pytest.raises(ValueError, match=error):
            engine.worker.launch(plan)
        # The same plan as a single step runs.
        plan.num_steps = 1
        assert engine.worker.execute(plan).num_tokens == sum(prompts)
