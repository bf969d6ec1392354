"""Policies benchmark: stall-free token budgets against the policies users run today (issue 6).

    python -m benchmarks.run --only policies [--quick]
    python -m benchmarks.policies_bench [--quick] [--itl-slo-ms MS]

Same engine, same model (builtin:bench; builtin:tiny with --quick), three scheduling policies
(controller/policies.py), measured in virtual time driven by real step durations
(benchmarks/virtual_time.py):
1. ITL SLO: SLO_FACTOR x the measured decode-only step of the scene's users (unless given).
   5x is Sarathi-Serve's "strict" SLO: five decode iterations without prefill interference.
2. Budgets: tokenflow's from a calibration run in this process (workers/calibrate.py,
   BudgetTable.recommend for the SLO with the scene's users planned as decodes at their own
   context; the scheduler then sizes each chunk per step with the table's cost model at
   the long prompt's current depth); prefill-first
   with vLLM V0's default max(max_model_len, 2048) = 8192 (whole prompts; the budget only
   caps how many share a step); prefill-priority-chunked with 2048, the usual online
   default for chunked prefill: a budget of tokenflow's size would not shorten its stall
   (decodes never share a step with prefill, they wait for every chunk) and would only
   add steps, so 2048 is the kinder setting for it.
3. The long-prompt scene (policy_scene.py); capacity under the SLO (policy_capacity.py);
   offline tokens/s against transformers' static batching (policy_offline.py).
4. Targets and their explanations (policy_report.py), profiles (benchmarks/profiling.py).
Writes policies.json (via benchmarks.run), policies.png and policies_budget.json (the
budget table this run used, loadable as the `budget_file` setting).

One torch thread, like the calibration benchmark and the Ray worker actors: with two busy
cores, two threads make every parallel region wait for the slower one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.policy_capacity import TrialRunner, search_capacity
from benchmarks.policy_offline import tokenflow_offline, transformers_static
from benchmarks.policy_report import attach_targets, prefill_estimate
from benchmarks.policy_scene import plot_scene, run_scenes, scene_metrics
from benchmarks.policy_workloads import MixSpec, SceneSpec, mix_requests, random_prompt
from benchmarks.profiling import profile_alternating
from benchmarks.virtual_time import VirtualClock, warm_up
from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine
from controller.budget import BudgetTable
from controller.policies import POLICIES
from workers.calibrate import Calibrator
from workers.calibration_grid import CalibrationSpec, tile_grid
from workers.presets import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 1
SLO_FACTOR = 5.0  # Sarathi-Serve's strict SLO: 5x a decode iteration
TTFT_FACTOR = 5.0  # P99 TTFT bound: 5x the predicted one-shot prefill of the longest prompt
BASELINE_BUDGETS = {"prefill-first": 8192, "prefill-priority-chunked": 2048}
QUIET_LOGGERS = ("tokenflow.flow", "tokenflow.protections", "tokenflow.slow_requests")


def _ratio_summary(ratios: list[float]) -> dict[str, float | int]:
    """Measured / predicted time of the last chunk-carrying steps (the refit's window): a
    median near 1 with a far maximum is machine noise, not a mis-fitted model."""
    ordered = sorted(ratios)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "median": statistics.median(ordered),
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1],
            "num_over_1_3": sum(r > 1.3 for r in ordered)}


def _progress(message: str) -> None:
    print(f"[policies] {message}", flush=True)  # minutes-long run: say where it is


@dataclass(frozen=True)
class PoliciesConfig:
    model: str
    scene: SceneSpec
    mix: MixSpec
    probe_steps: int  # decode-only steps timed for the SLO
    calib_max_tokens: int
    calib_contexts: tuple[int, ...]
    calib_decode_batches: tuple[int, ...]
    calib_decode_contexts: tuple[int, ...]
    calib_iters: int
    capacity_range: tuple[float, float]  # in units of 1 / (decode step): hardware-relative
    capacity_iterations: int
    hf_batch_size: int
    offline_requests: int  # the first n of the capacity mix
    num_kv_blocks: int = 2048


FULL = PoliciesConfig(
    "builtin:bench", SceneSpec(16, 128, 256, 4096, 8, 16),
    MixSpec(12, 256, 0.7, (64, 1536), 16, 0.5, (4, 48)), probe_steps=12,
    calib_max_tokens=256, calib_contexts=(0, 4096), calib_decode_batches=(1, 8, 16),
    calib_decode_contexts=(128, 384), calib_iters=5, capacity_range=(0.005, 0.32),
    capacity_iterations=4, hf_batch_size=16, offline_requests=12)
QUICK = PoliciesConfig(
    "builtin:tiny", SceneSpec(4, 32, 24, 256, 8, 4),
    MixSpec(6, 32, 0.6, (8, 128), 8, 0.4, (4, 16)), probe_steps=4,
    calib_max_tokens=64, calib_contexts=(0, 256), calib_decode_batches=(1, 4),
    calib_decode_contexts=(32, 64), calib_iters=1, capacity_range=(0.005, 0.32),
    capacity_iterations=2, hf_batch_size=4, offline_requests=6, num_kv_blocks=256)


def _config(cfg: PoliciesConfig, policy: str, scheduler: dict[str, Any] | None = None,
            calibration: dict[str, Any] | None = None,
            slo: dict[str, Any] | None = None) -> TokenflowConfig:
    # No prefix caching: trials replay the same prompts, and a hit would skip their prefill.
    # One step a plan: the policies are compared step by step in virtual time (a decode
    # burst's tokens would all land at its end); bursts are the peer benchmark's.
    return TokenflowConfig(
        worker={"model": cfg.model},
        cache={"num_kv_blocks": cfg.num_kv_blocks, "enable_prefix_caching": False},
        scheduler={"scheduling_policy": policy, "decode_steps": 1, **(scheduler or {})},
        calibration=calibration or {"auto": False},  # baselines: their fixed budgets
        slo=slo or {})


def decode_steps_s(engine: LocalEngine, clock: VirtualClock, cfg: PoliciesConfig,
                   tag: str) -> list[float]:
    """Decode-only steps of the scene's users (its prompt length, its batch), the last
    `probe_steps` of a warm-up run: samples of the SLO's unit. The first call doubles as
    the engine's warm-up."""
    spec, vocab = cfg.scene, engine.worker.vocab_size
    prompts = [random_prompt(random.Random(i), spec.user_prompt, vocab)
               for i in range(spec.num_users)]
    trace = warm_up(engine, clock, prompts, 2 * cfg.probe_steps, tag)
    full = [s.duration_s for s in trace.steps
            if s.decode_tokens == spec.num_users and not s.prefill_tokens]
    return full[-cfg.probe_steps:]


def _user_context(cfg: PoliciesConfig) -> int:
    return cfg.scene.user_prompt + cfg.scene.user_output  # the deepest a user decodes at


def _base(cfg: PoliciesConfig) -> TokenflowConfig:
    """The defaults the calibration and its table use (calibration settings, block size)."""
    return TokenflowConfig(worker={"model": cfg.model}, calibration={"auto": False})


def calibrate(cfg: PoliciesConfig) -> tuple[dict[str, Any], Calibrator]:
    """The calibration's measurements; the table is built once the SLO is known."""
    base = _base(cfg)
    cal, block_size = base.calibration, base.cache.block_size
    spec = CalibrationSpec(
        model=cfg.model, dtype=base.worker.dtype, device=base.worker.device,
        block_size=block_size, tile_tokens=cal.tile_tokens, warmup=1, iters=cfg.calib_iters,
        threads=THREADS,
        prefill_tokens=tile_grid(math.lcm(block_size, cal.tile_tokens), cfg.calib_max_tokens),
        contexts=cfg.calib_contexts, decode_batches=cfg.calib_decode_batches,
        decode_contexts=cfg.calib_decode_contexts, matmul_size=cal.matmul_size,
        bandwidth_bytes=cal.bandwidth_bytes, memory_fraction=cal.memory_fraction)
    calibrator = Calibrator(spec, progress=False)
    return calibrator.run(), calibrator


def budget_table(cfg: PoliciesConfig, measured: dict[str, Any], itl_slo_ms: float) -> BudgetTable:
    cal = _base(cfg).calibration
    return BudgetTable.build(measured, itl_slo_ms=itl_slo_ms,
                             bandwidth_headroom=cal.bandwidth_headroom,
                             chunk_efficiency=cal.chunk_efficiency,
                             plan_context_tokens=None, plan_decodes=cfg.scene.num_users,
                             plan_decode_context_tokens=_user_context(cfg))


def _profiles(calibrator: Calibrator, chunk: int, cfg: PoliciesConfig) -> dict[str, Any]:
    """Where a tokenflow chunk step's time goes, at the deepest depth and at depth 0, and a
    decode step of the users: the evidence behind each `why`."""
    depth = max(cfg.calib_contexts)
    return profile_alternating({
        "chunk_at_depth": calibrator.prefill_point(chunk, depth),
        "chunk_at_depth_0": calibrator.prefill_point(chunk, 0),
        "decode_batch": calibrator.decode_point(max(cfg.calib_decode_batches),
                                                max(cfg.calib_decode_contexts)),
    }, runs=2, top=8)


def _run(cfg: PoliciesConfig, out_dir: Path, itl_slo_ms: float | None) -> dict[str, Any]:
    started, phases = time.perf_counter(), {}
    load_start = os.getloadavg()[0]  # other engineers' runs share the cores: say how busy
    probe_clock = VirtualClock()
    probe = LocalEngine(_config(cfg, "tokenflow"), clock=probe_clock)
    # The SLO's unit from decode steps timed before and after the calibration (~10 s
    # apart): this machine's speed drifts by tens of percent over seconds, and one burst of
    # probes set a different SLO in every run.
    before = decode_steps_s(probe, probe_clock, cfg, "probe")
    _progress(f"decode step {statistics.median(before) * 1e3:.1f} ms; calibrating")
    measured, calibrator = calibrate(cfg)
    after = decode_steps_s(probe, probe_clock, cfg, "probe-after")
    step_s = statistics.median(before + after)
    slo_ms = itl_slo_ms or SLO_FACTOR * step_s * 1e3
    _progress(f"decode step {statistics.median(after) * 1e3:.1f} ms after it: median "
              f"{step_s * 1e3:.1f} ms -> ITL SLO {slo_ms:.0f} ms")
    table = budget_table(cfg, measured, slo_ms)
    phases["setup_s"] = time.perf_counter() - started
    budget_file = out_dir / "policies_budget.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    table.save(budget_file)
    clocks = {p: VirtualClock() for p in POLICIES}
    tokenflow = {"calibration": {"budget_file": budget_file}, "slo": {"itl_ms": slo_ms}}
    engines = {p: LocalEngine(_config(
        cfg, p, **tokenflow) if p == "tokenflow" else _config(
        cfg, p, scheduler={"max_num_batched_tokens": BASELINE_BUDGETS[p]}), clock=clocks[p])
        for p in POLICIES}
    block = engines["tokenflow"].config.cache.block_size
    kv_tokens = cfg.num_kv_blocks * block
    budget = table.recommend_detail(slo_ms, block_size=block, kv_capacity_tokens=kv_tokens,
                                    context=0)  # what the engine's config plans
    vocab = probe.worker.vocab_size
    for name, engine in engines.items():
        warm_up(engine, clocks[name], [random_prompt(random.Random(7), 48, vocab)]
                * 2, 4, "warm")

    _progress(f"tokenflow budget {budget}; scene")
    t = time.perf_counter()
    traces = run_scenes(engines, clocks, cfg.scene)
    _progress(f"scenes {time.perf_counter() - t:.0f} s; capacity")
    scene = {p: scene_metrics(trace) for p, trace in traces.items()}
    for name, engine in engines.items():  # the closed loop's state after the scene
        stats = engine.core.worker_stats(0)
        scene[name]["slo_headroom_after"] = stats.slo_headroom
        scene[name]["num_refits"] = stats.num_refits
        refit = engine.core.workers[0].refit
        if refit is not None:  # tokenflow: how far its chunk steps strayed from the model
            scene[name]["measured_over_predicted"] = _ratio_summary(list(refit.ratios))
    plot_scene(traces, slo_ms, out_dir / "policies.png")
    phases["scene_s"] = time.perf_counter() - t

    t = time.perf_counter()
    requests = mix_requests(cfg.mix, vocab)
    ttft_bound = TTFT_FACTOR * table.predict(max(len(r.prompt) for r in requests), 0)
    runners = {p: TrialRunner(engines[p], clocks[p], requests, slo_ms / 1e3, ttft_bound)
               for p in POLICIES}
    lo, hi = (f / step_s for f in cfg.capacity_range)
    capacity = search_capacity(runners, lo, hi, cfg.capacity_iterations)
    phases["capacity_s"] = time.perf_counter() - t

    _progress(f"capacity {time.perf_counter() - t:.0f} s; offline")
    t = time.perf_counter()
    batch = requests[:cfg.offline_requests]
    offline = {"transformers": transformers_static(resolve_model(cfg.model), batch,
                                                   cfg.hf_batch_size),
               "tokenflow": tokenflow_offline(probe, probe_clock, batch),
               "tokenflow_slo_budget": tokenflow_offline(engines["tokenflow"],
                                                         clocks["tokenflow"], batch)}
    phases["offline_s"] = time.perf_counter() - t
    profiles = _profiles(calibrator, budget["chunk_size"], cfg)

    spec = cfg.scene
    decode_ctx = spec.user_prompt + spec.user_output // 2
    unit = block  # the chunk grid: block size (the tile divides it here)
    estimates = {name: prefill_estimate(table, spec.long_prompt, spec.num_users, decode_ctx,
                                        slo_ms / 1e3, unit, chunk)
                 for name, chunk in (("static", budget["chunk_size"]), ("depth_aware", None))}
    slow = scene["tokenflow"]["window_steps"]["slowest_step"]
    slowest_predicted = table.predict_step(slow.get("chunk_tokens", 0), slow.get("chunk_depth", 0),
                                           slow.get("decode_tokens", 0), decode_ctx)
    report: dict[str, Any] = {
        "benchmark": "policies", "config": asdict(cfg), "threads": THREADS,
        "model": {"name": cfg.model, "params": probe.worker.num_params},
        "itl_slo": {"itl_slo_ms": slo_ms, "given": itl_slo_ms is not None,
                    "decode_step_ms": step_s * 1e3, "slo_factor": SLO_FACTOR,
                    "decode_step_ms_before_calibration": statistics.median(before) * 1e3,
                    "decode_step_ms_after_calibration": statistics.median(after) * 1e3,
                    "budget_at_3x_decode_step": table.recommend_detail(
                        3e3 * step_s, block_size=block, kv_capacity_tokens=kv_tokens,
                        context=0)},
        "budgets": {"tokenflow": budget,
                    "tokenflow_planned_at_deepest_depth": table.recommend_detail(
                        slo_ms, block_size=block, kv_capacity_tokens=kv_tokens),
                    **{p: {"max_num_batched_tokens": b}
                                            for p, b in BASELINE_BUDGETS.items()}},
        "calibration_fit": table.data["fit"],
        "scene": scene,
        "capacity": {"ttft_bound_s": ttft_bound, "ttft_factor": TTFT_FACTOR,
                     "num_requests": len(requests),
                     "prompt_tokens": [len(r.prompt) for r in requests],
                     "output_tokens": [r.max_tokens for r in requests], "policies": capacity},
        "offline": offline,
        "analysis": {"budget": budget, "itl_slo_ms": slo_ms, "decode_step_ms": step_s * 1e3,
                     "plan_context_tokens": table.limits["plan_context_tokens"],
                     "plan_decodes": table.limits["plan_decodes"],
                     "plan_decode_context_tokens": table.limits["plan_decode_context_tokens"],
                     "long_prompt": spec.long_prompt,
                     "predicted_one_shot_long_prefill_s": table.predict(spec.long_prompt, 0),
                     "slowest_step_predicted_ms": slowest_predicted * 1e3,
                     "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
                     "cpu_count": os.cpu_count(),
                     "static_estimate": estimates["static"],
                     "depth_aware_estimate": estimates["depth_aware"]},
        "profiles": profiles,
    }
    attach_targets(report, profiles)
    phases["total_s"] = time.perf_counter() - started
    report["wall"] = phases
    return report


def run(quick: bool, out_dir: Path, itl_slo_ms: float | None = None,
        capacity_requests: int | None = None) -> dict[str, Any]:
    """The `benchmarks.run` entry. The SLO comes from `itl_slo_ms`, else the environment's
    TOKENFLOW_BENCH_ITL_SLO_MS, else the measurement. `capacity_requests` sizes each capacity
    trial (`make bench-capacity`: 100, so that a trial's P99 rests on enough requests; the
    default keeps `make bench` within its time)."""
    env = os.environ.get("TOKENFLOW_BENCH_ITL_SLO_MS")
    itl_slo_ms = itl_slo_ms or (float(env) if env else None)
    threads = torch.get_num_threads()
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    torch.set_num_threads(THREADS)
    for name in QUIET_LOGGERS:  # slow-request and mode logs are expected here, by design
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        cfg = QUICK if quick else FULL
        if capacity_requests is not None:
            cfg = dataclasses.replace(cfg, mix=dataclasses.replace(
                cfg.mix, num_requests=capacity_requests))
        return _run(cfg, out_dir, itl_slo_ms)
    finally:  # process-wide settings: give them back to whoever runs next
        torch.set_num_threads(threads)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--itl-slo-ms", type=float, help="default: measured, see docstring")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--capacity-requests", type=int,
                        help="requests per capacity trial (make bench-capacity: 100)")
    parser.add_argument("--name", default="policies", help="report file name (no .json)")
    args = parser.parse_args()
    report = run(args.quick, args.out_dir, args.itl_slo_ms, args.capacity_requests)
    report.setdefault("quick", args.quick)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n",
                                                    encoding="utf-8")
    for name, entry in report["targets"].items():
        print(f"{'met   ' if entry['met'] else 'MISSED'} {name}: {entry['value']:.3g} "
              f"{entry['comparison']} {entry['target']:g}")


if __name__ == "__main__":
    main()
