"""Cluster benchmark: the controller's per-step overhead and HTTP against LocalEngine.

    python -m benchmarks.cluster_bench [--quick] [--model builtin:bench]

1. Overhead: one worker actor; N requests (1, 16, 64) decode together. For every step the
   controller records its wall time (schedule -> execute on the actor -> apply) and the
   worker's own compute time; overhead = wall - compute, reported against compute. Only
   steps that decode exactly the N requests count; the first ones are dropped (warm-up,
   warm-up rounds are discarded).
2. Throughput: the same workload (concurrent greedy requests, fixed prompt and output
   lengths, `ignore_eos`) through the OpenAI HTTP API of a one-worker cluster and through an
   in-process `LocalEngine`, alternated round by round (benchmarks/timing.py) so both see
   the same background load. Output tokens/s and the paired ratio.
3. Ray path against a 3 ms step: the overhead of (1) again, with a stand-in worker actor
   (benchmarks/standin_worker.py) that runs no model and answers every step after 3 ms,
   the step a 1B model should take on a GPU: the controller's and Ray's share of such a step
   (goal: under 10 %), stepping one step at a time and with `scheduler.async_scheduling`,
   each through both worker transports (`cluster.worker_transport`: an actor call per step,
   a Ray Compiled Graph), 3 interleaved rounds, the median reported.
Writes benchmarks/results/cluster.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.timing import alternate, paired_ratio, summary
from cluster.config import TokenflowConfig
from controller.messages import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "cluster.json"
WARMUP_STEPS = 5
STANDIN_ROUNDS = 3
# 128 submit calls take ~0.1-0.3 s, 20-60 stand-in steps: the outputs must outlast them.
STANDIN_ARRIVAL_STEPS = 100
STANDIN_TRANSPORTS = ("actor_call", "compiled_graph")  # cluster.worker_transport


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


async def run_streams(client: Any, batch: list[list[int]], params: SamplingParams) -> int:
    """All requests at once through the controller; returns the output tokens."""
    async def one(i: int, prompt: list[int]) -> int:
        _, deltas = await client.submit(prompt, params, f"bench-{time.time_ns()}-{i}", 0,
                                        "bench")
        return sum([len(delta.token_ids) async for delta in deltas])

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))


def step_overhead(handle: Any, client: Any, vocab: int, num_running: int,
                  decode_steps: int, arrival_steps: int = 0) -> dict[str, float]:
    """`arrival_steps`: steps the submissions may spread over (against a 3 ms stand-in
    step, N submit calls take longer than the first requests' outputs would last)."""
    import ray

    # Admission takes about N / max_concurrent_chunks steps; every request must still be
    # decoding for warm-up + measured steps after the last one is admitted.
    admit_steps = num_running // TokenflowConfig().scheduler.max_concurrent_chunks + 1
    admit_steps += arrival_steps
    params = SamplingParams(max_tokens=admit_steps + WARMUP_STEPS + decode_steps + 1,
                            temperature=0.0, ignore_eos=True)
    asyncio.run(run_streams(client, prompts(num_running, 16, vocab, num_running), params))
    records = ray.get(handle.step_records.remote(0))
    decode = [r for r in records if r[0] == num_running and r[1] == num_running]
    if len(decode) < decode_steps // 2:  # admissions and finishes overlapped: the fullest
        decode = [r for r in records if r[0] == r[1] and r[0] >= 0.9 * num_running]
    decode = decode[-decode_steps:]  # the last ones: the first steps warm up
    assert decode, f"no decode-only step of {num_running} requests"
    wall = statistics.fmean(r[2] for r in decode)
    compute = statistics.fmean(r[3] for r in decode)
    call = statistics.fmean(r[4] for r in decode)
    return {"running": num_running, "steps": len(decode), "step_wall_ms": 1e3 * wall,
            "worker_compute_ms": 1e3 * compute, "overhead_ms": 1e3 * (wall - compute),
            "overhead_ratio": (wall - compute) / compute,
            # where the overhead goes: planning/applying in the controller vs Ray's call
            "controller_cpu_ms": 1e3 * (wall - call), "transport_ms": 1e3 * (call - compute)}


def standin_overhead(config: TokenflowConfig, decode_steps: int,
                     rounds: int = STANDIN_ROUNDS) -> dict[str, Any]:
    """Section 3: a second controller (own namespace) whose worker is the 3 ms stand-in,
    stepping one step at a time and with async scheduling (the next step planned and sent
    while the current one runs), each with both worker transports (one actor call per
    step, a compiled graph), side by side."""
    import dataclasses

    import ray

    from benchmarks.standin_worker import STEP_S
    from cluster.controller_client import RayControllerClient
    from controller.actor import get_or_create_controller

    base = config.controller_options()
    modes = (("sync", False), ("async_scheduling", True))
    runs: dict[tuple[str, str], list[list[dict[str, Any]]]] = {
        (t, m): [] for t in STANDIN_TRANSPORTS for m, _ in modes}
    for _ in range(rounds):  # interleaved: the machine's noise hits every variant
        for transport in STANDIN_TRANSPORTS:
            for mode, is_async in modes:
                options = dataclasses.replace(
                    base, worker_cls="benchmarks.standin_worker:StandInWorkerActor",
                    cluster=dataclasses.replace(
                        base.cluster,
                        namespace=f"{config.cluster.namespace}-standin-{mode}-{transport}",
                        worker_num_cpus=0.01,  # it sleeps: no CPU to reserve
                        worker_transport=transport),
                    worker=dataclasses.replace(base.worker, telemetry=False),
                    auto_budget=None,  # nothing to calibrate: the stand-in's step is fixed
                    scheduler=dataclasses.replace(base.scheduler, async_scheduling=is_async))
                handle = get_or_create_controller(options)
                try:
                    client = RayControllerClient(handle)
                    vocab = ray.get(handle.model_info.remote())["vocab_size"]
                    used = ray.get(handle.stats.remote())["workers"][0]["transport"]
                    rows = [step_overhead(handle, client, vocab, n, decode_steps,
                                          STANDIN_ARRIVAL_STEPS)
                            for n in (16, config.scheduler.max_num_seqs)]
                finally:
                    # The stand-in is a detached worker: it must go with its controller.
                    ray.get(handle.shutdown.remote())
                    ray.kill(handle)
                for row in rows:
                    row["overhead_share_of_step"] = row["overhead_ms"] / row["step_wall_ms"]
                    row["transport"] = used  # compiled_graph may have fallen back
                runs[transport, mode].append(rows)

    def median_rows(transport: str, mode: str) -> list[dict[str, Any]]:
        """Per running count, the round with the median share, and every round's share."""
        out = []
        per_round = runs[transport, mode]
        for i in range(len(per_round[0])):
            ranked = sorted((r[i] for r in per_round),
                            key=lambda r: r["overhead_share_of_step"])
            out.append({**ranked[len(ranked) // 2],
                        "share_per_round": [r["overhead_share_of_step"] for r in ranked]})
        return out

    by_transport = {t: {"steps": median_rows(t, "sync"),
                        "steps_async_scheduling": median_rows(t, "async_scheduling")}
                    for t in STANDIN_TRANSPORTS}
    # The default transport's rows at the top level, where earlier results have them.
    return {"worker_step_ms": STEP_S * 1e3, "target_share": 0.10, "rounds": rounds,
            **by_transport["actor_call"], "transports": by_transport}


def http_workload(url: str, model: str, batch: list[list[int]], max_tokens: int) -> int:
    import httpx

    async def go() -> int:
        limits = httpx.Limits(max_connections=len(batch))
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            bodies = [{"model": model, "prompt": p, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True} for p in batch]
            resps = await asyncio.gather(*(http.post("/v1/completions", json=b)
                                           for b in bodies))
            return sum(r.json()["usage"]["completion_tokens"] for r in resps)

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="builtin:tiny, fewer rounds")
    ap.add_argument("--model", help="model (default builtin:bench, builtin:tiny with --quick)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    import ray
    import torch
    from ray import serve

    from cluster.controller_client import RayControllerClient
    from cluster.engine import LocalEngine
    from cluster.ingress import build_app
    from controller.actor import get_or_create_controller

    model = args.model or ("builtin:tiny" if args.quick else "builtin:bench")
    threads = torch.get_num_threads()
    config = TokenflowConfig(
        worker={"model": model, "num_workers": 1},
        cache={"num_kv_blocks": 1024, "block_size": 16},
        scheduler={"max_num_seqs": 128, "max_num_batched_tokens": 2048},
        protections={"max_prefill_tokens": 4096},
        cluster={"namespace": "tokenflow-bench", "worker_num_cpus": threads})
    ray.init(address="local", num_cpus=threads + 1, _node_ip_address="127.0.0.1",
             include_dashboard=False, namespace=config.cluster.namespace, log_to_driver=False)
    try:
        handle = get_or_create_controller(config.controller_options())
        client = RayControllerClient(handle)  # the ingress's path
        info = ray.get(handle.model_info.remote())
        decode_steps = 10 if args.quick else 20
        overhead = [step_overhead(handle, client, info["vocab_size"], n, decode_steps)
                    for n in (1, 16, 64)]
        ray_path_3ms = standin_overhead(config, decode_steps)

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config.model_dump()), name="bench", route_prefix="/")
        engine = LocalEngine(config)
        num_requests, prompt_len, max_tokens = 16, 64, 32 if args.quick else 64
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rounds = iter(range(1 << 30))  # fresh prompts every run: no prefix-cache replays
        url = f"http://127.0.0.1:{port}"
        times = alternate({
            "http": lambda: http_workload(url, model, prompts(
                num_requests, prompt_len, info["vocab_size"], next(rounds)), max_tokens),
            "local": lambda: engine.generate(prompts(
                num_requests, prompt_len, info["vocab_size"], next(rounds)), params),
        }, warmup=1, iters=2 if args.quick else 4)
        tokens = num_requests * max_tokens
        result = {
            "model": model, "device": info["devices"][0], "cpu_count": os.cpu_count(),
            "worker_torch_threads": info["torch_threads"][0], "local_torch_threads": threads,
            "controller_step_overhead": overhead,
            "ray_path_vs_3ms_step": ray_path_3ms,
            "throughput": {
                "requests": num_requests, "prompt_tokens": prompt_len,
                "output_tokens_per_request": max_tokens,
                "http_tokens_per_s": tokens / summary(times["http"])["mean"],
                "local_tokens_per_s": tokens / summary(times["local"])["mean"],
                "http_over_local": paired_ratio([tokens / t for t in times["http"]],
                                                [tokens / t for t in times["local"]]),
                "seconds": {k: summary(v) for k, v in times.items()},
            },
        }
    finally:
        serve.shutdown()
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """`benchmarks.run` entry: the same measurement, the report written by the runner."""
    return main((["--quick"] if quick else []) + ["--out", str(out_dir / "cluster.json")])
