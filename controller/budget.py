"""The token budget from measured step costs (README, "Token budgets from the hardware").

Cost model, fitted by least squares on calibration runs (workers/calibrate.py):

    t(tokens, context) = a + b * tokens + c * pairs,  pairs = tokens * (context + (tokens+1)/2)

`context` is the number of tokens already in the KV cache before the chunk (a ChunkComplete
event's `start`); `pairs` counts (query, key) pairs, so `c * pairs` is `c * tokens * mean keys
per query`. The causal half-square inside the chunk is counted: with `tokens * context`
alone, a 4k-token first chunk (depth 0) would get no attention cost at all. Tokens are padded
up to the attention kernel's tile before they enter any formula (padding is paid for).
Decode steps get their own (a, b, c) over (batch, batch * (context + 1)).

The per-step budget is the largest token count on the chunk grid (multiples of the block
size and of the tile) for which, with the chunk at the planning context, every mix of one
chunk and up to `plan_decodes` decodes (default: the largest calibrated batch) at their own
context `plan_decode_context_tokens` (default: the deepest calibrated decode context, where
running requests decode; not the chunk's depth) in the step keeps
- the fitted step time under the ITL SLO,
- FLOPs / measured peak under the SLO (compute; the peak is the GEMM probe's, or the
  model's own rate on the sweep's chunks where that is higher),
- bytes / (measured bandwidth * (1 - headroom)) under the SLO (bandwidth; the weight
  term scaled by weight_bits / measured bits, i.e. by bits/16 against a 16-bit checkpoint),
- the chunk and its context fit in the KV blocks that could be allocated (kv_capacity),
and never beyond the largest measured chunk (no extrapolation).

Without a configured ITL SLO, the SLO is derived from the same fits (`derived_slo_ms`): the
step time at which a chunk carried alongside the planned decodes already prefills at
`chunk_efficiency` of the best measured prefill rate, and never under twice the planned
pure-decode step. A smaller SLO buys smoother gaps with a slower prefill (long prompts wait
longer, the machine does less work per second); this one keeps prefill near full efficiency
while a decode gap stays a bounded multiple of a decode step. Points are fitted on their
median time: a stolen-time burst in one sample would move the mean. Torch-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from controller.calibration import CalibrationConfig
from controller.step_cost import LinearFit, StepCost, chunk_pairs, pad

SCHEMA_VERSION = 1  # of the budget file; workers/budget_file.py validates files on load


def fit_nonneg(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    """Least squares of the *relative* error with coefficients >= 0.

    Relative, so a 16-token step weighs as much as an 8k one (the budget needs both ends
    right). Non-negative, so every prediction grows with tokens and context and the budget
    is monotone in the SLO; with three unknowns the exact solution is the best least-squares
    fit over the supports whose solution is feasible.
    """
    x, y = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    xw, target = x / y[:, None], np.ones_like(y)
    best, best_residual = np.zeros(x.shape[1]), math.inf
    for size in range(1, x.shape[1] + 1):
        for support in combinations(range(x.shape[1]), size):
            cols = list(support)
            coef = np.linalg.lstsq(xw[:, cols], target, rcond=None)[0]
            if (coef < 0).any():
                continue
            full = np.zeros(x.shape[1])
            full[cols] = coef
            residual = float(((xw @ full - target) ** 2).sum())
            if residual < best_residual:
                best, best_residual = full, residual
    return [float(v) for v in best]


def _typical_s(point: dict[str, Any]) -> float:
    """A measured point's time: its median (tables written before medians: the mean)."""
    return float(point.get("median_s", point["mean_s"]))


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    return [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]


def _fit_summary(model_rows: list[list[float]], times: list[float]) -> dict[str, float]:
    a, b, c = fit_nonneg(model_rows, times)
    errors = relative_errors([LinearFit(a, b, c)(r[1], r[2]) for r in model_rows], times)
    return {"a": a, "b": b, "c": c, "median_rel_error": float(np.median(errors)),
            "max_rel_error": max(errors)}


