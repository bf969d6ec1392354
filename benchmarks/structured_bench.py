"""Structured outputs' cost: decode steps of 32 constrained requests vs 32 unconstrained
ones on the same prompts, and grammar compile time for a 20-field schema, cold and cached.

builtin:bench (32000-token vocabulary, random weights) on the CPU worker. One round runs the
32 requests of one kind to the end; the two kinds alternate, in turn first, and per-step
wall times around `LocalEngine.step` (the mask's fill, its application and the matchers'
advance included) are kept for steps that decode exactly 32 rows. The figure is the ratio of
the medians, constrained over unconstrained, with each round's ratio for spread. The
builtin vocabulary is bytes plus filler tokens: a real tokenizer's compile times differ."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from controller.messages import SamplingParams
from workers.structured import spec as s

MODEL = "builtin:bench"
BATCH = 32
NUM_FIELDS = 20


def schema(num_fields: int = NUM_FIELDS) -> str:
    """num_fields required fields: strings, bounded integers, enums and booleans in turn."""
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0,
                                                   "maximum": 9999},
             {"enum": ["alpha", "beta", "gamma"]}, {"type": "boolean"}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(num_fields)}
    return s.canonical_json({"type": "object", "properties": props,
                             "required": sorted(props), "additionalProperties": False})


def _round(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Wall seconds of each step that decoded all BATCH rows."""
    ids = [engine.add_request(p, params) for p in prompts]
    times = []
    while engine.has_unfinished():
        engine.step_log.clear()
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if any(plan.total_num_scheduled_tokens == BATCH and len(result.sampled_token_ids)
               == BATCH for plan, result in engine.step_log):
            times.append(elapsed)
    engine.check_integrity()
    del ids
    return times


def _compile_times(num_repeats: int) -> dict[str, Any]:
    from workers.presets import resolve_model
    from workers.structured.compiler import cache_for
    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(MODEL))
    text = schema()
    cold, cached = [], []
    for _ in range(num_repeats):
        cache = cache_for(tokenizer, tokenizer.vocab_size, [2])  # a fresh, empty cache
        start = time.perf_counter()
        cache.compile(s.JSON_SCHEMA, text)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        cache.compile(s.JSON_SCHEMA, text)
        cached.append(time.perf_counter() - start)
    return {"num_fields": NUM_FIELDS, "vocab_size": tokenizer.vocab_size,
            "cold_ms_median": statistics.median(cold) * 1e3,
            "cold_ms_min": min(cold) * 1e3, "cold_ms_max": max(cold) * 1e3,
            "cached_us_median": statistics.median(cached) * 1e6, "n": num_repeats}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from cluster.engine import LocalEngine

    num_rounds, num_tokens = (2, 12) if quick else (6, 40)
    engine = LocalEngine(worker={"model": MODEL, "telemetry": False},
                         cache={"num_kv_blocks": 1024, "block_size": 16},
                         scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": BATCH,
                                    "max_chunk_tokens": 2048},
                         calibration={"auto": False})
    engine.keep_step_log = True
    prompts = [[3 + (7 * i + j) % 250 for j in range(24)] for i in range(BATCH)]
    # The constrained JSON is longer than num_tokens: every request runs to its length.
    kinds = {
        "unconstrained": SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                        ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                      grammar_kind=s.JSON_SCHEMA, grammar_spec=schema()),
    }
    _round(engine, prompts, kinds["json_schema"])  # warm-up: compile, allocate
    step_s: dict[str, list[float]] = {name: [] for name in kinds}
    round_ratios = []
    names = list(kinds)
    for r in range(num_rounds):
        medians = {}
        for name in names[r % 2:] + names[: r % 2]:
            times = _round(engine, prompts, kinds[name])
            step_s[name] += times
            medians[name] = statistics.median(times)
        round_ratios.append(medians["json_schema"] / medians["unconstrained"])
    med = {name: statistics.median(times) for name, times in step_s.items()}
    overhead = med["json_schema"] / med["unconstrained"] - 1
    return {
        "benchmark": "structured",
        "model": MODEL,
        "batch": BATCH,
        "decode_step_ms_median": {name: v * 1e3 for name, v in med.items()},
        "num_steps": {name: len(v) for name, v in step_s.items()},
        "mask_overhead": overhead,
        "mask_overhead_goal": 0.10,
        "round_ratios": round_ratios,
        "round_ratio_spread": [min(round_ratios), max(round_ratios)],
        "compile": _compile_times(3 if quick else 10),
    }
