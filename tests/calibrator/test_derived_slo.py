"""The ITL SLO derived from the measured costs when none is configured, and what a
scheduler planned on it does in the issue's served scene (8 users decoding, a 6,000-token
prompt, a 32-token one right after) on a CPU-like table: the budget leaves room for a chunk
beside the decodes, the short prompt is not held behind the long one, and the long prompt
prefills at near the best rate. Synthetic measurements, no timing."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from cluster.config import TokenflowConfig
from controller.budget import MIN_SLO_DECODE_MULTIPLE, BudgetTable, chunk_pairs, pad
from controller.options import budgeted_scheduler
from tests.calibrator.test_fit import synthetic
from tests.unit.test_fair_scheduling import NUM_USERS, Scene

# A CPU-like step: a few ms fixed, ~1 ms a token, decodes dominated by weight reads.
PREFILL = (8e-3, 1.2e-3, 2e-8)  # a (s), b (s/token), c (s/pair)
DECODE = (25e-3, 3e-3, 1e-7)
TOKENS = (16, 32, 64, 128, 256, 512)


def cpu_like(prefill: tuple[float, float, float] = PREFILL,
             decode: tuple[float, float, float] = DECODE) -> dict[str, Any]:
    measured = synthetic()
    measured["spec"] = {**measured["spec"], "prefill_tokens": list(TOKENS), "contexts": [0, 256],
                        "decode_batches": [1, 8]}
    a, b, c = prefill
    measured["prefill"] = [
        {"tokens": t, "context": ctx, "bytes_moved": 10_000_000 + 4000 * t,
         **_timing(a + b * pad(t, 16) + c * chunk_pairs(pad(t, 16), ctx))}
        for ctx in (0, 256) for t in TOKENS]
    da, db, dc = decode
    measured["decode"] = [{"batch": n, "context": ctx, "bytes_moved": 10_000_000,
                           **_timing(da + db * n + dc * n * (ctx + 1))}
                          for ctx in (128, 1024) for n in (1, 8)]
    measured["model_stats"] = {**measured["model_stats"], "flops_per_token": 1e5}
    return measured


def _timing(seconds: float) -> dict[str, float]:
    return {"mean_s": seconds, "median_s": seconds, "std_s": 0.0}


def derived(measured: dict[str, Any]) -> BudgetTable:
    return BudgetTable.build(measured, itl_slo_ms=None, bandwidth_headroom=0.15,
                             chunk_efficiency=0.9, plan_context_tokens=None)


def test_no_configured_slo_derives_one_where_the_chunk_is_efficient() -> None:
    table = derived(cpu_like())
    rec = table.data["recommendation"]
    assert rec["slo_source"] == "derived"
    slo_s = rec["itl_slo_ms"] / 1e3
    assert slo_s == pytest.approx(table.derived_slo_ms() / 1e3)
    cost, decodes = table.step_cost(), table.limits["plan_decodes"]
    dctx = table.decode_context
    decode_s = cost.step_s([], decodes, dctx)
    assert slo_s >= MIN_SLO_DECODE_MULTIPLE * decode_s * (1 - 1e-9)
    # The budget carries the planned decodes and a chunk that prefills at >= 90 % of the
    # best prefill-only rate (what a long prompt's time to first token is made of).
    # (planned at depth 0, as the running scheduler is: the file's own recommendation sits
    # at the deepest calibrated depth)
    budget = table.recommend(rec["itl_slo_ms"], context=0)[0]
    chunk = (budget - decodes) // 16 * 16  # the scheduler ends chunks on the block grid
    best = max(t / table.predict(t, 0) for t in range(16, 513, 16))
    assert chunk / cost.step_s([(chunk, 0)], decodes, dctx) >= 0.9 * best
    assert cost.step_s([(chunk, 0)], decodes, dctx) <= slo_s
    assert not table.recommend_detail(rec["itl_slo_ms"], context=0)["limited_by"].startswith(
        "unreachable")


def test_a_configured_slo_wins_and_is_recorded_as_such() -> None:
    table = BudgetTable.build(cpu_like(), itl_slo_ms=40.0, bandwidth_headroom=0.15,
                              chunk_efficiency=0.9, plan_context_tokens=None)
    assert table.data["recommendation"]["itl_slo_ms"] == 40.0
    assert table.data["recommendation"]["slo_source"] == "configured"
    assert table.slo_ms(40.0) == 40.0 and table.slo_ms(None) == table.derived_slo_ms()


def test_slow_decodes_raise_the_derived_slo_to_twice_a_decode_step() -> None:
    """Decodes so slow that any chunk is efficient: the floor (two decode steps) binds."""
    table = derived(cpu_like(prefill=(1e-4, 1e-5, 0.0), decode=(0.5, 0.01, 0.0)))
    decode_s = table.step_cost().step_s([], table.limits["plan_decodes"], table.decode_context)
    assert table.derived_slo_ms() == pytest.approx(1e3 * MIN_SLO_DECODE_MULTIPLE * decode_s)


def test_fit_reads_medians_so_one_stolen_burst_does_not_move_it() -> None:
    clean = cpu_like()
    bursty = copy.deepcopy(clean)
    for point in bursty["prefill"][::3]:
        point["mean_s"] += 0.2  # one 0.6 s sample among three
    a = derived(clean).data["fit"]["prefill"]
    b = derived(bursty).data["fit"]["prefill"]
    assert (a["a"], a["b"], a["c"]) == pytest.approx((b["a"], b["b"], b["c"]))


def test_the_running_scheduler_gets_the_derived_slo_and_budget() -> None:
    cfg = TokenflowConfig()
    assert cfg.slo.itl_ms is None
    table = derived(cpu_like())
    sched = budgeted_scheduler(cfg.scheduler, table, cfg.calibration, cfg.slo, cfg.cache)
    itl_slo_s = cfg.controller_options().with_budget_table(table, cfg.calibration).itl_slo_s
    assert itl_slo_s == pytest.approx(table.derived_slo_ms() / 1e3)
    assert sched.max_num_batched_tokens > table.limits["plan_decodes"] + 32


def test_served_scene_short_prompt_is_not_held_behind_the_long_one() -> None:
    """The issue's scene on the derived plan: 8 users decode, a 6,000-token prompt lands, a
    32-token prompt one step later. The short prompt's first token comes within 2 steps of
    its arrival, every step stays under the SLO, users decode every step, and the long
    prompt's prefill runs at >= 75 % of the best prefill-only rate."""
    cfg = TokenflowConfig()
    table = derived(cpu_like())
    cost = table.step_cost()
    sched_cfg = budgeted_scheduler(cfg.scheduler, table, cfg.calibration, cfg.slo, cfg.cache)
    scene = Scene(budget=sched_cfg.max_num_batched_tokens, num_blocks=4096, model=cost,
                  cost=cost)
    slo_s = table.derived_slo_ms() / 1e3
    scene.sched.itl_slo_s = slo_s
    scene.users_decoding()
    scene.add("long", 6000, max_tokens=4)
    scene.step()
    arrival = len(scene.plans)
    scene.add("short", 32, max_tokens=4)
    long_start = arrival - 1
    while "long" not in scene.first_token_step:
        plan = scene.step()
        users = [r for r in plan.num_scheduled_tokens if r.startswith("user-")]
        assert len(users) == NUM_USERS  # nobody stalls
    assert scene.first_token_step["short"] - arrival <= 2
    assert max(scene.step_times[long_start:]) <= slo_s * (1 + 1e-9)
    best = max(t / table.predict(t, 0) for t in range(16, 513, 16))
    long_s = sum(scene.step_times[long_start:scene.first_token_step["long"] + 1])
    assert 6000 / long_s >= 0.75 * best, (6000 / long_s, best)
    assert dataclasses.replace(sched_cfg) == sched_cfg


