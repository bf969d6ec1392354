"""`tokenflow` console script.

    tokenflow calibrate --model M [--itl-slo-ms X] --out budget.json [--quick] [--force]
                        [--warmup N --iters N] [--max-tokens N] [--threads N] [--no-size]
    tokenflow calibrate --check budget.json [--tolerance X] [--warmup N --iters N]
    tokenflow dashboard push --grafana-url URL [--token T] [--file dashboards/tokenflow.json]
    tokenflow batch -i IN -o OUT [--local | --ray-data] ...   (= python -m cluster.batch)
    tokenflow workers list|add|drain ...   (the pool of a running cluster: cluster/workers_cli.py)

`calibrate` measures on this machine's worker device (workers/calibrate.py), fits the cost
model and writes the budget table plus a PNG of the fit beside it (budget.png). It sizes its
grid to `calibration.max_duration_s` after a pilot and prints the estimate first (not with
`--quick`, whose grid is the automatic calibration's, nor `--no-size`); an existing `--out`
is kept unless `--force`.
`--check` repeats the table's own measurement plan (the same grid, samples and threads) and
exits 1 when a quantity drifted more than the tolerance plus its noise allowance (the spread
both runs measured, times `calibration.check_noise_factor`). Per quantity, not per point:
the median ratio of step-time medians over the prefill points, over the decode points, the
matmul peak, the bandwidth and the KV capacity; a noisy point on a shared machine must not
fail the check, a slower machine must.
`dashboard push` uploads the Grafana dashboard (same uid, overwritten); a Grafana error
is one line on stderr and exit code 1.
Defaults come from `TokenflowConfig` (so `TOKENFLOW_CALIBRATION__*` env variables apply).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

from cluster.config import TokenflowConfig
from cluster.workers_cli import add_parser as add_workers_parser
from cluster.workers_cli import run_workers
from controller.budget import BudgetTable
from controller.calibration import QUICK_RUN
from workers.budget_file import load_budget_table, validate_budget


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenflow")
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure the token budget on this device")
    cal.add_argument("--model", help="checkpoint folder or builtin:<preset>")
    cal.add_argument("--out", type=Path, default=Path("budget.json"),
                     help="budget table to write (the PNG goes beside it)")
    cal.add_argument("--check", type=Path, help="re-measure this table; exit 1 on drift")
    cal.add_argument("--tolerance", type=float,
                     help="drift allowed by --check (default: calibration.check_tolerance)")
    cal.add_argument("--itl-slo-ms", type=float, help="SLO of the stored recommendation")
    cal.add_argument("--quick", action="store_true", help=(
        f"the short run the automatic calibration at start makes too: {QUICK_RUN}"))
    cal.add_argument("--warmup", type=int, help="runs discarded per point")
    cal.add_argument("--iters", type=int, help="runs averaged per point")
    cal.add_argument("--max-tokens", type=int, help="largest prefill chunk measured")
    cal.add_argument("--contexts", type=_ints, help="context depths, e.g. 0,1024,4096")
    cal.add_argument("--decode-batches", type=_ints, help="decode batch sizes, e.g. 1,8,32")
    cal.add_argument("--threads", type=int, help=(
        "torch CPU threads (default: a Ray worker actor's, floor(cluster.worker_num_cpus) >= 1)"))
    cal.add_argument("--matmul-size", type=int, help="GEMM edge of the peak-FLOPs probe")
    cal.add_argument("--bandwidth-bytes", type=int, help="buffer of the bandwidth probe")
    cal.add_argument("--no-plot", action="store_true", help="skip the PNG")
    cal.add_argument("--force", action="store_true", help="overwrite an existing --out")
    cal.add_argument("--no-size", action="store_true", help=(
        "measure the grid as given, however long (default: sized to "
        "calibration.max_duration_s after a pilot, the estimate printed first)"))
    # Listed for --help; `main` hands `tokenflow batch ...` to cluster.batch's own parser.
    sub.add_parser("batch", add_help=False, help=(
        "batch inference over an OpenAI Batch file (tokenflow batch --help for its options)"))
    dash = sub.add_parser("dashboard", help="the Grafana ops dashboard")
    dash_sub = dash.add_subparsers(dest="action", required=True)
    push = dash_sub.add_parser("push", help="upload dashboards/tokenflow.json (overwrite)")
    push.add_argument("--grafana-url", required=True, help="e.g. http://127.0.0.1:3000")
    push.add_argument("--token", help="Grafana service-account token (Bearer)")
    push.add_argument("--file", type=Path, help="dashboard JSON (default: the shipped one)")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_workers_parser(sub)
    return parser


def make_spec(args: argparse.Namespace, cfg: TokenflowConfig) -> Any:
    cal = cfg.calibration
    from workers.calibrate import CalibrationSpec  # torch only when measuring

    grid = cal.quick() if args.quick else cal
    overrides = {name: getattr(args, name) for name in (
        "warmup", "iters", "max_tokens", "contexts", "decode_batches", "matmul_size",
        "bandwidth_bytes")}
    grid = dataclasses.replace(grid, **{k: v for k, v in overrides.items() if v is not None})
    return CalibrationSpec.of(
        grid, model=args.model or cfg.worker.model, dtype=cfg.worker.dtype,
        device=cfg.worker.device, block_size=cfg.cache.block_size,
        tile_tokens=cal.tile_tokens,
        # Default: the threads a Ray worker actor runs with, where the table is used (Ray sets
        # OMP_NUM_THREADS to floor(num_cpus), at least 1; two threads on two busy cores make
        # every step wait for the slower one and the table noisy).
        threads=args.threads or max(int(cfg.cluster.worker_num_cpus), 1))


def measure(spec: Any, cfg: TokenflowConfig, itl_slo_ms: float | None, progress: bool,
            sized: bool = False) -> BudgetTable:
    """`spec` measured and fitted; `sized`: cut to calibration.max_duration_s first."""
    from workers.calibrate import Calibrator
    from workers.calibration_grid import GridSizing

    cal = cfg.calibration
    sizing = GridSizing(cal.max_duration_s, cal.min_iters, cal.min_chunk_sizes) \
        if sized else None
    measured = Calibrator(spec, progress=progress, sizing=sizing,
                          report=lambda line: print(line, flush=True)).run()
    return BudgetTable.fitted(measured, cal, itl_slo_ms)


def _symmetric(new: float, old: float) -> float:
    ratio = new / old if old > 0 else (1.0 if new == old else float("inf"))
    return max(ratio, 1.0 / ratio) - 1.0 if ratio > 0 else float("inf")


def drift_report(old: BudgetTable, new: BudgetTable) -> dict[str, float]:
    """Symmetric drift per measured quantity (0.1 = 10 % faster or slower). Step times by
    their medians: a stolen-time burst moves a mean, not a median."""
    report: dict[str, float] = {}
    for kind, key in (("prefill", ("tokens", "context")), ("decode", ("batch", "context"))):
        before = {tuple(p[k] for k in key): p["median_s"] for p in old.data[kind]}
        ratios = [p["median_s"] / before[tuple(p[k] for k in key)] for p in new.data[kind]
                  if tuple(p[k] for k in key) in before]
        report[f"{kind}_time"] = _symmetric(statistics.median(ratios), 1.0) if ratios \
            else float("inf")
    for section, key in (("hardware", "peak_flops"), ("hardware", "memory_bandwidth"),
                         ("kv", "capacity_tokens")):
        report[key] = _symmetric(new.data[section][key], old.data[section][key])
    return report


def allowed_drift(old: BudgetTable, new: BudgetTable, tolerance: float,
                  noise_factor: float) -> dict[str, float]:
    """Per quantity: `tolerance` plus `noise_factor` times the larger spread either run
    measured for it (a table without its noise gets the tolerance alone). KV capacity is
    computed, not timed: no allowance."""
    noises = [t.data.get("noise") or {} for t in (old, new)]
    allowed = {}
    for name in ("prefill_time", "decode_time", "peak_flops", "memory_bandwidth",
                 "capacity_tokens"):
        spread = max(n.get(name, 0.0) for n in noises)
        allowed[name] = tolerance + noise_factor * spread
    return allowed


def run_check(args: argparse.Namespace, cfg: TokenflowConfig) -> int:
    from workers.calibrate import CalibrationSpec

    old = load_budget_table(args.check)
    spec_fields = dict(old.data["spec"])
    for name in ("warmup", "iters", "threads"):
        if getattr(args, name) is not None:
            spec_fields[name] = getattr(args, name)
    spec = CalibrationSpec(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in spec_fields.items()})
    new = measure(spec, cfg, old.data["recommendation"]["itl_slo_ms"], not args.no_progress)
    tolerance = args.tolerance if args.tolerance is not None else cfg.calibration.check_tolerance
    report = drift_report(old, new)
    allowed = allowed_drift(old, new, tolerance, cfg.calibration.check_noise_factor)
    for name, drift in report.items():
        verdict = "DRIFT" if drift > allowed[name] else "ok"
        print(f"{name:18s} {drift * 100:8.1f} %  allowed {allowed[name] * 100:5.1f} %  "
              f"{verdict}")
    drifted = [n for n, d in report.items() if d > allowed[n]]
    print(f"tolerance {tolerance * 100:.1f} % + noise x {cfg.calibration.check_noise_factor:g}"
          f": " + (f"drifted: {', '.join(drifted)}" if drifted else "no drift"))
    return 1 if drifted else 0


def run_calibrate(args: argparse.Namespace, cfg: TokenflowConfig) -> int:
    if args.out.exists() and not args.force:
        print(f"tokenflow calibrate: {args.out} exists; pass --force to overwrite it, or "
              f"--out another path", file=sys.stderr)
        return 2
    slo = args.itl_slo_ms if args.itl_slo_ms is not None else cfg.slo.itl_ms
    table = measure(make_spec(args, cfg), cfg, slo, not args.no_progress,
                    sized=not args.quick and not args.no_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    validate_budget(table.data)  # what a later load accepts
    table.save(args.out)
    rec, fit = table.data["recommendation"], table.data["fit"]["prefill"]
    slo = rec["itl_slo_ms"]  # the derived one when none was configured
    print(f"wrote {args.out}: fit a={fit['a']:.3g}s b={fit['b']:.3g}s/token "
          f"c={fit['c']:.3g}s/pair, median error {fit['median_rel_error'] * 100:.1f} %")
    for row in table.data["table"]:
        print(f"  tokens {row['tokens_min']:>6}-{row['tokens_max']:<6} {row['binding']}")
    print(f"ITL SLO {slo:g} ms ({rec.get('slo_source', 'configured')}) -> "
          f"max_num_batched_tokens {rec['max_num_batched_tokens']}, "
          f"chunk {rec['chunk_size']} (limited by {rec['limited_by']})")
    if not args.no_plot:
        from cluster.budget_plot import plot_table

        png = plot_table(table, args.out.with_suffix(".png"), itl_slo_ms=slo)
        print(f"wrote {png}" if png else "matplotlib missing: no plot")
    return 0


def run_dashboard_push(args: argparse.Namespace) -> int:
    from cluster.dashboard import DASHBOARD_PATH, DashboardPushError, push_dashboard

    try:
        answer = push_dashboard(args.grafana_url, args.token, args.file or DASHBOARD_PATH)
    except DashboardPushError as err:
        print(f"tokenflow dashboard push: {err}", file=sys.stderr)
        return 1
    print(f"pushed dashboard {answer.get('uid')} version {answer.get('version')}: "
          f"{answer.get('url', '')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["batch"]:  # its own parser: the same options as `python -m cluster.batch`
        from cluster.batch import main as batch_main

        return batch_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "dashboard":
        return run_dashboard_push(args)
    cfg = TokenflowConfig()
    if args.command == "workers":
        return run_workers(args, cfg)
    if args.check is not None:
        return run_check(args, cfg)
    return run_calibrate(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
