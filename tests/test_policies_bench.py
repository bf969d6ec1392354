"""The policies benchmark runs end to end in --quick mode and writes a well-formed report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.run import run_benchmarks
from controller.policies import POLICIES

TARGETS = {"p99_itl_during_long_prefill_vs_slo", "p99_itl_during_long_prefill_vs_prefill_first",
           "long_ttft_vs_prefill_first", "total_tokens_per_s_vs_prefill_first",
           "capacity_vs_prefill_first", "offline_tokens_per_s_vs_transformers",
           "p99_itl_whole_scene_vs_slo", "short_ttft_vs_two_slo_steps"}
TARGET_KEYS = {"what", "value", "ratio", "target", "comparison", "met", "missed_by", "why"}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 \
        and math.isfinite(value)


def _check_latency(stats: dict[str, Any]) -> None:
    assert stats["n"] >= 1
    for key in ("median_ms", "p99_ms", "max_ms", "mean_ms"):
        assert _positive(stats[key]), (key, stats)
    assert stats["median_ms"] <= stats["p99_ms"] <= stats["max_ms"]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out_dir = tmp_path_factory.mktemp("policies")
    threads = torch.get_num_threads()
    try:  # the benchmark sets the process-wide thread count; give it back to other tests
        run_benchmarks(["policies"], quick=True, out_dir=out_dir)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out_dir / "policies.json").read_text(encoding="utf-8")), out_dir


def test_quick_report_files(quick_report: tuple[dict[str, Any], Path]) -> None:
    report, out_dir = quick_report
    assert report["benchmark"] == "policies" and report["quick"] is True
    assert (out_dir / "policies.png").stat().st_size > 1000
    assert json.loads((out_dir / "policies_budget.json").read_text())["recommendation"]
    assert {"config", "itl_slo", "budgets", "scene", "capacity", "offline", "analysis",
            "profiles", "targets", "all_met", "wall"} <= report.keys()
    assert _positive(report["itl_slo"]["itl_slo_ms"])
    assert _positive(report["itl_slo"]["decode_step_ms"])
    assert _positive(report["budgets"]["tokenflow"]["max_num_batched_tokens"])


def test_quick_scene_schema(quick_report: tuple[dict[str, Any], Path]) -> None:
    scene = quick_report[0]["scene"]
    assert set(scene) == set(POLICIES)
    for res in scene.values():
        assert _positive(res["long_ttft_s"]) and res["aborted"] == 0
        assert _positive(res["short_ttft_s"])
        _check_latency(res["itl_during_long_prefill"])
        _check_latency(res["itl_whole_scene"])
        _check_latency(res["itl_while_long_decodes"])
        for key in ("total_tokens_per_s", "output_tokens_per_s", "duration_s"):
            assert _positive(res["throughput"][key]), key
        assert res["window_steps"]["chunks_of_long_prompt"] >= 1
    # prefill-first prefills the long prompt in one step that carries no decode
    assert scene["prefill-first"]["window_steps"]["chunks_of_long_prompt"] == 1
    assert scene["tokenflow"]["window_steps"]["mixed_steps"] >= 1


def test_quick_capacity_and_offline_schema(quick_report: tuple[dict[str, Any], Path]) -> None:
    report = quick_report[0]
    cap = report["capacity"]
    assert _positive(cap["ttft_bound_s"]) and set(cap["policies"]) == set(POLICIES)
    for res in cap["policies"].values():
        assert res["trials"] and all(_positive(t["rate_req_s"]) for t in res["trials"])
        found = res["capacity_req_s"]
        assert found is None or _positive(found)
        for trial in res["trials"]:
            assert isinstance(trial["passed"], bool) and _positive(trial["p99_ttft_s"])
            assert trial["num_requests"] == cap["num_requests"]  # what the P99 rests on
            assert trial["num_itl_samples"] > trial["num_requests"]
    for side in ("transformers", "tokenflow", "tokenflow_slo_budget"):
        assert _positive(report["offline"][side]["output_tokens_per_s"]), side


def test_quick_targets(quick_report: tuple[dict[str, Any], Path]) -> None:
    report = quick_report[0]
    targets = report["targets"]
    assert set(targets) == TARGETS
    for name, entry in targets.items():
        assert entry.keys() >= TARGET_KEYS, name
        assert isinstance(entry["met"], bool) and _positive(entry["target"])
        assert entry["ratio"] == entry["value"] and _positive(entry["ratio"]), name
        if entry["met"]:
            assert entry["missed_by"] is None and entry["why"] is None
        else:  # a miss says by how much and why
            assert _positive(entry["missed_by"]) and entry["why"], name
    assert report["all_met"] == all(t["met"] for t in targets.values())
    for profile in report["profiles"].values():
        assert _positive(profile["wall_ms"]) and profile["top_ops"]