# The derived ITL SLO is never under this many pure-decode steps (room for a chunk at all).
MIN_SLO_DECODE_MULTIPLE = 2.0


@dataclass(frozen=True)
class AutoBudget:
    """The controller's order to worker 0 at start: the table of its own model, device,
    dtype, threads and block size on `calibration`'s grid (the short run's), from its
    cache_dir or measured there and cached, fitted with its planning limits for
    `itl_slo_ms`."""

    calibration: CalibrationConfig
    itl_slo_ms: float | None  # slo.itl_ms (None: derived)


@dataclass(frozen=True)
class AutoBudgetResult:
    """What worker 0 answers: the fitted table's data and where it came from."""

    data: dict[str, Any]
    path: str  # the cache file
    is_measured: bool  # False: loaded from the cache
    measure_s: float  # seconds spent measuring (0 when loaded)
    pid: int  # the process that measured or loaded it
    is_cached: bool = True  # False: measured while other processes were busy, not stored
    contention_cores: float | None = None  # during the measurement kept (None: not judged)


class BudgetTable:
    """A calibrated budget table (the JSON file), with the controller's helpers."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data  # trusted: files are validated where they are loaded
        spec, fit, stats = data["spec"], data["fit"], data["model_stats"]
        self.block_size, self.tile = spec["block_size"], spec["tile_tokens"]
        self.prefill_model = LinearFit(*(fit["prefill"][k] for k in "abc"))
        self.decode_model = LinearFit(*(fit["decode"][k] for k in "abc"))
        self.stats, self.hw, self.kv = stats, data["hardware"], data["kv"]
        self.bytes_fit, self.limits = fit["bytes"], data["limits"]
        self.max_tokens = max(p["tokens"] for p in data["prefill"])
        # The compute roofline's peak: the probe's GEMM, or the model's own measured rate
        # where that is faster (a packed or fused kernel beats the probe's plain matmul;
        # with the probe alone, the bound would forbid steps the sweep has just run).
        self.peak_flops = max(self.hw["peak_flops"], *(
            self._flops(pad(p["tokens"], self.tile), p["context"]) / _typical_s(p)
            for p in data["prefill"]))
        # Tables written before decodes were priced at their own depth lack the key.
        self.decode_context = self.limits.get("plan_decode_context_tokens", max(
            d["context"] for d in data["decode"]))

    def step_cost(self) -> StepCost:
        return StepCost(self.prefill_model, self.decode_model, self.tile)

    def slo_ms(self, configured_ms: float | None) -> float:
        """The ITL SLO a scheduler on this table plans for: the configured one, or the
        table's derived one."""
        return self.derived_slo_ms() if configured_ms is None else configured_ms

    def derived_slo_ms(self, decodes: int | None = None, efficiency: float | None = None,
                       min_decode_multiple: float = MIN_SLO_DECODE_MULTIPLE) -> float:
        """The ITL SLO when none is configured: the smallest predicted step of one depth-0
        chunk (on the grid, up to the largest measured) and `decodes` decodes (default:
        the planned ones at their planned depth) in which the chunk's tokens per second of
        step reach `efficiency` (default: chunk_efficiency) of the best prefill-only rate;
        the largest measured chunk's step when none does; at least `min_decode_multiple`
        times the pure-decode step."""
        decodes = self.limits["plan_decodes"] if decodes is None else decodes
        goal = self.limits["chunk_efficiency"] if efficiency is None else efficiency
        cost, dctx = self.step_cost(), self.decode_context
        unit = math.lcm(self.block_size, self.tile)
        sizes = range(unit, max(self.max_tokens // unit, 1) * unit + 1, unit)
        best = max(t / self.predict(t, 0) for t in sizes)
        # The budget counts the decodes too: the SLO leaves them a grid unit's room more
        # than the efficient chunk, so that the budget it yields still holds that chunk.
        room = pad(decodes, unit)
        step_s = cost.step_s([(sizes[-1], 0)], decodes, dctx)
        for tokens in sizes:
            if tokens / cost.step_s([(tokens, 0)], decodes, dctx) >= goal * best:
                step_s = cost.step_s([(tokens + room, 0)], decodes, dctx)
                break
        decode_s = cost.step_s([], decodes, dctx)
        return 1e3 * max(step_s, min_decode_multiple * decode_s)

    # -- building, files -----------------------------------------------------------------
    @classmethod
    def build(cls, measured: dict[str, Any], *, itl_slo_ms: float | None,
              bandwidth_headroom: float,
              chunk_efficiency: float, plan_context_tokens: int | None,
              plan_decodes: int | None = None,
              plan_decode_context_tokens: int | None = None) -> BudgetTable:
        """Fit the models on a calibration run's measurements and derive the table."""
        tile = measured["spec"]["tile_tokens"]
        pre, dec = measured["prefill"], measured["decode"]
        pre_rows = [[1.0, pad(p["tokens"], tile), chunk_pairs(pad(p["tokens"], tile),
                                                             p["context"])] for p in pre]
        dec_rows = [[1.0, d["batch"], d["batch"] * (d["context"] + 1.0)] for d in dec]
        # Bytes are the worker's own linear estimate: an ordinary (exact) least squares.
        byte_rows = [[1.0, pad(p["tokens"], tile), p["context"]] for p in pre]
        weights, per_token, per_ctx = np.linalg.lstsq(
            np.asarray(byte_rows), np.asarray([float(p["bytes_moved"]) for p in pre]),
            rcond=None)[0]
        plan = max(p["context"] for p in pre) if plan_context_tokens is None \
            else plan_context_tokens
        decodes = max(d["batch"] for d in dec) if plan_decodes is None else plan_decodes
        decode_ctx = max(d["context"] for d in dec) if plan_decode_context_tokens is None \
            else plan_decode_context_tokens
        data = {**measured,
                "fit": {"prefill": _fit_summary(pre_rows, [_typical_s(p) for p in pre]),
                        "decode": _fit_summary(dec_rows, [_typical_s(d) for d in dec]),
                        "bytes": {"weights": max(float(weights), 0.0),
                                  "per_token": max(float(per_token), 0.0),
                                  "per_context_token": max(float(per_ctx), 0.0)}},
                "limits": {"bandwidth_headroom": bandwidth_headroom,
                           "chunk_efficiency": chunk_efficiency, "plan_context_tokens": plan,
                           "plan_decodes": decodes,
                           "plan_decode_context_tokens": decode_ctx}}
        table = cls(data)
        data["table"] = table.binding_table()
        data["recommendation"] = {**table.recommend_detail(table.slo_ms(itl_slo_ms)),
                                  "slo_source": "derived" if itl_slo_ms is None else "configured"}
        return cls(data)

    @classmethod
    def fitted(cls, measured: dict[str, Any], cal: CalibrationConfig,
               itl_slo_ms: float | None) -> BudgetTable:
        """`build` with the calibration section's planning limits for `itl_slo_ms` (None:
        derived); `measured` may be a whole table (its fits, limits and recommendation are
        replaced), so a cached table is re-fitted without measuring."""
        stats = measured["model_stats"]
        bits = cal.weight_bits or stats["measured_weight_bits"]
        return cls.build({**measured, "model_stats": {**stats, "weight_bits": bits}},
                         itl_slo_ms=itl_slo_ms, bandwidth_headroom=cal.bandwidth_headroom,
                         chunk_efficiency=cal.chunk_efficiency,
                         plan_context_tokens=cal.plan_context_tokens,
                         plan_decodes=cal.plan_decodes,
                         plan_decode_context_tokens=cal.plan_decode_context_tokens)

    def refit(self, observations: Sequence[tuple[int, int, float]]) -> BudgetTable:
        """A table whose prefill model is re-fitted on live (tokens, context, seconds)
        chunk timings (the drift detector's re-fit); bounds and limits are kept."""
        rows = [[1.0, pad(t, self.tile), chunk_pairs(pad(t, self.tile), c)]
                for t, c, _ in observations]
        data = {**self.data, "fit": {**self.data["fit"],
                                     "prefill": _fit_summary(rows, [s for *_, s in observations])}}
        table = BudgetTable(data)
        data["table"] = table.binding_table()
        data["recommendation"] = {**self.data["recommendation"], **table.recommend_detail(
            self.data["recommendation"]["itl_slo_ms"])}
        return BudgetTable(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.data, indent=2) + "\n", encoding="utf-8")

    # -- the three constraints and the cost model ---------------------------------------
    def predict(self, tokens: int, context: int) -> float:
        """Seconds of a step that prefills one chunk of `tokens` after `context` tokens."""
        t = pad(tokens, self.tile)
        return self.prefill_model(t, chunk_pairs(t, context))

    def predict_step(self, prefill_tokens: int, context: int, decode_tokens: int = 0,
                     decode_context: int = 0) -> float:
        """A mixed step. `decode_context` is the longest decode context of the step: decode
        rows are padded to it (the attention path batches them as one padded tensor)."""
        dec = self.decode_model
        if prefill_tokens == 0:
            return dec(decode_tokens, decode_tokens * (decode_context + 1.0))
        marginal = dec.b * decode_tokens + dec.c * decode_tokens * (decode_context + 1.0)
        return self.predict(prefill_tokens, context) + marginal

    def _flops(self, tokens: int, context: int) -> float:
        """FLOPs of a chunk of (padded) `tokens` after `context` tokens, no sampling."""
        s = self.stats
        return s["flops_per_token"] * tokens + s["flops_per_pair"] * chunk_pairs(tokens, context)

    def compute_s(self, prefill_tokens: int, context: int, decodes: int = 0,
                  decode_context: int | None = None) -> float:
        t = pad(prefill_tokens, self.tile)
        s, dctx = self.stats, context if decode_context is None else decode_context
        flops = self._flops(t, context) + s["flops_per_token"] * decodes
        flops += s["flops_per_sample"] * decodes + s["flops_per_pair"] * decodes * (dctx + 1.0)
        return flops / self.peak_flops

    def bandwidth_s(self, prefill_tokens: int, context: int, decodes: int = 0,
                    decode_context: int | None = None) -> float:
        """Seconds at the bandwidth that may be used (headroom kept free)."""
        t, fit = pad(prefill_tokens, self.tile), self.bytes_fit
        bits = self.stats["weight_bits"] / self.stats["measured_weight_bits"]
        dctx = context if decode_context is None else decode_context
        read_ctx = (context if t else 0) + decodes * dctx  # each decode reads its context
        nbytes = fit["weights"] * bits + fit["per_token"] * (t + decodes)
        nbytes += fit["per_context_token"] * read_ctx
        usable = self.hw["memory_bandwidth"] * (1.0 - self.limits["bandwidth_headroom"])
        return nbytes / usable

    def _failures(self, tokens: int, slo_s: float, context: int, kv_tokens: int,
                  plan_decodes: int) -> list[str]:
        """Constraints a step of `tokens` violates (empty: allowed), for every mix of up to
        `plan_decodes` decodes and one chunk (the extremes suffice: costs are convex). The
        chunk sits at `context`, the decodes at their own depth (`decode_context`)."""
        failed, dctx = set(), self.decode_context
        if pad(tokens, self.tile) + context > kv_tokens:
            failed.add("kv_capacity")
        for decodes in {0, min(tokens, plan_decodes)}:
            prefill = tokens - decodes
            if self.predict_step(prefill, context, decodes, dctx) > slo_s:
                failed.add("itl_slo")
            if self.compute_s(prefill, context, decodes, dctx) > slo_s:
                failed.add("compute")
            if self.bandwidth_s(prefill, context, decodes, dctx) > slo_s:
                failed.add("bandwidth")
        return sorted(failed)

    # -- what the controller and the config use -----------------------------------------
    def recommend_detail(self, itl_slo_ms: float, block_size: int | None = None,
                         kv_capacity_tokens: int | None = None,
                         context: int | None = None,
                         decodes: int | None = None) -> dict[str, Any]:
        """The budget for an SLO; `block_size` and `kv_capacity_tokens` of the pool that will
        run it, `context` the planning depth and `decodes` the decodes a step may carry
        (defaults: the table's limits)."""
        unit = math.lcm(block_size or self.block_size, self.tile)
        context = self.limits["plan_context_tokens"] if context is None else context
        decodes = self.limits["plan_decodes"] if decodes is None else decodes
        kv_tokens = self.kv["capacity_tokens"] if kv_capacity_tokens is None \
            else min(kv_capacity_tokens, self.kv["capacity_tokens"])
        budget, limited_by = 0, "measured_range"
        for tokens in range(unit, max(self.max_tokens // unit, 1) * unit + 1, unit):
            failed = self._failures(tokens, itl_slo_ms / 1e3, context, kv_tokens, decodes)
            if failed:
                limited_by = ",".join(failed)
                break
            budget = tokens
        if budget == 0:  # progress beats the SLO: one grid unit per step at least
            budget, limited_by = unit, f"unreachable:{limited_by}"
        # Chunk: the smallest grid size reaching `chunk_efficiency` of the best prefill
        # throughput within the budget; smaller pays the per-step cost `a` too often.
        sizes = range(unit, budget + 1, unit)
        rates = [t / self.predict(t, context) for t in sizes]
        goal = self.limits["chunk_efficiency"] * max(rates)
        chunk = next(t for t, r in zip(sizes, rates, strict=True) if r >= goal)
        return {"itl_slo_ms": itl_slo_ms, "max_num_batched_tokens": budget,
                "chunk_size": chunk, "limited_by": limited_by}

    def recommend(self, itl_slo_ms: float, block_size: int | None = None,
                  kv_capacity_tokens: int | None = None,
                  context: int | None = None, decodes: int | None = None) -> tuple[int, int]:
        """(max_num_batched_tokens, chunk_size) for an inter-token-latency SLO."""
        rec = self.recommend_detail(itl_slo_ms, block_size, kv_capacity_tokens, context,
                                    decodes)
        return rec["max_num_batched_tokens"], rec["chunk_size"]

    def binding_table(self) -> list[dict[str, Any]]:
        """Token ranges (doubling grid up to max_model_len, at the planning context, no
        decodes) and the constraint that binds there: kv_capacity once the chunk does not
        fit, else the larger of the compute and bandwidth lower bounds (the roofline). A
        merged row reports its times at tokens_max."""
        context = self.limits["plan_context_tokens"]
        unit, rows = math.lcm(self.block_size, self.tile), []
        tokens = unit
        while tokens <= max(self.stats["max_model_len"], unit):
            compute, bandwidth = self.compute_s(tokens, context), self.bandwidth_s(tokens, context)
            binding = "kv_capacity" if tokens + context > self.kv["capacity_tokens"] else (
                "compute" if compute >= bandwidth else "bandwidth")
            row = {"tokens_min": tokens, "tokens_max": tokens, "binding": binding,
                   "compute_s": compute, "bandwidth_s": bandwidth,
                   "predicted_s": self.predict(tokens, context)}
            if rows and rows[-1]["binding"] == binding:
                row["tokens_min"] = rows.pop()["tokens_min"]
            rows.append(row)
            tokens *= 2
        return rows

    def deviation(self, actual_s: float, tokens: int, context: int) -> float:
        """Signed relative deviation of a measured chunk step from the model (0.2 = 20 %
        slower). The controller warns and re-fits when abs() exceeds its threshold."""
        return actual_s / self.predict(tokens, context) - 1.0

    def budget_score(self, actual_s: float, tokens: int, context: int) -> float:
        """actual / budgeted prefill time of a chunk (> the slow-request threshold: log)."""
        return actual_s / self.predict(tokens, context)

    def budgeted_prefill_s(self, prompt_tokens: int, chunk_size: int, start: int = 0) -> float:
        """Budgeted time of a whole prefill cut into chunks of `chunk_size` from `start`:
        the denominator of a request's budget_score (sum of its chunk times over this)."""
        total, done = 0.0, start
        while done < prompt_tokens:
            step = min(chunk_size, prompt_tokens - done)
            total += self.predict(step, done)
            done += step
        return total
