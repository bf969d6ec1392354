"""The cost model and the budget rules on synthetic measurements (no torch, no timing)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.budget import BudgetTable, chunk_pairs, fit_nonneg, pad

TRUE = (2e-3, 5e-5, 3e-9)  # a (s), b (s/token), c (s/pair): a small GPU-ish step
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
CONTEXTS = (0, 1024, 4096)


def synthetic(noise: float = 0.0, tile: int = 16, block: int = 16, kv_tokens: int = 1 << 20,
              bandwidth: float = 1e12, weight_bits: int = 16) -> dict[str, Any]:
    """Measurements whose times follow TRUE exactly (times `1 + noise * N(0, 1)`)."""
    rng = random.Random(0)
    a, b, c = TRUE

    def timing(seconds: float) -> dict[str, Any]:
        s = seconds * (1.0 + noise * rng.gauss(0.0, 1.0))
        return {"mean_s": s, "median_s": s, "std_s": 0.0}

    prefill = [{"tokens": t, "context": ctx, "bytes_moved": 10_000_000 + 4000 * t + 100 * ctx,
                **timing(a + b * pad(t, tile) + c * chunk_pairs(pad(t, tile), ctx))}
               for ctx in CONTEXTS for t in TOKENS]
    decode = [{"batch": n, "context": ctx, "bytes_moved": 10_000_000 + 200_000 * n,
               **timing(a + 2 * b * n + 4 * c * n * (ctx + 1))}
              for ctx in (128, 1024) for n in (1, 8, 32)]
    return {
        "schema_version": 1, "created_unix": 0.0, "device_name": "synthetic",
        "spec": {"model": "synthetic", "dtype": "bfloat16", "device": "cpu", "block_size": block,
                 "tile_tokens": tile, "warmup": 5, "iters": 20, "threads": None,
                 "prefill_tokens": list(TOKENS), "contexts": list(CONTEXTS),
                 "decode_batches": [1, 8, 32], "decode_contexts": [128, 1024],
                 "matmul_size": 2048, "bandwidth_bytes": 1 << 28,
                 "memory_fraction": 0.9},
        "model_stats": {"num_params": 5_000_000, "weight_bytes": 10_000_000,
                        "weight_bits": weight_bits, "measured_weight_bits": 16,
                        "flops_per_token": 1e7, "flops_per_pair": 1e4, "flops_per_sample": 1e6,
                        "max_model_len": 8192},
        "hardware": {"peak_flops": 1e14, "memory_bandwidth": bandwidth},
        "kv": {"bytes_per_block": 4096, "memory_budget_bytes": 1 << 30, "blocks_fit": 1 << 18,
               "alloc_probe": [{"blocks": 1 << 18, "ok": True}], "blocks_allocated": 1 << 18,
               "max_blocks_int64": 1 << 50, "max_tokens_int32_offset": 1 << 24,
               "capacity_tokens": kv_tokens},
        "prefill": prefill, "decode": decode,
    }


def build(measured: dict[str, Any], slo_ms: float = 50.0) -> BudgetTable:
    return BudgetTable.build(measured, itl_slo_ms=slo_ms, bandwidth_headroom=0.15,
                             chunk_efficiency=0.9, plan_context_tokens=None)


def test_fit_recovers_coefficients_exactly() -> None:
    fit = build(synthetic()).data["fit"]["prefill"]
    for got, want in zip((fit["a"], fit["b"], fit["c"]), TRUE, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert fit["max_rel_error"] < 1e-9


def test_decode_fit_recovers_coefficients() -> None:
    """Two decode depths tell the per-token cost from the per-pair cost."""
    fit = build(synthetic()).data["fit"]["decode"]
    a, b, c = TRUE
    for got, want in zip((fit["a"], fit["b"], fit["c"]), (a, 2 * b, 4 * c), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_recovers_coefficients_under_noise() -> None:
    fit = build(synthetic(noise=0.03)).data["fit"]["prefill"]
    for got, want in zip((fit["a"], fit["b"], fit["c"]), TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    assert fit["median_rel_error"] < 0.05


def test_fit_never_returns_negative_coefficients() -> None:
    # y = 1e-3 * x - 5e-4: the unconstrained intercept is negative, the fit drops it.
    rows = [[1.0, x, 0.0] for x in (1.0, 2.0, 4.0, 8.0)]
    a, b, c = fit_nonneg(rows, [1e-3 * r[1] - 5e-4 for r in rows])
    assert a == 0.0 and c == 0.0 and b > 0


def test_padding_is_paid_for() -> None:
    table = build(synthetic(tile=64, block=16))
    assert table.predict(65, 0) == table.predict(128, 0) > table.predict(64, 0)


def test_chunks_are_on_the_block_and_tile_grid() -> None:
    table = build(synthetic(tile=64, block=16))
    for slo in (5.0, 20.0, 50.0, 200.0):
        budget, chunk = table.recommend(slo)
        assert budget % 64 == 0 and chunk % 64 == 0 and 0 < chunk <= budget
    budget, chunk = table.recommend(50.0, block_size=48)  # another pool: lcm(48, 64) = 192
    assert budget % 192 == 0 and chunk % 192 == 0


def test_budget_respects_the_slo() -> None:
    """The step at the budget stays under the SLO with no decodes and with the largest
    measured decode batch in it; one grid unit more breaks the SLO."""
    table = build(synthetic())
    detail = table.recommend_detail(50.0)
    budget, context = detail["max_num_batched_tokens"], table.limits["plan_context_tokens"]
    decodes = table.limits["plan_decodes"]
    assert decodes == 32  # default: the largest calibrated decode batch
    assert table.predict_step(budget, context) <= 0.05
    dctx = table.limits["plan_decode_context_tokens"]  # decodes at their own depth
    assert table.predict_step(budget - decodes, context, decodes, dctx) <= 0.05
    assert detail["limited_by"] == "itl_slo"
    over = budget + 16
    assert max(table.predict_step(over, context),
               table.predict_step(over - decodes, context, decodes, dctx)) > 0.05


@settings(max_examples=50, deadline=None)
@given(st.floats(1.0, 500.0), st.floats(1.0, 500.0))
def test_looser_slo_never_gives_a_smaller_budget(slo_a: float, slo_b: float) -> None:
    table = _TABLE
    tight, loose = sorted((slo_a, slo_b))
    assert table.recommend(loose)[0] >= table.recommend(tight)[0]
    assert table.recommend(loose)[1] >= table.recommend(tight)[1]


_TABLE = build(synthetic(noise=0.05))


def test_fewer_planned_decodes_never_shrink_the_budget() -> None:
    table = build(synthetic())
    for slo in (5.0, 20.0, 50.0):
        assert table.recommend(slo, decodes=0)[0] >= table.recommend(slo)[0]


def test_a_probe_slower_than_the_model_does_not_bind() -> None:
    """The GEMM probe can run below the model's own kernels (packed, fused): the compute
    bound then takes the model's measured rate, so no step the sweep ran is out of bounds."""
    slow_probe = synthetic()
    # The model's chunks run at 1e7 / 5e-5 = 2e11 FLOP/s and more; the probe says 2e10.
    slow_probe["hardware"]["peak_flops"] = 2e10
    table, fair = build(slow_probe), build(synthetic())
    assert 2e11 <= table.peak_flops < 1e14 and fair.peak_flops == 1e14
    for p in slow_probe["prefill"]:
        assert table.compute_s(p["tokens"], p["context"]) <= p["median_s"] * (1 + 1e-9)
    detail = table.recommend_detail(50.0)
    assert "compute" not in detail["limited_by"]
    assert detail["max_num_batched_tokens"] == fair.recommend_detail(50.0)["max_num_batched_tokens"]


