"""Batch inference throughput: `ray job submit` vs `LocalEngine` vs transformers static batching.

    python -m benchmarks.batch_bench [--num-requests 2000] [--out benchmarks/results/batch.json]

The same greedy requests (short prompts, `max_tokens` spread from 8 to 128, median 32, EOS
ignored) on `--model` (default builtin:small, ~7M parameters: big enough that a step's time
is mostly the model's, not Python's; on builtin:tiny both engines time their own overhead)
run as:
- `local`: `python -m cluster.batch --local` (LocalEngine in one process);
- `job_jsonl`, `job_parquet`, `job_ray_data`: `ray job submit` of `python -m cluster.batch` on
  a Ray head this script starts (loopback, free ports) and stops by pid; the job starts its
  own controller with one worker, as in the README recipe;
- `job_one_worker_thread` against `local_one_thread`: the same JSONL job and LocalEngine
  with one torch thread each (`worker.num_threads=1`): on a 2-core machine the job's driver
  and controller otherwise share the worker's second core, so this pair isolates what the
  Ray path itself costs;
- `transformers_static`: `LlamaForCausalLM.generate` over static batches (left-padded), each
  to its longest request; tokens past a request's `max_tokens` do not count. It runs the
  first `--hf-requests` requests only (default 256: 8 batches; the whole input would take
  it ~10 minutes): static batches are independent, so its tokens/s is the same rate.
Tokens/s are requested tokens over each run's wall time as the job's summary reports it
(model load and controller start included: what a user waits for), and after start-up
(`*_after_startup`: what a longer job tends to). The driver's peak RSS comes from each
summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")
RAY = str(ROOT / ".venv" / "bin" / "ray")
# Output lengths spread as in real batch jobs (a seeded lognormal, median 32, 8 to 128):
# static batches run to their longest request, continuous batching refills the slot.
MIN_TOKENS, MAX_TOKENS, MEDIAN_TOKENS = 8, 128, 32
HF_BATCH = 32
# The Ray path alone: the job's worker and LocalEngine each on one torch thread, so that on
# two cores the job's driver and controller do not take the worker's second core.
ONE_THREAD = {"TOKENFLOW_WORKER__NUM_THREADS": "1"}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prompts(num: int) -> list[str]:
    return [f"request {i}: a short note about the number {i * 13 % 997}" for i in range(num)]


def output_lens(num: int) -> list[int]:
    rng = random.Random(7)
    return [min(MAX_TOKENS, max(MIN_TOKENS, round(rng.lognormvariate(
        math.log(MEDIAN_TOKENS), 0.8)))) for _ in range(num)]


def write_inputs(folder: Path, texts: list[str], model: str) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lens = output_lens(len(texts))
    jsonl = folder / "requests.jsonl"
    with jsonl.open("w") as f:
        for i, text in enumerate(texts):
            body = {"model": model, "prompt": text, "max_tokens": lens[i],
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": str(i), "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")
    parquet = folder / "requests.parquet"
    pq.write_table(pa.table({"custom_id": [str(i) for i in range(len(texts))],
                             "prompt": texts, "max_tokens": lens,
                             "temperature": [0.0] * len(texts),
                             "ignore_eos": [True] * len(texts)}), parquet)
    return jsonl, parquet


def summary_at(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def run_local(jsonl: Path, folder: Path, model: str, name: str = "local",
              env: dict[str, str] | None = None) -> dict[str, Any]:
    out = str(folder / f"{name}.jsonl")
    subprocess.run([PY, "-m", "cluster.batch", "-i", str(jsonl), "-o", out, "--local",
                    "--model", model, "--no-progress"], cwd=ROOT, check=True,
                   capture_output=True, timeout=1800, env=dict(os.environ, **(env or {})))
    return summary_at(out + ".summary.json")


# The last characters of a failed submission's output kept in its error.
JOB_OUTPUT_TAIL = 4000


class JobFailed(RuntimeError):
    """A `ray job submit` that did not succeed; its message ends with the CLI's output."""


