"""The device check's CPU dry run: `benchmarks/gpu_check.sh` with `--quick --device cpu`, as
the GPU machine would run it: every Python it starts (the benchmark, then pytest on the CUDA
tests, which skip here) refuses to import Ray or pydantic (that machine has neither)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.decode_stack import PROFILER_NAME as DECODE_STACK
from workers.kernels.cpu_ops import cpu_ops

ROOT = Path(__file__).resolve().parent.parent
# The project's dependencies that the H200 image lacks (its package list:
# benchmarks/README.md): the bench and the CUDA tests must import none of them.
BLOCKED = ("ray", "pydantic", "pydantic_settings", "pydantic_core", "redis", "fastapi",
           "starlette", "uvicorn", "grafana_client", "xgrammar", "openai")

# A sitecustomize on PYTHONPATH: every interpreter the script starts installs a meta-path
# finder that refuses the blocked packages. A refused import is recorded in a file, so an
# import swallowed by a try/except still shows.
SITECUSTOMIZE = textwrap.dedent("""
    import importlib.abc, sys
    blocked, log = {blocked!r}, {log!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in blocked:
                with open(log, "a") as f:
                    f.write(name + "\\n")
                raise ModuleNotFoundError(f"{{name}} is blocked", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
""")


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    tmp = tmp_path_factory.mktemp("gpu_bench")
    log, site = tmp / "blocked.txt", tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=BLOCKED, log=str(log)))
    env = {**os.environ, "OUT": str(tmp / "out"), "PYTHON": sys.executable,
           "PYTHONPATH": f"{site}:{ROOT}",
           "GPU_BENCH_ARGS": f"--quick --device cpu --work-dir {tmp / 'work'}"}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    check_log = (tmp / "out" / "gpu_check.log").read_text()
    assert "no nvidia-smi: a dry run" in check_log and "wrote " in check_log
    assert " passed" in check_log  # the CUDA tests' CPU part ran under the same blocker
    attempts = log.read_text() if log.exists() else ""
    out = tmp / "out" / "gpu.json"
    return json.loads(out.read_text()), out, attempts


PHASES = ["checkpoint", "worker", "kernel_check", "smoke_decode", "kernel_count", "parity",
          "reference", "bandwidth", "decode", "mixed", "prefill", "offline", "scene",
          "profiles", "targets"]


def test_quick_mode_runs_without_ray_or_pydantic(quick_report):
    report, out, attempts = quick_report
    assert report["benchmark"] == "gpu" and report["quick"] is True
    assert report["device"] == "cpu"
    # Nothing on the bench's path even tried them (a swallowed ImportError would hide here).
    assert attempts == "", f"blocked imports attempted: {attempts.split()}"
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_dry_run_runs_every_phase_and_records_how_it_ran(quick_report):
    report, _, _ = quick_report
    assert list(report["phases"]) == PHASES
    assert all(e["status"] == "ok" and e["wall_s"] >= 0 for e in report["phases"].values()), \
        report["phases"]
    assert report["errors"] == []
    versions = report["versions"]
    assert versions["torch"] and versions["transformers"] and "triton" in versions
    # CPU: the C++ decode kernel where it builds (else the torch path), eager, no start-up work.
    execution = report["execution"]
    backend = "cpu" if cpu_ops() is not None else "torch"
    assert execution == {"attention_backend": backend, "fused_layers": False,
                         "cuda_graphs": False, "graph_buckets": [], "startup_s": 0.0}
    assert report["reference"]["generate_compiled"] is False
    assert report["decode"]["transformers_generate_ms"]["compiled"] is False
    assert report["decode"]["graphs_used"] is False and report["decode"]["graph_replays"] == 0
    smoke = report["smoke_decode"]
    assert smoke["timed_steps"] == report["config"]["smoke_steps"] and smoke["step_ms"] > 0
    check = report["kernel_check"]
    assert check["all_ok"] and len(check["attention"]) == 2
    count = report["kernel_count"]
    assert count["fused"]["per_layer"] <= 12 < count["unfused"]["per_layer"]
    assert report["targets"]["kernels_per_decode_layer"]["met"]


def test_quick_report_values_are_sane(quick_report):
    report, _, _ = quick_report
    cfg = report["config"]
    prefill = report["prefill"]
    assert prefill["prompt_tokens"] == cfg["prefill_tokens"]
    assert prefill["tokenflow_ms"] > 0 and prefill["transformers_ms"] > 0
    decode = report["decode"]
    assert decode["batch"] == cfg["decode_batch"] and decode["timed_steps"] == cfg["decode_steps"]
    # Medians of different samples: both positive, not ordered.
    assert decode["step_ms"] > 0 and decode["execute_ms"] > 0
    assert decode["async_scheduling"]
    assert decode["serial_step_ms"] > 0 and decode["serial_execute_ms"] > 0
    bound = decode["read_bound"]
    assert bound["weight_bytes"] > 0 and bound["kv_bytes"] > 0 and bound["bound_ms"] > 0
    assert decode["vs_read_bound"] == pytest.approx(decode["step_ms"] / bound["bound_ms"])
    for cache in ("dynamic_cache", "static_cache"):
        assert _finite(decode["transformers_generate_ms"][cache])
    mixed = report["mixed"]
    assert mixed["timed_steps"] >= 1
    assert all(d >= cfg["mixed_depth"] for d in mixed["chunk_depths"])
    offline = report["offline"]
    assert offline["requests"] == cfg["offline_requests"]
    assert offline["tokenflow_output_tokens_per_s"] > 0
    assert offline["serial_tokenflow_output_tokens_per_s"] > 0
    assert offline["transformers_output_tokens_per_s"] > 0
    assert report["copy_bandwidth_bytes_s"] > 0


def test_quick_report_scene_and_parity(quick_report):
    report, _, _ = quick_report
    scene = report["scene"]
    for policy in ("tokenflow", "prefill-first"):
        entry = scene[policy]
        assert entry["details"]["aborted"] == 0
        assert entry["users_p99_gap_ms"] >= entry["users_median_gap_ms"] > 0
        assert entry["long_ttft_s"] > 0
    assert scene["p99_gap_ratio"] == pytest.approx(
        scene["tokenflow"]["users_p99_gap_ms"] / scene["prefill-first"]["users_p99_gap_ms"])
    parity = report["parity"]
    assert parity["num_sequences"] == report["config"]["parity_prompts"]
    assert parity["all_equal"], parity["first_mismatch"]  # fp32 greedy: token for token


def test_quick_report_host_share_and_profiles(quick_report):
    report, _, _ = quick_report
    for kind in ("decode", "decode_serial", "mixed"):
        share = report["host_share"][kind]
        if kind == "decode":  # async: the device may hide all of it (a median of 0)
            assert 0 <= share["controller_share"] < 1 and share["controller_ms"] >= 0
            assert share["execute_ms"] > 0 and share["step_ms"] > 0
            continue
        assert 0 < share["controller_share"] < 1
        assert 0 < share["controller_ms"] < share["step_ms"]
        assert 0 < share["execute_ms"] < share["step_ms"]
    for kind in ("prefill", "decode", "mixed"):
        profile = report["profiles"][kind]
        assert profile["num_op_calls"] > 0 and profile["top_host_ops"]
        # The GEMMs are named: torch's, or (a CPU fp32 decode step) the decode stack's
        # one C++ call around them.
        assert any(op["op"] in ("aten::mm", DECODE_STACK) or "linear" in op["op"]
                   for op in profile["top_host_ops"])
    targets = report["targets"]
    assert targets["fp32_greedy_equal"]["met"]
    assert all(set(t) == {"value", "comparison", "target", "met"} for t in targets.values())


# ---- fail-soft phases -------------------------------------------------------------------------
def test_a_failing_phase_is_recorded_and_the_rest_still_run(tmp_path):
    from benchmarks.gpu_bench import PhaseLog

    out = tmp_path / "gpu.json"
    log = PhaseLog(out, {"benchmark": "gpu"}, budget_s=None)
    assert json.loads(out.read_text())["phases"] == {}  # written before any phase

    def broken():
        raise RuntimeError("kernel exploded")

    def second():
        # The file already holds the failed phase while this one runs.
        assert json.loads(out.read_text())["phases"]["first"]["status"] == "error"
        return {"value": 2}

    assert log.run("first", broken) is None
    assert log.run("second", second) == {"value": 2}
    log.run("third", lambda: {"value": 3}, needs=("first",))
    written = json.loads(out.read_text())
    first = written["phases"]["first"]
    assert first["error"] == "RuntimeError: kernel exploded"
    assert any("broken" in line for line in first["traceback"])
    assert written["second"] == {"value": 2} and written["phases"]["second"]["status"] == "ok"
    assert written["phases"]["third"] == {"status": "skipped", "reason": "needs first"}
    assert "third" not in written and log.errors == ["first"]


def test_phases_past_the_budget_are_skipped(tmp_path):
    from benchmarks.gpu_bench import PhaseLog

    log = PhaseLog(tmp_path / "gpu.json", {}, budget_s=0.0)
    ran = []
    log.run("late", lambda: ran.append(1))
    assert ran == [] and log.report["phases"]["late"]["status"] == "skipped"
    assert "budget" in log.report["phases"]["late"]["reason"]


def test_sigterm_mid_run_leaves_every_finished_phase(tmp_path):
    """What `timeout` does to the device check: the phases that ended are in gpu.json, the
    one running is marked with the signal, the exit code is timeout's."""
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--device", "cpu", "--out", str(out), "--work-dir",
            str(tmp_path / "work"), "--no-png"]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_bench", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the progress lines: signal once parity has started
            if line.startswith("[gpu-bench] parity"):
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 124, rest[-2000:]
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert list(phases) == PHASES[: PHASES.index("parity") + 1]
    assert all(phases[name]["status"] == "ok" for name in PHASES[: PHASES.index("parity")])
    assert phases["parity"]["status"] == "error" and "SIGTERM" in phases["parity"]["error"]
    assert report["smoke_decode"]["step_ms"] > 0  # a finished phase's figures survive


def test_a_signal_that_code_swallows_or_replaces_still_interrupts_the_phase(tmp_path):
    """The handler's exception lands in whatever code runs; where that code raises its own
    error instead (torch once turned it into a ValueError) or swallows it, the phase is
    still marked with the signal and the run stops there."""
    from benchmarks.gpu_bench import BenchInterrupted, PhaseLog, _interrupt

    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        log = PhaseLog(tmp_path / "gpu.json", {}, budget_s=None)

        def replaced():
            try:
                os.kill(os.getpid(), signal.SIGUSR1)  # handled before kill returns
            except BenchInterrupted:
                raise ValueError("could not determine the shape") from None

        def swallowed():
            with contextlib.suppress(BenchInterrupted):
                os.kill(os.getpid(), signal.SIGUSR1)
            return {"value": 1}

        for name, fn in (("replaced", replaced), ("swallowed", swallowed)):
            with pytest.raises(BenchInterrupted):
                log.run(name, fn)
            entry = json.loads((tmp_path / "gpu.json").read_text())["phases"][name]
            assert entry["status"] == "error" and "SIGUSR1 received" in entry["error"]
        assert "swallowed" not in log.report  # its result is not a finished phase's
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_jit_log_records_each_compile_by_phase_as_triton_calls_its_hooks(quick_report):
    """The hooks take Triton's keyword arguments (as its JIT calls them) and let the compile
    go on; a compile in a timed phase counts as a serving compile. The CPU dry run compiles
    nothing, so its report says so."""
    from types import SimpleNamespace

    from benchmarks.jit_log import JitLog

    report, _, _ = quick_report
    assert report["triton_compiles"]["num_serving_compiles"] == 0
    assert report["targets"]["serving_compiles"]["value"] in (0, None)
    log = JitLog()
    for phase in ("worker", "scene"):
        log.phase = phase
        kwargs = {"key": (phase, 16), "repr": f"_kernel[num_warps=4]({phase})",
                  "fn": SimpleNamespace(name="_kernel"), "compile": {},
                  "is_manual_warmup": False, "already_compiled": False}
        assert log._before(**kwargs) is False and log._after(**kwargs) is False
    got = log.report()
    assert got["by_phase"] == {"worker": 1, "scene": 1} and got["num_serving_compiles"] == 1
    assert got["serving_compiles"][0]["kernel"] == "_kernel"
    assert got["serving_compiles"][0]["compile_s"] >= 0


def test_gpu_tune_dry_run_times_every_config_and_ranks_only_correct_ones(tmp_path):
    """benchmarks/gpu_tune.py (the attention launch-size sweep for a GPU call) under the Triton
    interpreter, with the same import blocker as the device check."""
    log, site = tmp_path / "blocked.txt", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=BLOCKED, log=str(log)))
    out = tmp_path / "gpu_tune.json"
    code = ("from tests.workers.attention_cases import fix_interpreter_scalars; "
            "fix_interpreter_scalars(); from benchmarks.gpu_tune import main; "
            f"main(['--quick', '--device', 'cpu', '--reps', '2', '--out', {str(out)!r}])")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{site}:{ROOT}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not log.exists(), log.read_text()
    report = json.loads(out.read_text())
    assert set(report["shapes"]) == {"chunk", "decode"}
    for shape in report["shapes"].values():
        assert len(shape["configs"]) == 2
        for row in shape["configs"]:
            assert row["correct"] and row["max_abs_diff"] <= 1e-4 and _finite(row["ms"])
        assert shape["best"] in shape["configs"] and _finite(shape["default_ms"])
        assert shape["speedup_vs_default"] >= 1.0
