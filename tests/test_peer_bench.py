"""The peer benchmark's own logic, without vLLM: the tokenflow side of its offline driver
runs for real on builtin:tiny (the same process protocol vLLM's side uses), its step
breakdown is well formed, and the Must-show verdicts follow the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.peer_bench import OFFLINE, ROOT, _agreement, targets
from benchmarks.peer_scene import _q, summarize


def test_offline_driver_runs_tokenflow_rounds_and_profile(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENFLOW_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, OFFLINE, "--engine", "tokenflow", "--model", "builtin:tiny"],
        input="run\nprofile\nquit\n", capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=600, check=True)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ready, round_, profile = events
    assert ready["event"] == "ready" and ready["startup_s"] > 0
    assert ready["max_num_batched_tokens"] > 16  # the derived SLO leaves room for prefill
    assert round_["output_tokens"] == 32 * 64 and round_["tok_s"] > 0
    assert len(round_["first_output"]) == 64
    steps = profile["steps"]
    assert steps["chunk_tokens"]["max"] <= ready["max_num_batched_tokens"]
    assert sum(v["num_steps"] for k, v in steps.items() if k != "chunk_tokens") > 0
    for part in ("ops_prefill_steps", "ops_decode_steps"):
        shares = profile[part]["share"]
        assert "gemm" in shares and 0 < sum(shares.values()) <= 1.0 + 1e-6


def test_agreement_counts_the_leading_equal_tokens() -> None:
    assert _agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert _agreement([], [1]) == 0


def test_summaries_skip_missing_values() -> None:
    rounds = [{"x": 3.0}, {"x": None}, {"x": 1.0}, {"x": 2.0}]
    assert summarize(rounds, "x") == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert _q([1.0, 2.0, 3.0, 4.0, 100.0], 0.99) == 100.0 and _q([], 0.5) is None


def test_targets_follow_the_numbers() -> None:
    report = {
        "offline": [{"model": "builtin:bench", "ratio_vs_vllm_compiled": 1.31,
                     "startup_ratio_vs_vllm_compiled": 0.3}],
        "served": {"ratios": {"window_gap_p99_vs_vllm": 0.05, "long_ttft_vs_vllm": 1.5,
                              "short_ttft_vs_vllm": 0.1, "short_ttft_in_tokenflow_steps": 1.5,
                              "users_tok_s_vs_vllm": 0.9, "ready_vs_vllm": None}}}
    t = targets(report)
    assert t["offline_bench_vs_vllm_compiled>=1.3"]["met"]
    assert not t["offline_bench_startup_ratio_vs_vllm_compiled<=0.25"]["met"]
    assert t["served_window_gap_p99_vs_vllm<=0.3"]["met"]
    assert not t["served_long_ttft_vs_vllm<=1.2"]["met"]
    assert not t["served_users_tok_s_vs_vllm>=1.0"]["met"]
    assert not t["served_ready_vs_vllm<=0.25"]["met"]  # unknown is not met
