"""Whether the C++ decode GEMM prefetches its weights (`worker.cpu_gemm_prefetch`): on (the
default) or off as told, or (`auto`) the faster of both timed on the worker's own weights at
its start.

Why a setting: the GEMM's software prefetches (each block prefetches the next one into L2 while it
computes, a thread's last block the next GEMM's first: workers/kernels/csrc/cpu_gemm.cpp) race
the CPU's own prefetchers, and which wins is the machine's. On a 2-core Xeon they took
builtin:bench's 40 decode GEMMs at 32 rows from 7.8-8.3 to 7.0-7.5 ms; on a 2-core Zen 4
(the eighth session of 2026-12-07) the stack's GEMMs ran 9.0 ms a step without them
against 9.9 with (offline 1,033 against 990 tok/s, 8 interleaved rounds), where an earlier
Zen 4 host had gained from them. Yet served on that same Zen 4 the peer scene's long prompt
took 4.10-4.62 s without them against 3.43 with (docs/peer.md), so they stay on by default.
Prefetches change no result: only the time.
"""

from __future__ import annotations

import logging
import time
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor

from workers.models.packed import PackedLinear

log = logging.getLogger(__name__)

GemmPrefetch = Literal["auto", "on", "off"]
TIMING_ROWS = 32  # a decode step's rows, as the greedy screen is timed (greedy_head.py)
# The weights timed: the step's first ones up to this many bytes (at least one). All of
# builtin:bench's 96 MB (past a 32 MB L3, so they stream as in a step); a larger model's
# whole step would make the 12 passes cost seconds of its start.
TIMING_MAX_BYTES = 128 << 20
# Timed passes of each setting, interleaved, after one untimed pass each; each setting's
# fastest pass counts: the VM's stolen time (bursts of 100-230 ms) only ever adds to a pass,
# and with medians of 3 one worker start in ~7 had kept the slower setting on a Zen 4.
TIMING_REPS = 5


def decode_weights(model: Any, max_bytes: int = TIMING_MAX_BYTES) -> list[Tensor]:
    """The decode GEMM copies of the model's linear layers, in the order a decode step runs
    them (per layer q/k/v, o, gate, up, down), the first ones up to `max_bytes` (at least
    one); [] where a layer has none."""
    weights: list[Tensor] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if not isinstance(linear, PackedLinear) or linear.decode_packed is None:
                return []
            weights.append(linear.decode_packed)
    total = 0
    for count, weight in enumerate(weights):
        total += weight.numel() * weight.element_size()
        if total > max_bytes and count > 0:
            return weights[:count]
    return weights


@torch.inference_mode()
def time_prefetch(ops: ModuleType, weights: list[Tensor], rows: int = TIMING_ROWS,
                  reps: int = TIMING_REPS) -> dict[str, float]:
    """Milliseconds of one pass over `weights` at `rows` rows with the prefetches on and off
    (the fastest of `reps`, the order flipping each pass). Leaves the setting as it found it."""
    was_on = bool(ops.decode_gemm_prefetch())
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in {int(w.shape[1]) for w in weights}}
    spent: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for rep in range(reps + 1):
            for setting in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                ops.set_decode_gemm_prefetch(setting == "on")
                start = time.perf_counter()
                for weight in weights:  # the weights stream from memory, as in a step
                    ops.decode_linear(inputs[int(weight.shape[1])], weight)
                if rep:  # the first pass of each is untimed (cold caches)
                    spent[setting].append(time.perf_counter() - start)
    finally:
        ops.set_decode_gemm_prefetch(was_on)
    return {setting: min(times) * 1e3 for setting, times in spent.items()}


def choose_prefetch(model: Any, setting: GemmPrefetch) -> dict[str, Any] | None:
    """Set the decode GEMM's prefetch for this process: `on` / `off` as told, `auto` the
    faster of the two timed here (on where they tie). -> {"prefetch": bool, "timings_ms":
    {...}} (no timings unless timed), or None where the model has no decode GEMM copies."""
    from workers.kernels.cpu_ops import cpu_ops

    ops = cpu_ops()
    weights = decode_weights(model) if ops is not None else []
    if ops is None or not weights:
        return None
    if setting != "auto":
        ops.set_decode_gemm_prefetch(setting == "on")
        return {"prefetch": setting == "on", "timings_ms": {}}
    timings = time_prefetch(ops, weights)
    prefetch = timings["on"] <= timings["off"]
    ops.set_decode_gemm_prefetch(prefetch)
    log.info("decode GEMM prefetch %s (%d GEMMs at %d rows, ms: on %.2f, off %.2f)",
             "on" if prefetch else "off", len(weights), TIMING_ROWS, timings["on"],
             timings["off"])
    return {"prefetch": prefetch, "timings_ms": timings}
