"""Measured hardware ceilings: fp32 GEMM throughput and memory bandwidth.

Both are *measured*, never taken from a spec sheet: the token-budget calibrator and the
benchmarks compare step costs against what this machine actually sustains (with its thread
count, its other tenants, its turbo state). Warm-up: the first
`warmup` runs are discarded (page faults, thread-pool start, clock ramp), the result is the mean
of the next `iters` runs. On CPU smaller counts are fine; the defaults suit a GPU.

Stable API (the calibrator imports it):
    measure_matmul_peak_flops(dtype, size, warmup, iters, device) -> FLOP/s
    measure_memory_bandwidth(nbytes, warmup, iters, device)       -> bytes/s
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["bandwidth_runs", "matmul_flops_runs", "measure_matmul_peak_flops",
           "measure_memory_bandwidth", "timed_mean", "timed_runs"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(fn: Callable[[], object], warmup: int, iters: int,
               device: torch.device) -> list[float]:
    """Wall time of each of `iters` runs of `fn` after `warmup` discarded runs (seconds)."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters=} {warmup=}")
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        # Timed one by one (synchronised) so a single slow run cannot hide in a queue.
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def timed_mean(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    """Mean wall time of `fn` over `iters` runs after `warmup` discarded runs (seconds)."""
    times = timed_runs(fn, warmup, iters, device)
    return sum(times) / len(times)


def measure_matmul_peak_flops(
    dtype: torch.dtype = torch.float32,
    size: int = 2048,
    warmup: int = 5,
    iters: int = 20,
    device: str | torch.device = "cpu",
) -> float:
    """Sustained FLOP/s of a square `size x size` GEMM in `dtype` (2 * size^3 FLOPs each).

    A large square GEMM is the best case of the BLAS library in use, so this is the practical
    peak that model FLOPs are compared against (not the vendor's theoretical peak). Uses the
    current torch thread count: set threads before calling if the workload will.
    """
    runs = matmul_flops_runs(dtype, size, warmup, iters, device)
    return len(runs) / sum(1.0 / r for r in runs)  # total FLOPs / total time


def matmul_flops_runs(dtype: torch.dtype, size: int, warmup: int, iters: int,
                      device: str | torch.device) -> list[float]:
    """FLOP/s of each timed GEMM run (`measure_matmul_peak_flops`' probe, run by run)."""
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=dev, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=dev, dtype=dtype)
    out = torch.empty(size, size, device=dev, dtype=dtype)
    return [2.0 * size**3 / t
            for t in timed_runs(lambda: torch.mm(a, b, out=out), warmup, iters, dev)]


def measure_memory_bandwidth(
    nbytes: int = 256 * 2**20,
    warmup: int = 5,
    iters: int = 20,
    device: str | torch.device = "cpu",
) -> float:
    """Sustained memory bandwidth in bytes/s from copying an `nbytes` fp32 buffer into another.

    What it measures: a STREAM-style "copy": each run reads `nbytes` and writes `nbytes`, and
    both are counted (2 * nbytes per run). The hidden write-allocate read of the destination is
    not counted, as in STREAM. `nbytes` must be far above the last-level cache (the default
    256 MiB is) or the result is cache bandwidth. Weight-read bounds divide bytes read by this.
    """
    runs = bandwidth_runs(nbytes, warmup, iters, device)
    return len(runs) / sum(1.0 / r for r in runs)  # total bytes / total time


def bandwidth_runs(nbytes: int, warmup: int, iters: int,
                   device: str | torch.device) -> list[float]:
    """Bytes/s of each timed copy (`measure_memory_bandwidth`' probe, run by run)."""
    dev = torch.device(device)
    numel = max(nbytes // 4, 1)
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)  # ones/empty_like touch every page before timing starts
    dst.fill_(0.0)
    return [2.0 * numel * 4 / t for t in timed_runs(lambda: dst.copy_(src), warmup, iters, dev)]
