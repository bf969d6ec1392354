"""Structured outputs' cost: decode steps of 32 constrained requests vs 32 unconstrained
ones on the same prompts, and grammar compile time for a 20-field schema, cold and cached.

builtin:bench (32000-token vocabulary, random weights) on the CPU worker. Two engines, one
per kind, each with its 32 requests, are stepped in alternation (the order swapping every
step), so each constrained step has an unconstrained twin measured next to it under the
same background load; each step's wall time around `LocalEngine.step` (the mask's fill, its
application and the matchers' advance included) is kept when both steps of a pair decoded
exactly 32 rows. The figure is the median of the per-pair ratios minus 1, with its
quartiles for spread. The builtin vocabulary is bytes plus filler tokens: a real
tokenizer's compile times differ."""

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


def _is_full_decode(engine: Any) -> bool:
    return any(plan.total_num_scheduled_tokens == BATCH
               and len(result.sampled_token_ids) == BATCH for plan, result in engine.step_log)


def _timed_step(engine: Any) -> float:
    engine.step_log.clear()
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _round(engines: dict[str, Any], prompts: list[list[int]],
           kinds: dict[str, SamplingParams]) -> list[dict[str, float]]:
    """One batch per engine run to the end in alternation: the (name -> seconds) pairs of
    steps that decoded all BATCH rows on both engines."""
    for name, engine in engines.items():
        for prompt in prompts:
            engine.add_request(prompt, kinds[name])
    pairs = []
    names = list(engines)
    i = 0
    while any(e.has_unfinished() for e in engines.values()):
        times, full = {}, True
        for name in names[i % 2:] + names[: i % 2]:
            engine = engines[name]
            if not engine.has_unfinished():
                full = False
                continue
            times[name] = _timed_step(engine)
            full = full and _is_full_decode(engine)
        if full:
            pairs.append(times)
        i += 1
    for engine in engines.values():
        engine.check_integrity()
    return pairs


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


def _mask_ms(num_repeats: int) -> dict[str, float]:
    """The masking work alone for BATCH rows (`GrammarMasks.apply`: fill + apply, and the
    matchers' advance), milliseconds per step, on 32000-wide random logits."""
    import torch

    from workers.presets import resolve_model
    from workers.structured.compiler import cache_for
    from workers.structured.mask import GrammarMasks
    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(MODEL))
    masks = GrammarMasks(cache_for(tokenizer, tokenizer.vocab_size, [2]))
    params = SamplingParams(grammar_kind=s.JSON_SCHEMA, grammar_spec=schema())
    ids = [f"r{i}" for i in range(BATCH)]
    for rid in ids:
        masks.add(rid, params, [])
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(num_repeats):
        logits = torch.randn(BATCH, tokenizer.vocab_size, generator=generator)
        start = time.perf_counter()
        masks.apply(logits, ids)
        for i, rid in enumerate(ids):
            masks.accept(rid, int(logits[i].argmax()))
        times.append(time.perf_counter() - start)
    return {"median_ms": statistics.median(times[1:]) * 1e3,
            "max_ms": max(times[1:]) * 1e3, "n": num_repeats - 1}


def _engine() -> Any:
    from cluster.engine import LocalEngine

    engine = LocalEngine(worker={"model": MODEL, "telemetry": False},
                         cache={"num_kv_blocks": 1024, "block_size": 16},
                         scheduler={"max_num_batched_tokens": 2048, "max_num_seqs": BATCH,
                                    "max_chunk_tokens": 2048},
                         calibration={"auto": False})
    engine.keep_step_log = True
    return engine


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [q[0], q[-1]]


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    num_rounds, num_tokens = (1, 12) if quick else (4, 40)
    engines = {"unconstrained": _engine(), "json_schema": _engine()}
    prompts = [[3 + (7 * i + j) % 250 for j in range(24)] for i in range(BATCH)]
    # The constrained JSON is longer than num_tokens: every request runs to its length.
    kinds = {
        "unconstrained": SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                        ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                      grammar_kind=s.JSON_SCHEMA, grammar_spec=schema()),
    }
    _round(engines, prompts, kinds)  # warm-up: compile, allocate
    pairs: list[dict[str, float]] = []
    round_overheads = []
    for _ in range(num_rounds):
        round_pairs = _round(engines, prompts, kinds)
        pairs += round_pairs
        round_overheads.append(statistics.median(
            p["json_schema"] / p["unconstrained"] for p in round_pairs) - 1)
    ratios = [p["json_schema"] / p["unconstrained"] for p in pairs]
    med = {name: statistics.median(p[name] for p in pairs) for name in kinds}
    return {
        "benchmark": "structured",
        "model": MODEL,
        "batch": BATCH,
        "decode_step_ms_median": {name: v * 1e3 for name, v in med.items()},
        "num_step_pairs": len(pairs),
        "mask_overhead": statistics.median(ratios) - 1,
        "mask_overhead_quartiles": [r - 1 for r in _quartiles(ratios)],
        "mask_overhead_per_round": round_overheads,
        "mask_overhead_goal": 0.10,
        "mask_only_ms_per_step": _mask_ms(10 if quick else 60),
        "compile": _compile_times(3 if quick else 10),
    }
