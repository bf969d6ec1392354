"""The engine benchmark runs end to end in --quick mode and writes a well-formed report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.run import run_benchmarks

TARGET_KEYS = {"value", "target", "comparison", "met", "missed_by", "why"}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 \
        and math.isfinite(value)


def _check_side(side: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        assert _positive(side[key]), (key, side[key])
    stats = side["seconds"]
    assert {"mean", "median", "min", "stdev", "n"} <= stats.keys()
    assert _positive(stats["mean"]) and _positive(stats["min"]) and stats["n"] >= 1


@pytest.fixture
def quick_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], Path]:
    monkeypatch.setenv("TOKENFLOW_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:  # the benchmark sets the process-wide thread count; give it back to other tests
        run_benchmarks(["engine"], quick=True, out_dir=tmp_path / "results")
    finally:
        torch.set_num_threads(threads)
    path = tmp_path / "results" / "engine.json"
    return json.loads(path.read_text(encoding="utf-8")), path.parent


def test_quick_engine_report_schema(quick_report: tuple[dict[str, Any], Path]) -> None:
    report, out_dir = quick_report
    assert (out_dir / "engine.png").stat().st_size > 1000
    assert report["benchmark"] == "engine" and report["quick"] is True
    assert {"config", "machine", "model", "prefill", "decode", "targets", "all_met",
            "profiles", "wall_s"} <= report.keys()
    assert report["machine"]["threads"] >= 1 and _positive(report["model"]["params"])

    assert len(report["prefill"]) == 2
    for res in report["prefill"].values():
        for key in ("tokens", "model_flops", "linear_flops", "matmul_peak_flops",
                    "throughput_ratio"):
            assert _positive(res[key]), key
        for side in ("ours", "transformers"):
            _check_side(res[side], ("tokens_per_s", "flops_per_s", "peak_fraction"))
        assert _positive(res["per_round_time_ratio"]["median"])

    dec = report["decode"]
    for key in ("batch", "context", "memory_bandwidth_bytes_per_s", "weight_bytes",
                "kv_read_bytes", "weight_read_bound_s", "step_time_ratio"):
        assert _positive(dec[key]), key
    for side in ("ours", "transformers"):
        _check_side(dec[side], ("step_ms", "vs_weight_read_bound"))

    targets = report["targets"]
    assert len(targets) == 2 * len(report["prefill"]) + 1
    for name, target in targets.items():
        assert target.keys() >= TARGET_KEYS, name
        assert _positive(target["value"]) and _positive(target["target"])
        if target["met"]:
            assert target["missed_by"] is None and target["why"] is None
        else:  # a miss says by how much and why, with the profile it came from
            assert _positive(target["missed_by"]) and target["why"], name
    assert report["all_met"] == all(t["met"] for t in targets.values())
    for profile in report["profiles"].values():
        for side in ("ours", "transformers"):
            assert _positive(profile[side]["wall_ms"]) and profile[side]["top_ops"]
