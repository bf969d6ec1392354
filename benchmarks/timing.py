"""Side-by-side timing on a shared, noisy machine.

Two implementations timed in separate runs see different background load, so their ratio is
noise. `alternate` interleaves them instead: every round runs each workload once, in an order
that rotates every round (so neither always runs right after the other's cache damage), and the
first `warmup` rounds are discarded. Ratios of means over the same rounds
then share the noise; the per-round ratio spread says how much noise was left.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

Workload = Callable[[], object]


def alternate(workloads: dict[str, Workload], warmup: int, iters: int) -> dict[str, list[float]]:
    """Seconds per run of each workload over `iters` interleaved rounds (after `warmup`)."""
    names = list(workloads)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + iters):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            workloads[name]()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def summary(samples: list[float]) -> dict[str, float]:
    """Mean (the headline, the project's headline statistic), plus median, min and spread."""
    return {
        "mean": statistics.fmean(samples),
        "median": statistics.median(samples),
        "min": min(samples),
        "stdev": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "n": float(len(samples)),
    }


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Per-round ratios of two alternated series: mean of the ratio and its median."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {"mean": statistics.fmean(ratios), "median": statistics.median(ratios)}
