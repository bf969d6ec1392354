"""Latency and throughput from a virtual-time `Trace`, and the report's target entries.

ITL: the gaps between a request's consecutive token timestamps. "While the long prompt is
being prefilled" means gaps that overlap [its arrival, its first token]: under prefill-first
the users' stalled gap *ends* after the long request's first token (the prefill step samples
it; the users' next token comes one decode step later), so a filter on gap end times inside
the window would miss exactly the stall it is meant to catch.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from benchmarks.virtual_time import RequestTrace, Trace


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    """Median, P99, max and mean in milliseconds (P99 by linear interpolation)."""
    if not samples_s:
        return {"n": 0, "median_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "mean_ms": 0.0}
    arr = np.asarray(samples_s) * 1e3
    return {"n": int(arr.size), "median_ms": float(np.median(arr)),
            "p99_ms": float(np.percentile(arr, 99)), "max_ms": float(arr.max()),
            "mean_ms": float(arr.mean())}


def gaps(req: RequestTrace) -> list[tuple[float, float]]:
    return list(itertools.pairwise(req.token_times))


def itls(trace: Trace, ids: list[str]) -> list[float]:
    return [end - start for rid in ids for start, end in gaps(trace.requests[rid])]


def itls_overlapping(trace: Trace, ids: list[str], t0: float, t1: float) -> list[float]:
    return [end - start for rid in ids for start, end in gaps(trace.requests[rid])
            if start < t1 and end > t0]


def ttft(req: RequestTrace) -> float:
    return req.token_times[0] - req.arrival_s


def throughput(trace: Trace) -> dict[str, float]:
    """Prompt + output tokens (vLLM's "total token throughput") and output tokens per
    second of virtual time, from the first arrival to the last token."""
    span = trace.end_s - min(r.arrival_s for r in trace.requests.values())
    out = sum(len(r.token_times) for r in trace.requests.values())
    prompt = sum(r.prompt_tokens for r in trace.requests.values())
    return {"duration_s": span, "output_tokens": out, "prompt_tokens": prompt,
            "total_tokens_per_s": (out + prompt) / span, "output_tokens_per_s": out / span}


def step_composition(trace: Trace, t0: float, t1: float, request_id: str) -> dict[str, Any]:
    """What the steps inside [t0, t1] carried: how the window's time was spent, and the
    slowest step with the depth its chunk of `request_id` started at."""
    steps = [s for s in trace.steps if s.start_s < t1 and s.start_s + s.duration_s > t0]
    chunks = [s.prefill[request_id] for s in steps if request_id in s.prefill]
    mixed = [s for s in steps if s.decode_tokens and s.prefill_tokens]
    depth, slowest = 0, {"duration_ms": 0.0}
    for step in steps:
        if step.duration_s * 1e3 > slowest["duration_ms"]:
            slowest = {"duration_ms": step.duration_s * 1e3, "decode_tokens": step.decode_tokens,
                       "prefill_tokens": step.prefill_tokens,
                       "chunk_tokens": step.prefill.get(request_id, 0), "chunk_depth": depth}
        depth += step.prefill.get(request_id, 0)
    return {
        "steps": len(steps),
        "steps_with_decodes": sum(1 for s in steps if s.decode_tokens),
        "mixed_steps": len(mixed),
        "prefill_only_steps": sum(1 for s in steps if s.prefill_tokens and not s.decode_tokens),
        "chunks_of_long_prompt": len(chunks),
        "chunk_tokens_mean": float(np.mean(chunks)) if chunks else 0.0,
        "chunk_tokens_max": max(chunks, default=0),
        "step_ms_mean": float(np.mean([s.duration_s for s in steps]) * 1e3) if steps else 0.0,
        "step_ms_max": max((s.duration_s for s in steps), default=0.0) * 1e3,
        "decode_tokens_mean": float(np.mean([s.decode_tokens for s in steps])) if steps else 0.0,
        "modes": sorted({s.mode for s in steps}),
        "slowest_step": slowest,
    }


def offline_composition(trace: Trace) -> dict[str, float]:
    """Where an offline run's time went: steps that prefill, steps that only decode."""
    prefill = [s for s in trace.steps if s.prefill_tokens]
    decode = [s for s in trace.steps if not s.prefill_tokens]
    return {"steps": len(trace.steps), "prefill_steps": len(prefill),
            "prefill_steps_s": sum(s.duration_s for s in prefill),
            "decode_only_steps": len(decode),
            "decode_only_steps_s": sum(s.duration_s for s in decode),
            "decode_only_batch_mean": float(np.mean([s.decode_tokens for s in decode]))
            if decode else 0.0,
            "decode_only_step_ms_mean": float(np.mean([s.duration_s for s in decode]) * 1e3)
            if decode else 0.0}


def target(value: float, threshold: float, comparison: str, what: str,
           **raw: float | None) -> dict[str, Any]:
    """One target of the issue as a ratio against its threshold, the shape every benchmark
    report here uses (value/target/comparison/met/missed_by/why) plus `ratio` and the raw
    numbers it came from. `missed_by` is the relative gap to the threshold."""
    met = value <= threshold if comparison == "<=" else value >= threshold
    gap = (value - threshold) / threshold if comparison == "<=" else \
        (threshold - value) / threshold
    return {"what": what, "value": value, "ratio": value, "target": threshold,
            "comparison": comparison, "met": met, "missed_by": None if met else gap,
            "why": None, **raw}
