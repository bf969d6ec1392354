"""Engine benchmark: our worker against transformers on the same model, same process, same run.

    python -m benchmarks.run --only engine [--quick]

Measures, alternating ours / transformers / the hardware probe round by round so that all three
share the background load (benchmarks/timing.py):
- prefill tokens/s of one request per chunk size, and the achieved FLOP/s as a fraction of the
  fp32 matmul peak measured in the same rounds (workers/hardware.py);
- the decode step time of a batch at a fixed context, against the weight-read bound
  (weight bytes / memory bandwidth measured in the same rounds).
Targets are checked in engine_report.py, which also explains misses from a profile.

Thread count: intra-op threads are chosen once, up front, from a probe of the decode step
(ours + transformers') at 1..cores threads: more threads are taken only if they win every probe
round, because on a shared machine a thread count above the free cores makes every parallel
region wait for a descheduled thread (10x slower steps were seen here). `TOKENFLOW_BENCH_THREADS`
overrides it. Both implementations always run with the same setting.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_report import attach_targets, plot
from benchmarks.engine_workloads import OurWorkloads, Pair, TheirWorkloads, random_prompt
from benchmarks.timing import alternate, paired_ratio, summary
from controller.options import CacheConfig, WorkerConfig
from workers.hardware import measure_matmul_peak_flops, measure_memory_bandwidth
from workers.model_config import ModelConfig
from workers.presets import resolve_model
from workers.worker import Worker, build_worker


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str
    prefill_chunks: tuple[int, ...]
    decode_batch: int
    decode_context: int
    prefill_warmup: int
    prefill_iters: int
    decode_warmup: int
    decode_iters: int
    gemm_size: int
    bandwidth_bytes: int
    profile_runs: int
    thread_rounds: int
    block_size: int = 16


FULL = EngineBenchConfig("builtin:bench", (512, 2048), 16, 256, prefill_warmup=1,
                         prefill_iters=5, decode_warmup=3, decode_iters=15, gemm_size=2048,
                         bandwidth_bytes=128 * 2**20, profile_runs=1, thread_rounds=4)
QUICK = EngineBenchConfig("builtin:tiny", (32, 64), 4, 32, prefill_warmup=1, prefill_iters=2,
                          decode_warmup=1, decode_iters=3, gemm_size=256,
                          bandwidth_bytes=16 * 2**20, profile_runs=1, thread_rounds=1)


def prefill_flops(cfg: ModelConfig, tokens: int, attention: bool = True) -> float:
    """Useful FLOPs of a one-shot prefill: every linear layer for every token, causal attention
    over the unmasked (query, key) pairs only, and lm_head for the one sampled row."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    linear_params = cfg.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    pairs = tokens * (tokens + 1) / 2 if attention else 0.0
    attention_flops = cfg.num_hidden_layers * 2 * 2 * q * pairs  # QK^T and PV, 2 FLOPs per MAC
    return 2.0 * linear_params * tokens + attention_flops + 2.0 * h * cfg.vocab_size


def weight_read_bytes(worker: Worker) -> int:
    """Bytes of weights one step reads: all of them except the embedding table, of which only
    the step's rows are gathered (unless it doubles as lm_head)."""
    cfg = worker.model_config
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return worker.weight_bytes - embed * worker.dtype.itemsize


def choose_threads(decode: Pair, max_threads: int, rounds: int) -> tuple[int, dict[str, Any]]:
    """More threads only if they win every probe round: one descheduled thread stalls every
    parallel region, so a setting that is sometimes much slower is worse than a steady one."""
    override = os.environ.get("TOKENFLOW_BENCH_THREADS")
    if override:
        return int(override), {"override": True}

    def at(threads: int) -> Any:
        def run() -> None:
            torch.set_num_threads(threads)
            decode.ours()
            decode.theirs()
        return run

    times = alternate({str(n): at(n) for n in range(1, max_threads + 1)}, 1, rounds)
    best = 1
    for n in range(2, max_threads + 1):
        if all(a < b for a, b in zip(times[str(n)], times[str(best)], strict=True)):
            best = n
    return best, {f"{n}_threads_s": t for n, t in times.items()}


def bench_prefill(cfg: EngineBenchConfig, pair: Pair, model_cfg: ModelConfig,
                  chunk: int, device: torch.device) -> dict[str, Any]:
    peaks: list[float] = []
    times = alternate({
        "ours": pair.ours,
        "transformers": pair.theirs,
        "peak": lambda: peaks.append(
            measure_matmul_peak_flops(torch.float32, cfg.gemm_size, warmup=0, iters=1,
                                      device=device)),
    }, cfg.prefill_warmup, cfg.prefill_iters)
    peak = summary(peaks[-cfg.prefill_iters:])["mean"]
    flops = prefill_flops(model_cfg, chunk)
    result: dict[str, Any] = {"tokens": chunk, "model_flops": flops,
                              "linear_flops": prefill_flops(model_cfg, chunk, attention=False),
                              "matmul_peak_flops": peak}
    for name in ("ours", "transformers"):
        mean_s = summary(times[name])["mean"]
        result[name] = {"seconds": summary(times[name]), "tokens_per_s": chunk / mean_s,
                        "flops_per_s": flops / mean_s, "peak_fraction": flops / mean_s / peak}
    # >1 means ours is faster; per-round ratios show how much noise the alternation left.
    result["throughput_ratio"] = (result["ours"]["tokens_per_s"]
                                  / result["transformers"]["tokens_per_s"])
    result["per_round_time_ratio"] = paired_ratio(times["ours"], times["transformers"])
    return result


