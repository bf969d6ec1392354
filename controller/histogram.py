"""Bounded histograms the controller keeps for its metrics. Torch-free, Ray-free and free of
prometheus-client: the edge turns a `HistogramSnapshot` into exposition text.

A histogram is a fixed list of upper bounds and one count per bound plus the +Inf bucket,
so its size never grows with traffic.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Request latencies: 5 ms resolution at the bottom, a minute at the top.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 40.0, 60.0)
STEP_DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
    5.0, 10.0)
TOKEN_BUCKETS: tuple[float, ...] = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# budget_score = actual / budgeted prefill time: 1.0 is on budget.
SCORE_BUCKETS: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0,
                                    10.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; the last is +Inf
    total: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, +Inf last."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (a delta of n tokens shares one interval)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n
        self.count += n

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total, self.count)