def test_the_derived_slo_stretches_at_depth_and_a_configured_one_does_not() -> None:
    cfg = TokenflowConfig()
    table = derived(cpu_like())
    options = cfg.controller_options().with_budget_table(table, cfg.calibration)
    assert options.depth_stretch == cfg.slo.max_depth_stretch > 1
    assert options.chunk_efficiency == cfg.calibration.chunk_efficiency
    configured = TokenflowConfig(slo={"itl_ms": 80.0})  # type: ignore[arg-type]
    options = configured.controller_options().with_budget_table(table, configured.calibration)
    assert options.depth_stretch == 1.0


def test_served_scene_with_the_depth_stretch() -> None:
    """The scene above with the derived SLO's depth stretch: the short prompt still comes
    within 2 steps, users decode every step, no step runs past stretch x SLO, and the long
    prompt prefills at least as fast as without the stretch."""
    cfg = TokenflowConfig()
    table = derived(cpu_like())
    cost = table.step_cost()
    sched_cfg = budgeted_scheduler(cfg.scheduler, table, cfg.calibration, cfg.slo, cfg.cache)
    slo_s, stretch = table.derived_slo_ms() / 1e3, cfg.slo.max_depth_stretch
    long_s = {}
    for depth_stretch in (1.0, stretch):
        scene = Scene(budget=sched_cfg.max_num_batched_tokens, num_blocks=4096, model=cost,
                      cost=cost, depth_stretch=depth_stretch)
        scene.sched.itl_slo_s = slo_s
        scene.users_decoding()
        scene.add("long", 6000, max_tokens=4)
        scene.step()
        arrival = len(scene.plans)
        scene.add("short", 32, max_tokens=4)
        while "long" not in scene.first_token_step:
            plan = scene.step()
            assert sum(r.startswith("user-") for r in plan.num_scheduled_tokens) == NUM_USERS
        assert scene.first_token_step["short"] - arrival <= 2
        assert max(scene.step_times[arrival - 1:]) <= depth_stretch * slo_s * (1 + 1e-9)
        long_s[depth_stretch] = sum(
            scene.step_times[arrival - 1:scene.first_token_step["long"] + 1])
    assert long_s[stretch] <= long_s[1.0]
