"""The budget plan prices the decodes riding in a step at their own context: with decodes
planned, a calibrated builtin:bench table on CPU leaves a budget above the one-unit floor
(pricing every decode at the chunk's depth, as before, left the floor)."""

from __future__ import annotations

from pathlib import Path

from controller.budget import BudgetTable
from workers.calibrate import CalibrationSpec, Calibrator

DEPTH, USERS, USER_CONTEXT = 1024, 16, 384  # a long prompt's depth; users mid-stream


def test_budget_with_planned_decodes_is_above_the_floor_on_bench(preset_cache: Path) -> None:
    spec = CalibrationSpec(
        model="builtin:bench", dtype="float32", device="cpu", block_size=16, tile_tokens=16,
        warmup=1, iters=2, threads=1, prefill_tokens=(16, 32, 64, 128), contexts=(0, DEPTH),
        decode_batches=(1, USERS), decode_contexts=(128, USER_CONTEXT), matmul_size=512,
        bandwidth_bytes=64 * 2**20, memory_fraction=0.9)
    measured = Calibrator(spec, progress=False).run()

    def build(decode_context: int) -> BudgetTable:
        return BudgetTable.build(measured, itl_slo_ms=100.0, bandwidth_headroom=0.15,
                                 chunk_efficiency=0.9, plan_context_tokens=DEPTH,
                                 plan_decodes=USERS, plan_decode_context_tokens=decode_context)

    table = build(USER_CONTEXT)
    assert table.limits["plan_decodes"] == USERS
    # The policies benchmark's SLO: 5x the users' decode-only step.
    slo_ms = 5e3 * table.predict_step(0, 0, USERS, USER_CONTEXT)
    detail = table.recommend_detail(slo_ms)
    assert detail["max_num_batched_tokens"] > 16, detail  # the floor is one grid unit
    assert not detail["limited_by"].startswith("unreachable")
    at_depth = build(DEPTH).recommend_detail(slo_ms)  # the old pricing
    assert detail["max_num_batched_tokens"] >= at_depth["max_num_batched_tokens"]
