"""KV compaction and bandwidth telemetry on the real engine (builtin:tiny)."""

from __future__ import annotations

import random

from cluster.engine import LocalEngine
from controller.messages import SamplingParams
from workers.telemetry import ScriptedSource


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 90))] for _ in range(14)]
    params = [SamplingParams(max_tokens=rng.randint(2, 30), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    return prompts, params


def run(defrag: bool) -> tuple[list[list[int]], LocalEngine]:
    engine = LocalEngine(
        worker={"model": "builtin:tiny", "telemetry": False},
        cache={"block_size": 4, "num_kv_blocks": 96, "enable_prefix_caching": True},
        scheduler={"max_num_batched_tokens": 48, "max_num_seqs": 6,
                   "defrag_threshold": 0.05 if defrag else None})
    engine.scheduler.config.defrag_every_steps = 1  # compact whenever fragmented
    prompts, params = workload()
    results = engine.generate(prompts, params)
    engine.check_integrity()
    return [r.output_token_ids for r in results], engine


def test_compaction_moves_blocks_and_keeps_outputs_exact():
    plain, _ = run(defrag=False)
    compacted, engine = run(defrag=True)
    assert engine.scheduler.stats.num_defrag_moves > 0
    assert compacted == plain


def test_scripted_telemetry_drives_the_throttle_through_the_engine():
    clock = {"now": 0.0}
    engine = LocalEngine(worker={"model": "builtin:tiny", "telemetry": False},
                         cache={"block_size": 8, "num_kv_blocks": 256},
                         scheduler={"max_num_batched_tokens": 256, "max_chunk_tokens": 32,
                                    "max_long_partial_prefills": 4},
                         clock=lambda: clock["now"])
    engine.worker.telemetry = ScriptedSource(lambda now: 0.97)
    rng = random.Random(1)
    for _ in range(6):
        engine.add_request([rng.randrange(3, 500) for _ in range(200)],
                           SamplingParams(max_tokens=2, ignore_eos=True))
    chunks_per_step = []
    while engine.has_unfinished():
        engine.keep_step_log = True
        engine.step()
        plan, result = engine.step_log[-1]
        assert result.bandwidth_utilization == 0.97
        chunks_per_step.append(sum(1 for n in plan.num_scheduled_tokens.values() if n > 1))
        clock["now"] += 0.5
    assert chunks_per_step[0] == 4  # NORMAL at first
    flow = engine.core.workers[0].flow
    assert flow.stats.transitions >= 1 and flow.throttle_level == 1
    # after 3 s above 95 %: one chunk per step
    assert max(chunks_per_step[8:]) <= 1