def bench_decode(cfg: EngineBenchConfig, pair: Pair, worker: Worker) -> dict[str, Any]:
    bandwidths: list[float] = []
    device = worker.device
    times = alternate({
        "ours": pair.ours,
        "transformers": pair.theirs,
        "bandwidth": lambda: bandwidths.append(
            measure_memory_bandwidth(cfg.bandwidth_bytes, warmup=0, iters=1, device=device)),
    }, cfg.decode_warmup, cfg.decode_iters)
    bandwidth = summary(bandwidths[-cfg.decode_iters:])["mean"]
    weights = weight_read_bytes(worker)
    kv_read = cfg.decode_batch * cfg.decode_context * worker.kv_bytes_per_block // cfg.block_size
    result: dict[str, Any] = {
        "batch": cfg.decode_batch, "context": cfg.decode_context,
        "memory_bandwidth_bytes_per_s": bandwidth, "weight_bytes": weights,
        "kv_read_bytes": kv_read, "weight_read_bound_s": weights / bandwidth,
        "weight_and_kv_read_bound_s": (weights + kv_read) / bandwidth,
    }
    for name in ("ours", "transformers"):
        stats = summary(times[name])
        result[name] = {"seconds": stats, "step_ms": stats["mean"] * 1e3,
                        "vs_weight_read_bound": stats["mean"] / result["weight_read_bound_s"]}
    result["step_time_ratio"] = (result["ours"]["seconds"]["mean"]
                                 / result["transformers"]["seconds"]["mean"])
    result["per_round_time_ratio"] = paired_ratio(times["ours"], times["transformers"])
    return result


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """The registered entry point (benchmarks/run.py): returns the JSON, writes engine.png."""
    from transformers import LlamaForCausalLM as HFLlama

    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    path = resolve_model(cfg.model)
    blocks = sum(-(-c // cfg.block_size) for c in cfg.prefill_chunks)
    blocks += cfg.decode_batch * (-(-(cfg.decode_context + 1) // cfg.block_size))
    # "auto": a GPU where there is one (untested here: this project's CI machine has none).
    worker = build_worker(WorkerConfig(model=str(path), device="auto", telemetry=False),
                          CacheConfig(block_size=cfg.block_size, num_kv_blocks=blocks))
    hf_model = HFLlama.from_pretrained(path, dtype=torch.float32).eval().to(worker.device)
    ours, theirs = OurWorkloads(worker), TheirWorkloads(hf_model)
    model_cfg = worker.model_config
    prompts = [random_prompt(cfg.decode_context, model_cfg.vocab_size, seed=1000 + i)
               for i in range(cfg.decode_batch)]
    # Built once: each prefills (decode) or reserves (prefill) its own KV blocks.
    decode = Pair(ours.decode(prompts), theirs.decode(prompts))
    prefills: dict[int, Pair] = {}
    for chunk in cfg.prefill_chunks:
        prompt = random_prompt(chunk, model_cfg.vocab_size, seed=chunk)
        prefills[chunk] = Pair(ours.prefill(prompt), theirs.prefill(prompt))

    if worker.device.type == "cpu":
        threads, thread_probe = choose_threads(decode, torch.get_num_threads(),
                                               cfg.thread_rounds)
        torch.set_num_threads(threads)
    else:  # host threads only feed the GPU
        threads, thread_probe = torch.get_num_threads(), {"skipped": worker.device.type}
    report: dict[str, Any] = {
        "benchmark": "engine",
        "config": asdict(cfg),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "threads": threads, "thread_probe": thread_probe,
                    "device": str(worker.device)},
        "model": {"name": cfg.model, "params": worker.num_params,
                  "weight_bytes": worker.weight_bytes, "dtype": str(worker.dtype)},
        "prefill": {str(c): bench_prefill(cfg, pair, model_cfg, c, worker.device)
                    for c, pair in prefills.items()},
        "decode": bench_decode(cfg, decode, worker),
    }
    workloads = {f"prefill_{c}": pair for c, pair in prefills.items()} | {"decode": decode}
    attach_targets(report, workloads, cfg.profile_runs)
    report["wall_s"] = time.perf_counter() - started
    plot(report, out_dir / "engine.png")
    return report
