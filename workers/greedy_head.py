"""Greedy token ids of a CPU fp32 worker from a bf16 screen of its lm_head, exact.

Why: at a decode step's few rows the fp32 lm_head streams its whole weight (vocab x hidden,
65 MB on builtin:bench) from memory for every step; on a CPU with bf16 units (AMX,
AVX512-BF16) the same GEMM from a bf16 copy reads half the bytes and ran 3-6x faster. A
greedy row needs only the argmax, so the bf16 logits pick the candidates and fp32 decides:

- screen: `approx = bf16(h) @ bf16(W)^T`, output rounded to bf16 (oneDNN's packed copy, or
  the C++ `screen_gemm` where the build has AVX512-BF16 and the CPU no AMX: `uses_own_gemm`).
  A CPU without AMX but with AVX2 may screen with int16 instead (`uses_i16`; where it also
  has AVX512-BF16 the faster of the two here, timed at start: `fastest`): W and h
  quantized per row (W_j ~ s_j q_j: 11 bits at hidden 512, about twice bf16's precision),
  products summed exactly in int32 by VPMADDWD, the output rounded to bf16 (on a Zen 3 the
  lm_head's 32 rows in 0.7x the fp32 GEMM's time, 8 rows in 0.5x); hb and Wb below are then
  the dequantized t p and s_j q_j, and the sums' term the scaling's three fp32 roundings;
- bound: with h = hb + dh and W_j = Wb_j + dW_j (hb, Wb_j their bf16 roundings),
  h.W_j - hb.Wb_j = dh.W_j + hb.dW_j, so by Cauchy-Schwarz the inputs' rounding moves a
  logit by at most |dh| max|W_j| + |hb| max|dW_j| (the residuals' own norms, measured: about
  a third of bf16's worst case); fp32 sums of H exact bf16 products add at most
  H 2^-24 |hb| max|Wb_j|, the bf16 output's rounding 2^-8 of the value. `SAFETY` times
  their sum is e;
- a row whose k-th largest screened logit plus e is still below the largest minus e has
  its argmax among its top k: those k logits are recomputed in fp32 from the fp32 weight
  and the largest wins (the lowest id on a tie, as `max` over the whole row picks);
  any other row (flat logits) recomputes every id within 2e of its largest, and a row
  with a NaN or an infinity gets its whole fp32 row, as before.

The ids equal the fp32 argmax up to fp32's own summation order (the fp32 GEMMs of two
batch shapes differ as much). Only for rows that need no logits: greedy, no log-probs, no
grammar (workers/worker.py decides), where the C++ kernels build (the row pass is theirs);
costs one bf16 (or int16) copy of the lm_head's weight.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.kernels.cpu_ops import cpu_ops
from workers.models.packed import pack_weight, packed_linear

logger = logging.getLogger(__name__)

# Smaller lm_heads stay fp32: with its row pass in torch operators (~1.6 ms a 32-row step)
# the screen lost to the C++ decode GEMM on builtin:small's 2M (0.94x offline) and won on
# builtin:bench's 16M (1.11x); not measured again since the row pass moved to C++.
SCREEN_MIN_ELEMENTS = 1 << 23
SCREEN_TOP_K = 16  # candidates recomputed in fp32 per row; the rest of the vocab is bounded
SAFETY = 2.0  # the bound's margin (oneDNN's kernels may sum in another order, flush subnormals)
# `fastest` times each screen's GEMM on a decode step's rows (the batch hint oneDNN packs
# for), each `SCREEN_TIMING_REPS` times, interleaved, and keeps the lower median.
SCREEN_TIMING_ROWS = 32
SCREEN_TIMING_REPS = 5


def _cpu_has(probe_name: str) -> bool:
    probe = getattr(torch.cpu, probe_name, None)  # torch's CPU feature probes, where it has them
    return bool(probe is not None and probe())


def has_amx() -> bool:
    return _cpu_has("_is_amx_tile_supported")


def has_bf16_units() -> bool:
    """Whether this CPU has native bf16 dot products (AMX tiles or AVX512-BF16): only there
    did the bf16 screen beat the fp32 GEMM it replaces."""
    return has_amx() or _cpu_has("_is_avx512_bf16_supported")


def uses_own_gemm(ops: ModuleType, weight: Tensor) -> bool:
    """Whether the screen's GEMM is the C++ one (workers/kernels/csrc/cpu_screen.cpp): built
    with AVX512-BF16 and no AMX here (with AMX oneDNN's tiles ran the screen's 32 rows in
    1.7 ms on a Xeon; on a Zen 4 its AVX512-BF16 kernel took ~2.9), and the weight's shape
    fits its blocks."""
    return (bool(ops.screen_gemm_available()) and not has_amx()
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 2 == 0)


def uses_i16(ops: ModuleType, weight: Tensor) -> bool:
    """Whether the int16 screen (workers/kernels/csrc/cpu_screen_i16.cpp) can run this weight:
    an AVX2 build, the weight's shape fitting its blocks."""
    return (bool(ops.screen_i16_available())
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0)


