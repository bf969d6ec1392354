"""Launch sizes of the unified attention kernel, measured: a sweep for one GPU call.

`workers/attention/triton_backend.py` chose its Hopper launch sizes from ptxas' register
reports. This times `unified_attention` over a grid of (block_m, tile_n, num_warps,
num_stages) on the shapes the GPU bench's targets use (1B Llama shape: 32 query heads, 8 KV
heads, head_dim 64, bf16, 16-token blocks):

- `chunk`: one 2,048-token chunk at depth 8,192 (the mixed step's prefill part);
- `prompt`: one fresh 4,096-token prompt;
- `decode`: 64 sequences x 1,024 keys, one query token each.

Each config's output is checked against the current default's (a wrong config is recorded,
never ranked). Results are written after every shape, so a time limit keeps what finished.
`--quick --device cpu` is the dry run under TRITON_INTERPRET=1 (tests/test_gpu_bench.py).

    python -m benchmarks.gpu_tune --out benchmarks/results/gpu_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.gpu_smoke import random_step
from workers.attention import triton_kernels as kernels
from workers.attention.triton_backend import LaunchConfig, default_configs


@dataclass(frozen=True)
class Shape:
    name: str
    num_computed: list[int]  # per sequence: keys already in the cache
    num_query: list[int]  # per sequence: query tokens this step
    kind: str  # "decode" or "prefill": which default config it is compared with


FULL = [
    Shape("chunk", [8192], [2048], "prefill"),
    Shape("prompt", [0], [4096], "prefill"),
    Shape("decode", [1023] * 64, [1] * 64, "decode"),
]
QUICK = [Shape("chunk", [40], [24], "prefill"), Shape("decode", [20] * 3, [1] * 3, "decode")]


def grid(kind: str, quick: bool) -> list[LaunchConfig]:
    if quick:
        return [LaunchConfig(16, 16, 4, 2), LaunchConfig(32, 16, 4, 2)]
    if kind == "decode":
        sizes = itertools.product([16], [32, 64, 128], [2, 4, 8], [1, 2, 3])
    else:
        sizes = itertools.product([64, 128, 256], [32, 64, 128], [4, 8], [2, 3, 4])
    return [LaunchConfig(*s) for s in sizes]


def make_inputs(shape: Shape, heads: tuple[int, int, int], block_size: int, dtype: torch.dtype,
                device: torch.device) -> dict[str, Any]:
    """The GPU bench's random paged step (benchmarks/gpu_smoke.py) at this shape, with the
    attention FLOPs its queries cost (causal: a query attends to the keys up to its own)."""
    num_heads, num_kv_heads, head_dim = heads
    step = random_step(num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                       shape=list(zip(shape.num_computed, shape.num_query, strict=True)))
    # Contiguous, as the fused layer's rotary hands q to the kernel.
    q = step["qkv"][:, : num_heads * head_dim].reshape(-1, num_heads, head_dim).contiguous()
    flops = sum(4 * n * (done + (n + 1) / 2) * num_heads * head_dim
                for done, n in zip(shape.num_computed, shape.num_query, strict=True))
    return {**step, "q": q, "flops": flops}


def launch(inputs: dict[str, Any], cfg: LaunchConfig) -> Tensor:
    q, meta = inputs["q"], inputs["meta"]
    out = torch.empty_like(q)
    kernels.unified_attention(
        q, inputs["k_cache"], inputs["v_cache"], out, meta.query_start_loc, meta.seq_lens,
        meta.block_table, q.shape[2] ** -0.5, seq_begin=0, num_seqs=meta.num_seqs,
        num_tokens=meta.num_tokens, block_m=cfg.block_m, tile_n=cfg.tile_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def time_ms(inputs: dict[str, Any], cfg: LaunchConfig, reps: int, device: torch.device) -> float:
    launch(inputs, cfg)  # compile and warm
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(inputs, cfg)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            launch(inputs, cfg)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def sweep(shape: Shape, args: argparse.Namespace, device: torch.device,
          deadline: float) -> dict[str, object]:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    heads = (4, 2, 16) if args.quick else (32, 8, 64)
    inputs = make_inputs(shape, heads, 16, dtype, device)
    decode, prefill, _ = default_configs(heads[0] // heads[1], heads[2], dtype)
    default = decode if shape.kind == "decode" else prefill
    if args.quick:
        default = LaunchConfig(16, 16, 4, 2)
    expected = launch(inputs, default).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rows = []
    for cfg in grid(shape.kind, args.quick):
        if time.monotonic() > deadline:
            rows.append({**asdict(cfg), "skipped": "budget"})
            continue
        row: dict[str, object] = asdict(cfg)
        try:
            err = (launch(inputs, cfg).float() - expected).abs().max().item()
            row["max_abs_diff"] = err
            row["correct"] = err <= tol
            row["ms"] = time_ms(inputs, cfg, args.reps, device)
            row["tflops"] = inputs["flops"] / row["ms"] / 1e9
        except Exception as exc:  # out of shared memory or registers: recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(f"[gpu-tune] {shape.name} {row}", flush=True)
    timed = [r for r in rows if r.get("correct") and "ms" in r]
    base = next((r for r in timed if all(r[k] == v for k, v in asdict(default).items())), None)
    best = min(timed, key=lambda r: r["ms"], default=None)
    return {"shape": asdict(shape), "default": asdict(default),
            "default_ms": base["ms"] if base else None, "best": best,
            "speedup_vs_default": base["ms"] / best["ms"] if base and best else None,
            "configs": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_tune.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=200.0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    deadline = time.monotonic() + args.budget_s
    result: dict[str, object] = {
        "benchmark": "gpu_tune", "device_name": (torch.cuda.get_device_name(device)
                                                 if device.type == "cuda" else "cpu"),
        "versions": {"torch": torch.__version__, "triton": kernels.triton.__version__},
        "shapes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for shape in QUICK if args.quick else FULL:
        result["shapes"][shape.name] = sweep(shape, args, device, deadline)
        args.out.write_text(json.dumps(result, indent=1))
        best = result["shapes"][shape.name]["best"]
        print(f"[gpu-tune] {shape.name}: default {result['shapes'][shape.name]['default_ms']} ms,"
              f" best {best}", flush=True)


if __name__ == "__main__":
    main()
