"""The calibration grid, torch-free: what a calibration measures (`CalibrationSpec`), its
points, the order of a sweep's interleaved rounds, the pilot's estimate and the grid cut to
a time budget, and the statistics of a point's runs (workers/calibrate.py runs them)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from controller.calibration import CalibrationConfig


@dataclass(frozen=True)
class CalibrationSpec:
    """What to measure; stored in the JSON so `--check` repeats exactly this."""

    model: str
    dtype: str
    device: str
    block_size: int
    tile_tokens: int
    warmup: int
    iters: int
    threads: int | None  # torch CPU threads; None keeps torch's default
    prefill_tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]  # two or more, or a decode's per-pair cost is unknown
    matmul_size: int  # GEMM edge of the peak-FLOPs probe
    bandwidth_bytes: int  # buffer of the bandwidth probe (far above the last-level cache)
    memory_fraction: float
    agree_within: float = 0.0  # stop after two kept runs that agree this closely; 0: never

    @classmethod
    def of(cls, grid: CalibrationConfig, *, model: str, dtype: str, device: str,
           block_size: int, tile_tokens: int, threads: int | None) -> CalibrationSpec:
        """`grid` on one worker; chunks on the grid of lcm(block size, tile)."""
        return cls(model=model, dtype=dtype, device=device, block_size=block_size,
                   tile_tokens=tile_tokens, warmup=grid.warmup, iters=grid.iters,
                   threads=threads,
                   prefill_tokens=tile_grid(math.lcm(block_size, tile_tokens), grid.max_tokens),
                   contexts=grid.contexts, decode_batches=grid.decode_batches,
                   decode_contexts=grid.decode_contexts, matmul_size=grid.matmul_size,
                   bandwidth_bytes=grid.bandwidth_bytes, memory_fraction=grid.memory_fraction,
                   agree_within=grid.agree_within)

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks the largest prefill point or decode batch needs at once."""
        max_len = max(t + c for t in self.prefill_tokens for c in self.contexts)
        decode_blocks = max(self.decode_batches) * num_blocks_for(max(self.decode_contexts) + 1,
                                                           self.block_size)
        return max(num_blocks_for(max_len, self.block_size), decode_blocks, 2)


def tile_grid(unit: int, max_tokens: int) -> tuple[int, ...]:
    """unit, 2*unit, 4*unit, ... up to max_tokens: the chunk sizes measured."""
    sizes, size = [], unit
    while size <= max_tokens:
        sizes.append(size)
        size *= 2
    return tuple(sizes) or (unit,)


def num_blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` that hold `tokens`."""
    return -(-tokens // block_size)


def prefill_points(spec: CalibrationSpec, max_model_len: int) -> list[tuple[int, int]]:
    return [(t, c) for c in spec.contexts for t in spec.prefill_tokens if t + c <= max_model_len]


def decode_points(spec: CalibrationSpec) -> list[tuple[int, int]]:
    return [(b, c) for c in spec.decode_contexts for b in spec.decode_batches]


@dataclass(frozen=True)
class GridSizing:
    """How `tokenflow calibrate` sizes its grid to the device (`calibration:` fields of
    the same names): the sweep should take about `max_duration_s`."""

    max_duration_s: float
    min_iters: int
    min_chunk_sizes: int


@dataclass(frozen=True)
class StepGuess:
    """A step's seconds predicted from the pilot runs: base + per token + per query-key
    pair. Only for sizing the grid and the estimate; the table is fitted on the sweep."""

    base_s: float
    token_s: float
    pair_s: float

    def prefill_s(self, tokens: int, context: int) -> float:
        pairs = tokens * context + tokens * (tokens + 1) // 2
        return self.base_s + self.token_s * tokens + self.pair_s * pairs

    def decode_s(self, batch: int, context: int) -> float:
        return self.base_s + self.token_s * (batch - 1) + self.pair_s * batch * (context + 1)

    def sweep_s(self, spec: CalibrationSpec, max_model_len: int) -> float:
        """The sweep: every prefill point once to admit it (its first warm-up run), then
        every point every round."""
        rounds = spec.warmup + spec.iters
        prefill = sum(self.prefill_s(t, c) for t, c in prefill_points(spec, max_model_len))
        decode = sum(self.decode_s(b, c) for b, c in decode_points(spec))
        return prefill * (max(spec.warmup, 1) + spec.iters) + decode * rounds


def sweep_order(spec: CalibrationSpec, num_runs: int,
                num_admitted: int) -> list[tuple[int, int]]:
    """(round, point) of every run of a sweep, in order: `warmup + iters` interleaved
    rounds over the points, except that the first `num_admitted` points (already run once,
    to be admitted: their first warm-up run) sit out the first warm-up round."""
    return [(round_index, index)
            for round_index in range(spec.warmup + spec.iters)
            for index in range(num_runs)
            if not (round_index == 0 and spec.warmup > 0 and index < num_admitted)]


def size_grid(spec: CalibrationSpec, guess: StepGuess, max_model_len: int,
              sizing: GridSizing, budget_s: float) -> CalibrationSpec:
    """`spec` cut until `guess` says its sweep fits `budget_s`: fewer samples first (iters
    down to `min_iters`, one warm-up round), then the largest chunk sizes, then the
    deepest contexts. Never below `min_chunk_sizes` sizes or one context: a sweep that
    cannot fit then runs long rather than measure too little to fit."""
    def fits(s: CalibrationSpec) -> bool:
        return guess.sweep_s(s, max_model_len) <= budget_s

    if fits(spec):
        return spec
    spec = dataclasses.replace(spec, iters=min(spec.iters, sizing.min_iters),
                               warmup=min(spec.warmup, 1))
    while not fits(spec) and len(spec.prefill_tokens) > sizing.min_chunk_sizes:
        spec = dataclasses.replace(spec, prefill_tokens=spec.prefill_tokens[:-1])
    while not fits(spec) and len(spec.contexts) > 1:
        spec = dataclasses.replace(spec, contexts=tuple(sorted(spec.contexts))[:-1])
    return spec


def runs_agree(values: list[float], within: float) -> bool:
    """Two or more runs, the slowest at most `within` over the fastest (`within` > 0)."""
    return within > 0 and len(values) >= 2 and max(values) <= min(values) * (1 + within)


def relative_iqr(values: list[float]) -> float:
    """(p75 - p25) / median: the spread of a measurement, robust to a stolen-time burst."""
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0