def i16_limits(width: int) -> tuple[int, int]:
    """(qmax_w, qmax_x): the int16 magnitudes of the weight and the input whose products,
    summed over `width` terms, stay below 2^31 (width 512: 2047 each)."""
    total = 31 - math.ceil(math.log2(max(width, 2)))
    bits_w = min(15, (total + 1) // 2)
    return 2**bits_w - 1, 2 ** min(15, total - bits_w) - 1


def quantize_rows(weight: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """weight [V, H] fp32 -> (q [V, H] int16, scale [V] fp32), W_j ~ scale_j q_j, |q| <= qmax."""
    scale = weight.abs().amax(dim=1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp(-qmax, qmax).to(torch.int16)
    return q, scale


def pack_i16(q: Tensor) -> Tensor:
    """q [V, H] int16 -> `ops.screen_i16`'s blocks [V / 16, H / 2, 16, 2]."""
    v, h = q.shape
    return q.view(v // 16, 16, h // 2, 2).permute(0, 2, 1, 3).contiguous()


Gemm = Literal["onednn", "own", "i16"]


class GreedyHead:
    def __init__(self, weight: Tensor, packed: Tensor, ops: ModuleType,
                 top_k: int = SCREEN_TOP_K, gemm: Gemm = "onednn",
                 w_scale: Tensor | None = None) -> None:
        """`packed`: the weight's bf16 copy, oneDNN-packed ("onednn") or in
        `ops.screen_gemm`'s blocks ("own"), or ("i16") its int16 rows from `quantize_rows`
        with their `w_scale`, in `ops.screen_i16`'s blocks (`pack_i16`)."""
        self.weight = weight  # [V, H] fp32: the lm_head's own parameter, not a copy
        self.packed, self.gemm, self.w_scale = packed, gemm, w_scale
        w = weight.detach()
        width = w.shape[1]
        if gemm == "i16":
            assert w_scale is not None, "the int16 screen needs its rows' scales"
            self.qmax_x = i16_limits(width)[1]
            q = packed.permute(0, 2, 1, 3).reshape(w.shape)  # back to [V, H]
            rounded = q.float() * w_scale[:, None]  # W~: what the screen multiplies
            # int32 sums are exact; the conversion and two scalings round 3 times.
            self.sum_bound = 4 * 2.0**-24
        else:
            rounded = w.bfloat16().float()  # Wb
            self.sum_bound = width * 2.0**-24 * 1.01  # fp32 sums of H products
        self.max_row_norm = float(torch.maximum(w.norm(dim=1), rounded.norm(dim=1)).max())
        self.max_residual_norm = float((w - rounded).norm(dim=1).max())  # max_j |dW_j|
        self.top_k = top_k
        assert weight.shape[0] > top_k, "a vocab of at most k ids: no screen"
        self.ops = ops  # the C++ kernels (workers/kernels/cpu_ops.py)
        self.num_rows = 0  # rows whose ids the screen gave
        self.num_widened_rows = 0  # of them, rows whose top k did not decide
        self.timings_ms: dict[str, float] = {}  # each screen's GEMM where `fastest` chose

    @classmethod
    def build(cls, weight: Tensor) -> GreedyHead | None:
        """The screen for a CPU fp32 lm_head weight, or None where it does not apply (not
        fp32 or not CPU, a small lm_head, no C++ kernels, neither bf16 units nor AVX2, a
        torch build that cannot pack bf16). Where the CPU has both a bf16 screen and the
        int16 one and no AMX, the one whose GEMM ran faster here (`fastest`)."""
        if (weight.device.type != "cpu" or weight.dtype != torch.float32
                or weight.numel() < SCREEN_MIN_ELEMENTS or weight.shape[0] <= SCREEN_TOP_K
                or (ops := cpu_ops()) is None):
            return None
        w = weight.detach()
        heads = []
        if has_bf16_units():
            rounded = w.bfloat16()
            if uses_own_gemm(ops, w):
                heads.append(cls(w, ops.pack_screen_weight(rounded), ops, gemm="own"))
            elif (packed := pack_weight(rounded, batch_hint=SCREEN_TIMING_ROWS)) is not None:
                heads.append(cls(w, packed, ops))
        if uses_i16(ops, w) and not has_amx():  # with AMX oneDNN's bf16 tiles win
            q, scale = quantize_rows(w, i16_limits(w.shape[1])[0])
            heads.append(cls(w, pack_i16(q), ops, gemm="i16", w_scale=scale))
        return fastest(heads)

    def screen(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [S, H] contiguous fp32 -> (screened logits [S, V] bf16, the input the
        screen multiplied: bf16 hb, or for "i16" the dequantized fp32 t p)."""
        if self.gemm == "i16":
            screened, rounded = self.ops.screen_i16(hidden, self.packed, self.w_scale,
                                                    self.qmax_x)
            return screened, rounded
        rounded = hidden.bfloat16()  # hb
        screened = (self.ops.screen_gemm(rounded, self.packed) if self.gemm == "own"
                    else packed_linear(rounded, self.packed, None))  # [S, V] bf16
        return screened, rounded

    @torch.inference_mode()
    def ids(self, hidden: Tensor) -> Tensor:
        """hidden [S, H] fp32 -> [S] int64: each row's argmax of hidden @ weight^T."""
        self.num_rows += hidden.shape[0]
        hidden = hidden.contiguous()
        screened, rounded = self.screen(hidden)
        # The row pass (top k, bound, candidates in fp32): workers/kernels/csrc/cpu_screen.cpp.
        ids, how = self.ops.greedy_screen(
            screened, hidden, rounded, self.weight, self.top_k, self.max_row_norm,
            self.max_residual_norm, self.sum_bound, SAFETY)
        hows = how.tolist()  # one conversion: two torch reductions cost more at 32 rows
        self.num_widened_rows += sum(1 for h in hows if h > 0)
        for row in (r for r, h in enumerate(hows) if h == 2):  # a NaN or an infinity
            ids[row] = F.linear(hidden[row][None], self.weight)[0].max(dim=0).indices
        return ids


@torch.inference_mode()
def fastest(heads: list[GreedyHead], rows: int = SCREEN_TIMING_ROWS,
            reps: int = SCREEN_TIMING_REPS) -> GreedyHead | None:
    """Of the screens built for one weight, the one whose GEMM took the least time here on
    `rows` rows (median of `reps`, interleaved, after one untimed call each); its
    `timings_ms` keeps every screen's median. Why measured, not a rule: AVX512-BF16 alone
    does not say which wins (on a 2-core Xeon, KVM model 207, whose VDPBF16PS ran at half
    the rate of fp32 FMAs, the int16 screen took 3.4 ms at 32 rows against 6.3 for the bf16
    one; the bf16 one had been chosen for every CPU with bf16 units)."""
    if len(heads) <= 1:
        return heads[0] if heads else None
    width = heads[0].weight.shape[1]
    hidden = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    times: list[list[float]] = [[] for _ in heads]
    for rep in range(reps + 1):
        for head, spent in zip(heads, times, strict=True):
            start = time.perf_counter()
            head.screen(hidden)
            if rep:  # the first call of each is untimed (oneDNN's first call, cold caches)
                spent.append(time.perf_counter() - start)
    timings_ms = {head.gemm: statistics.median(spent) * 1e3
                  for head, spent in zip(heads, times, strict=True)}
    best = min(heads, key=lambda head: timings_ms[head.gemm])
    best.timings_ms = timings_ms
    logger.info("greedy screen: %s (GEMM at %d rows, ms: %s)", best.gemm, rows,
                ", ".join(f"{gemm} {ms:.2f}" for gemm, ms in timings_ms.items()))
    return best