class Head:
    """A Ray head of our own (`ray start --block`), stopped by pid."""

    def __init__(self) -> None:
        self.env = dict(os.environ, RAY_AUTH_MODE="token")
        self.env.pop("RAY_ADDRESS", None)
        # As the README's recipe: a fresh machine has no ~/.ray/auth_token yet (an existing
        # one is kept), and `ray start` with token auth refuses to run without one.
        subprocess.run([RAY, "get-auth-token", "--generate"], cwd=ROOT, env=self.env,
                       check=True, capture_output=True, timeout=120)
        self.dashboard = free_port()
        self.proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(free_port()), "--dashboard-port", str(self.dashboard),
             "--ray-client-server-port", str(free_port()),
             "--dashboard-agent-listen-port", str(free_port()), "--num-cpus", "4",
             "--disable-usage-stats"], cwd=ROOT, env=self.env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(240):  # bounded poll of the job server coming up
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.dashboard}/api/version",
                                       timeout=5).close()
                return
            except urllib.error.HTTPError:
                return  # 401 without the token: up
            except OSError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.5)
        raise TimeoutError("Ray head did not come up")

    def submit(self, model: str, *args: str, env: dict[str, str] | None = None) -> None:
        """Runs `python -m cluster.batch ARGS` as a job; JobFailed (with the CLI's output)
        when the job or its submission fails."""
        runtime_env = json.dumps({"py_executable": PY, "env_vars": env or {}})
        done = subprocess.run([RAY, "job", "submit", "--address",
                               f"http://127.0.0.1:{self.dashboard}", "--working-dir", ".",
                               "--runtime-env-json", runtime_env, "--", PY, "-m",
                               "cluster.batch", *args, "--model", model], cwd=ROOT,
                              env=self.env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise JobFailed(f"ray job submit exited {done.returncode}:\n"
                            f"{(done.stdout + done.stderr)[-JOB_OUTPUT_TAIL:]}")

    def stop(self) -> None:
        import psutil

        tree = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        _, alive = psutil.wait_procs(tree, timeout=15)
        for proc in alive:
            proc.kill()


def run_transformers(texts: list[str], model: str) -> dict[str, Any]:
    """Static batches of HF_BATCH in input order (output lengths are not known ahead in
    general), each generated to its longest request; only requested tokens count."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from workers.presets import resolve_model

    path = resolve_model(model)
    lens = output_lens(len(texts))
    started = time.perf_counter()
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    startup_s = time.perf_counter() - started
    num_tokens = num_generated = 0
    for start in range(0, len(texts), HF_BATCH):
        ids = [tokenizer.encode(t).ids for t in texts[start:start + HF_BATCH]]
        wanted = lens[start:start + HF_BATCH]
        width = max(map(len, ids))
        pad = [[0] * (width - len(x)) + x for x in ids]  # left padding
        mask = [[0] * (width - len(x)) + [1] * len(x) for x in ids]
        with torch.inference_mode():
            out = hf.generate(torch.tensor(pad), attention_mask=torch.tensor(mask),
                                 do_sample=False, max_new_tokens=max(wanted),
                                 min_new_tokens=max(wanted), pad_token_id=0)
        assert out.shape[1] - width == max(wanted)
        num_tokens += sum(wanted)
        num_generated += max(wanted) * len(ids)
    elapsed = time.perf_counter() - started
    return {"num_requests": len(texts), "completion_tokens": num_tokens,
            "generated_incl_batch_tail": num_generated,
            "elapsed_s": round(elapsed, 3), "tokens_per_s": round(num_tokens / elapsed, 1),
            "startup_s": round(startup_s, 3),
            "tokens_per_s_after_startup": round(num_tokens / (elapsed - startup_s), 1),
            "batch_size": HF_BATCH}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--hf-requests", type=int, default=256,
                    help="requests transformers runs (a prefix of the input)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/batch.json")
    args = ap.parse_args(argv)
    texts = prompts(args.num_requests)
    report: dict[str, Any] = {
        "benchmark": "batch", "num_requests": args.num_requests,
        "max_tokens": {"min": MIN_TOKENS, "median": MEDIAN_TOKENS, "max": MAX_TOKENS,
                       "total": sum(output_lens(args.num_requests))},
        "model": args.model,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        jsonl, parquet = write_inputs(folder, texts, args.model)
        report["local"] = run_local(jsonl, folder, args.model)
        print("local", report["local"], file=sys.stderr)
        head = Head()
        try:
            head.submit(args.model, "-i", str(jsonl), "-o", str(folder / "job.jsonl"),
                        "--no-progress")
            report["job_jsonl"] = summary_at(str(folder / "job.jsonl.summary.json"))
            print("job_jsonl", report["job_jsonl"], file=sys.stderr)
            head.submit(args.model, "-i", str(parquet), "-o", str(folder / "job_pq.jsonl"),
                        "--no-progress")
            report["job_parquet"] = summary_at(str(folder / "job_pq.jsonl.summary.json"))
            head.submit(args.model, "-i", str(parquet), "-o", str(folder / "shards"), "--ray-data",
                        "--rows-per-shard", "500", "--no-progress")
            report["job_ray_data"] = summary_at(str(folder / "shards" / "summary.json"))
            head.submit(args.model, "-i", str(jsonl), "-o", str(folder / "job_t1.jsonl"),
                        "--no-progress", env=ONE_THREAD)
            report["job_one_worker_thread"] = summary_at(
                str(folder / "job_t1.jsonl.summary.json"))
        finally:
            head.stop()
        report["local_one_thread"] = run_local(jsonl, folder, args.model, "local_t1",
                                               ONE_THREAD)
    report["transformers_static"] = run_transformers(texts[:args.hf_requests], args.model)
    local, job, hf = report["local"], report["job_jsonl"], report["transformers_static"]
    for suffix, key in (("", "tokens_per_s"), ("_after_startup", "tokens_per_s_after_startup")):
        report[f"job_vs_local{suffix}"] = round(job[key] / local[key], 3)
        report[f"job_vs_transformers_static{suffix}"] = round(job[key] / hf[key], 3)
        report[f"local_vs_transformers_static{suffix}"] = round(local[key] / hf[key], 3)
        report[f"job_vs_local_one_worker_thread{suffix}"] = round(
            report["job_one_worker_thread"][key] / report["local_one_thread"][key], 3)
    report["targets"] = {"job_vs_local": {"goal": 0.8, "met": report["job_vs_local"] >= 0.8},
                         "job_vs_transformers_static": {
                             "goal": 3.0, "met": report["job_vs_transformers_static"] >= 3.0}}
    report["driver_peak_rss_mb"] = {k: report[k]["peak_rss_mb"]
                                    for k in ("job_jsonl", "job_parquet", "job_ray_data")}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("job_vs", "local_vs"))}
                     | {"driver_peak_rss_mb": report["driver_peak_rss_mb"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
