"""The roofline of the peer benchmark's offline workload on this CPU: the fp32 GEMM rate torch
reaches here for the model's own layer shapes (plain `F.linear` and the oneDNN-packed call
of workers/models/packed.py), the workload's FLOPs, and from both the highest output tok/s
any fp32 engine could reach on this machine, against which each engine's rate is a share.

The GEMMs are the shapes the worker runs (q/k/v fused, gate/up fused; vLLM fuses the same),
at the rows a step of this workload can have: the 32 sequences of a decode step, and
prefill chunks of 128 to 1,024 rows (an engine free to batch the 4,096 prompt tokens)."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.peer_offline import NUM_PROMPTS, OUTPUT_LEN, PROMPT_LEN

DECODE_ROWS = NUM_PROMPTS
PREFILL_ROWS = (128, 512, 1024)
MIN_CALL_S = 0.05  # each shape is timed for at least this long a pass, best call kept
NUM_PASSES = 3


def model_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each GEMM of one layer, and of lm_head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
            "o": (heads * head_dim, hidden), "gate_up": (hidden, 2 * inter),
            "down": (inter, hidden), "lm_head": (hidden, config["vocab_size"])}


def workload_flops(folder: str) -> dict[str, Any]:
    """FLOPs of 32 prompts x 128 ids, 64 greedy tokens each: every prompt token and every
    fed-back output token (63 a sequence: the first comes from the prompt's last row) runs
    the layers' GEMMs (2 x non-embedding params), each of the 64 outputs one lm_head row;
    attention (QK^T and PV, 4 x context x heads x head_dim a layer) is estimated apart."""
    config = json.loads((Path(folder) / "config.json").read_text())
    shapes = model_shapes(config)
    num_layers = config["num_hidden_layers"]
    layer_params = num_layers * sum(a * b for k, (a, b) in shapes.items() if k != "lm_head")
    lm_head_params = shapes["lm_head"][0] * shapes["lm_head"][1]
    attn_width = config["num_attention_heads"] * (config.get("head_dim")
                                                  or config["hidden_size"]
                                                  // config["num_attention_heads"])
    prefill_tokens = NUM_PROMPTS * PROMPT_LEN
    decode_tokens = NUM_PROMPTS * (OUTPUT_LEN - 1)
    output_tokens = NUM_PROMPTS * OUTPUT_LEN
    # Token at position t attends to t + 1 keys (causal), in every layer.
    prefill_ctx = NUM_PROMPTS * sum(t + 1 for t in range(PROMPT_LEN))
    decode_ctx = NUM_PROMPTS * sum(PROMPT_LEN + k + 1 for k in range(OUTPUT_LEN - 1))
    flops = {
        "prefill_gemm": 2 * prefill_tokens * layer_params,
        "decode_gemm": 2 * decode_tokens * layer_params,
        "lm_head": 2 * output_tokens * lm_head_params,
        "attention": 4 * num_layers * attn_width * (prefill_ctx + decode_ctx),
    }
    return {"non_embedding_params": layer_params, "lm_head_params": lm_head_params,
            "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens,
            "output_tokens": output_tokens, "flops": flops, "total_flops": sum(flops.values()),
            "shapes": {k: list(v) for k, v in shapes.items()}, "num_layers": num_layers}


def _best_call_s(fn: Any) -> float:
    fn()  # warm: packing caches, thread pool
    best, spent = float("inf"), 0.0
    while spent < MIN_CALL_S:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def measure_gemms(folder: str) -> dict[str, Any]:
    """GFLOP/s of each layer shape at decode and prefill rows, plain and packed: the best
    call over NUM_PASSES passes through all of them, so that a burst of another process's
    load on a shared machine spoils one pass of a cell, not the cell."""
    import torch
    import torch.nn.functional as F

    from workers.models.packed import pack_weight, packed_linear

    shapes = model_shapes(json.loads((Path(folder) / "config.json").read_text()))
    gen = torch.Generator().manual_seed(0)
    calls: dict[tuple[str, int, str], tuple[float, Any]] = {}
    for name, (n_in, n_out) in shapes.items():
        weight = torch.randn(n_out, n_in, generator=gen) * 0.02
        packed = pack_weight(weight)
        for rows in (DECODE_ROWS,) if name == "lm_head" else (DECODE_ROWS, *PREFILL_ROWS):
            x = torch.randn(rows, n_in, generator=gen)
            gflop = 2 * rows * n_in * n_out / 1e9
            calls[name, rows, "plain"] = gflop, partial(F.linear, x, weight)
            if packed is not None:
                calls[name, rows, "packed"] = gflop, partial(packed_linear, x, packed, None)
    best: dict[tuple[str, int, str], float] = {}
    with torch.inference_mode():
        for _ in range(NUM_PASSES):
            for key, (_, fn) in calls.items():
                best[key] = min(best.get(key, float("inf")), _best_call_s(fn))
    rates: dict[str, dict[str, dict[str, float]]] = {}
    for (name, rows, kind), seconds in best.items():
        rates.setdefault(name, {}).setdefault(str(rows), {})[kind] = (
            calls[name, rows, kind][0] / seconds)
    return {"num_threads": torch.get_num_threads(), "gflops": rates}


def roofline(gemm: dict[str, Any], work: dict[str, Any], engines: dict[str, Any]
             ) -> dict[str, Any]:
    """The fastest this workload can run here: every GEMM at the best rate measured for its
    shape at the rows it can have (decode and lm_head: 32 rows; prefill: any measured), the
    attention estimate at the best rate of all; and the looser bound of everything at the
    single best rate. Each engine's median tok/s as a share of the tighter bound."""
    rates = gemm["gflops"]
    best_at = {name: {rows: max(r.values()) for rows, r in by_rows.items()}
               for name, by_rows in rates.items()}
    best = max(v for by_rows in best_at.values() for v in by_rows.values())
    layer = [k for k in rates if k != "lm_head"]
    params = {k: a * b for k, (a, b) in work["shapes"].items()}

    def phase_s(tokens: int, rows: list[str]) -> float:
        # Each shape's share of the layers' FLOPs at its own best rate over `rows`.
        return sum(2 * tokens * work["num_layers"] * params[k]
                   / (1e9 * max(best_at[k][r] for r in rows)) for k in layer)

    prefill_rows = [str(r) for r in PREFILL_ROWS] + [str(DECODE_ROWS)]
    flops = work["flops"]
    seconds = {
        "prefill_gemm": phase_s(work["prefill_tokens"], prefill_rows),
        "decode_gemm": phase_s(work["decode_tokens"], [str(DECODE_ROWS)]),
        "lm_head": flops["lm_head"] / (1e9 * best_at["lm_head"][str(DECODE_ROWS)]),
        "attention": flops["attention"] / (1e9 * best),
    }
    min_s = sum(seconds.values())
    ceiling = work["output_tokens"] / min_s
    loose = work["output_tokens"] / (work["total_flops"] / (1e9 * best))
    shares = {name: e["tok_s"]["median"] / ceiling for name, e in engines.items()
              if e["tok_s"]["median"]}
    return {"gemm": gemm, "workload": work, "best_gemm_gflops": best,
            "min_seconds": seconds, "max_output_tok_s": ceiling,
            "max_output_tok_s_all_at_best_gflops": loose, "engine_share_of_max": shares}