def test_kv_capacity_binds_and_is_reported() -> None:
    table = build(synthetic(kv_tokens=4096 + 256))  # planning depth 4096: 256 tokens left
    detail = table.recommend_detail(1000.0)
    assert detail["max_num_batched_tokens"] == 256 and "kv_capacity" in detail["limited_by"]
    assert table.data["table"][-1]["binding"] == "kv_capacity"
    # A smaller pool passed by the engine binds too.
    assert table.recommend(1000.0, context=0, kv_capacity_tokens=128)[0] == 128


def test_weight_bits_scale_the_bandwidth_term() -> None:
    slow = dict(bandwidth=2e9)  # weights alone take 5 ms at 16 bits
    b16, b4 = build(synthetic(**slow)), build(synthetic(weight_bits=4, **slow))
    weights16 = b16.bandwidth_s(0, 0) - b4.bandwidth_s(0, 0)
    assert weights16 == pytest.approx(0.75 * b16.bytes_fit["weights"] / (2e9 * 0.85))
    assert b4.recommend(8.0)[0] >= b16.recommend(8.0)[0]
    assert "bandwidth" in b16.recommend_detail(8.0)["limited_by"]


def test_binding_table_covers_the_model_length() -> None:
    rows = build(synthetic(bandwidth=1e11)).data["table"]
    assert rows[0]["tokens_min"] == 16 and rows[-1]["tokens_max"] == 8192
    assert [r["binding"] for r in rows] == ["bandwidth", "compute"]  # the roofline


def test_deviation_and_budget_score() -> None:
    table = build(synthetic())
    predicted = table.predict(512, 1024)
    assert table.deviation(predicted * 1.2, 512, 1024) == pytest.approx(0.2)
    assert table.deviation(predicted * 0.8, 512, 1024) == pytest.approx(-0.2)
    assert table.budget_score(predicted * 1.6, 512, 1024) == pytest.approx(1.6)
    expected = table.predict(512, 0) + table.predict(512, 512) + table.predict(100, 1024)
    assert table.budgeted_prefill_s(1124, 512) == pytest.approx(expected)


def test_refit_on_live_timings() -> None:
    """The drift detector's re-fit: chunks 30 % slower than calibrated move the model."""
    table = build(synthetic())
    live = [(t, c, 1.3 * table.predict(t, c)) for t in (64, 256, 1024) for c in (0, 2048)]
    slower = table.refit(live)
    assert slower.deviation(1.3 * table.predict(512, 1024), 512, 1024) == pytest.approx(0.0,
                                                                                     abs=1e-6)
    assert slower.recommend(50.0)[0] <= table.recommend(50.0)[0]
