"""`LocalEngine` with `scheduler.async_scheduling`: the next step is planned and launched
while the worker runs the current one (controller/step_loop.py). On the real model
(builtin:tiny, CPU) every request gets the tokens of the serial engine, token by token:
greedy ones that may stop on EOS or a stop token, seeded random ones, long prompts cut into
chunks, over a KV pool small enough to preempt; aborts while a step runs leak no block.
tests/workers/test_cuda_path.py repeats the comparison on CUDA, where the launch returns
before the device has run the step."""

from __future__ import annotations

import random

import pytest

from cluster.engine import LocalEngine
from controller.messages import SamplingParams
from workers.worker import Worker


def _engine(is_async: bool, num_kv_blocks: int = 48) -> LocalEngine:
    return LocalEngine(worker={"model": "builtin:tiny", "telemetry": False},
                       cache={"num_kv_blocks": num_kv_blocks, "block_size": 8},
                       scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 6,
                                  "max_chunk_tokens": 32, "async_scheduling": is_async})


def _workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    out = []
    for i in range(14):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice((5, 17, 40, 90)))]
        if i % 3 == 0:
            params = SamplingParams(max_tokens=6 + i, temperature=0.8, top_p=0.9, seed=i)
        elif i % 3 == 1:  # may stop early on EOS: planned one step too far when async
            params = SamplingParams(max_tokens=4 + 2 * i, temperature=0.0)
        else:
            params = SamplingParams(max_tokens=12, temperature=0.0,
                                    stop_token_ids=tuple(range(3, vocab, 5)))
        out.append((prompt, params))
    return out


def _generate(engine: LocalEngine) -> list[tuple[list[int], str | None]]:
    work = _workload(engine.worker.vocab_size)
    done = engine.generate([p for p, _ in work], [sp for _, sp in work])
    engine.check_integrity()
    return [(c.output_token_ids, c.finish_reason) for c in done]


@pytest.mark.parametrize("num_kv_blocks", [48, 20], ids=["roomy", "preempting"])
def test_async_engine_gives_the_serial_engines_tokens(num_kv_blocks: int) -> None:
    serial = _engine(False, num_kv_blocks)
    expected = _generate(serial)
    if num_kv_blocks == 20:
        assert serial.scheduler.stats.num_preemptions > 0
    pipelined = _engine(True, num_kv_blocks)
    assert pipelined.loop.is_ahead
    got = _generate(pipelined)
    assert [reason for _, reason in expected].count("stop") >= 2
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"request {i}"


def test_async_engine_abort_while_a_step_runs_leaks_nothing() -> None:
    engine = _engine(True)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([5 + i] * 20, params) for i in range(4)]
    outputs: dict[str, list] = {rid: [] for rid in ids}
    for _ in range(4):
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.loop.is_in_flight
    engine.abort(ids[1])
    for rid in ids:
        outputs[rid] += list(engine.stream(rid))
    assert outputs[ids[1]][-1].finish_reason == "abort"
    assert all(sum(len(o.new_token_ids) for o in outputs[rid]) == 30
               for rid in (ids[0], ids[2], ids[3]))
    engine.check_integrity()
    assert engine.scheduler.kv.pool.stats().num_used == 0


def test_worker_launches_one_step_at_a_time_and_survives_a_bad_plan() -> None:
    engine = _engine(False)
    worker: Worker = engine.worker
    engine.add_request([7] * 10, SamplingParams(max_tokens=3, temperature=0.0))
    plan = engine.core.begin_step(0)
    pending = worker.launch(plan)
    with pytest.raises(RuntimeError, match="not waited for"):
        worker.launch(plan)
    result = worker.wait(pending)
    assert len(result.sampled_token_ids[next(iter(plan.num_scheduled_tokens))]) == 1
    with pytest.raises(RuntimeError, match="no launched step"):
        worker.wait(pending)
    engine.core.finish_step(0, plan, result)
    bad = engine.core.begin_step(0)
    bad.num_scheduled_tokens = {rid: 99 for rid in bad.num_scheduled_tokens}
    bad.num_steps = 1  # a decode burst (the decode left: 2) is refused before this check
    with pytest.raises(ValueError, match=r"only .* known"):
        worker.launch(bad)
    assert not worker._launched  # the refused plan left nothing to wait for
