"""Run the registered benchmarks and write their reports.

    python -m benchmarks.run [--quick] [--only engine,...] [--out-dir DIR]

Every benchmark is one entry of `BENCHMARKS`: a name and a callable `(quick, out_dir) -> dict`.
The callable does its measuring, may write figures (`<name>.png`) into `out_dir`, and returns
its JSON-serialisable report, which this runner writes to `out_dir/<name>.json` (through a
temporary file, so a crashed run never leaves half a report). To add one, import its callable
here and add a line to `BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import (
    calibration_bench,
    chaos_bench,
    cluster_bench,
    engine_bench,
    journal_bench,
    metrics_bench,
    policies_bench,
    structured_bench,
)

BenchmarkFn = Callable[[bool, Path], dict[str, Any]]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

BENCHMARKS: dict[str, BenchmarkFn] = {
    "engine": engine_bench.run,
    "calibration": calibration_bench.run,
    "cluster": cluster_bench.run,
    "policies": policies_bench.run,
    "metrics": metrics_bench.run,
    "journal": journal_bench.run,
    "chaos": chaos_bench.run,
    "structured": structured_bench.run,
}


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_benchmarks(names: list[str], quick: bool, out_dir: Path) -> dict[str, dict[str, Any]]:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    reports: dict[str, dict[str, Any]] = {}
    for name in names:
        started = time.perf_counter()
        print(f"[bench] {name}{' (quick)' if quick else ''} ...", flush=True)
        report = BENCHMARKS[name](quick, out_dir)
        report.setdefault("quick", quick)
        write_report(report, out_dir / f"{name}.json")
        reports[name] = report
        print(f"[bench] {name}: {time.perf_counter() - started:.1f} s -> "
              f"{out_dir / (name + '.json')}", flush=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few repetitions: a smoke run of a few seconds")
    parser.add_argument("--only", default="",
                        help="comma-separated benchmark names (default: all registered)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                        help="where <name>.json and <name>.png go")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    run_benchmarks(names, args.quick, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
