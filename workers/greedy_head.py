"""Greedy token ids of a CPU fp32 worker from a bf16 screen of its lm_head, exact.

Why: at a decode step's few rows the fp32 lm_head streams its whole weight (vocab x hidden,
65 MB on builtin:bench) from memory for every step; on a CPU with bf16 units (AMX,
AVX512-BF16) the same GEMM from a bf16 copy reads half the bytes and ran 3-6x faster. A
greedy row needs only the argmax, so the bf16 logits pick the candidates and fp32 decides:

- screen: `approx = bf16(h) @ bf16(W)^T`, output rounded to bf16 (oneDNN's packed copy, or
  the C++ `screen_gemm` where the build has AVX512-BF16 and the CPU no AMX: `uses_own_gemm`);
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
costs one bf16 copy of the lm_head's weight.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.kernels.cpu_ops import cpu_ops
from workers.models.packed import pack_weight, packed_linear

# Smaller lm_heads stay fp32: with its row pass in torch operators (~1.6 ms a 32-row step)
# the screen lost to the C++ decode GEMM on builtin:small's 2M (0.94x offline) and won on
# builtin:bench's 16M (1.11x); not measured again since the row pass moved to C++.
SCREEN_MIN_ELEMENTS = 1 << 23
SCREEN_TOP_K = 16  # candidates recomputed in fp32 per row; the rest of the vocab is bounded
SAFETY = 2.0  # the bound's margin (oneDNN's kernels may sum in another order, flush subnormals)


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


class GreedyHead:
    def __init__(self, weight: Tensor, packed_bf16: Tensor, ops: ModuleType,
                 top_k: int = SCREEN_TOP_K, own_gemm: bool = False) -> None:
        self.weight = weight  # [V, H] fp32: the lm_head's own parameter, not a copy
        # The bf16 copy of it: oneDNN-packed, or in `ops.screen_gemm`'s blocks (own_gemm).
        self.packed, self.own_gemm = packed_bf16, own_gemm
        w = weight.detach()
        rounded = w.bfloat16().float()  # Wb
        self.max_row_norm = float(torch.maximum(w.norm(dim=1), rounded.norm(dim=1)).max())
        self.max_residual_norm = float((w - rounded).norm(dim=1).max())  # max_j |dW_j|
        self.sum_bound = weight.shape[1] * 2.0**-24 * 1.01  # fp32 sums of H products
        self.top_k = top_k
        assert weight.shape[0] > top_k, "a vocab of at most k ids: no screen"
        self.ops = ops  # the C++ kernels (workers/kernels/cpu_ops.py)
        self.num_rows = 0  # rows whose ids the screen gave
        self.num_widened_rows = 0  # of them, rows whose top k did not decide

    @classmethod
    def build(cls, weight: Tensor) -> GreedyHead | None:
        """The screen for a CPU fp32 lm_head weight, or None where it does not apply (not
        fp32 or not CPU, a small lm_head, no bf16 units, no C++ kernels, a torch build that
        cannot pack bf16)."""
        if (weight.device.type != "cpu" or weight.dtype != torch.float32
                or weight.numel() < SCREEN_MIN_ELEMENTS or weight.shape[0] <= SCREEN_TOP_K
                or not has_bf16_units() or (ops := cpu_ops()) is None):
            return None
        rounded = weight.detach().bfloat16()
        if uses_own_gemm(ops, weight):
            return cls(weight.detach(), ops.pack_screen_weight(rounded), ops, own_gemm=True)
        packed = pack_weight(rounded, batch_hint=32)
        return None if packed is None else cls(weight.detach(), packed, ops)

    @torch.inference_mode()
    def ids(self, hidden: Tensor) -> Tensor:
        """hidden [S, H] fp32 -> [S] int64: each row's argmax of hidden @ weight^T."""
        self.num_rows += hidden.shape[0]
        hidden = hidden.contiguous()
        rounded = hidden.bfloat16()  # hb
        screened = (self.ops.screen_gemm(rounded, self.packed) if self.own_gemm
                    else packed_linear(rounded, self.packed, None))  # [S, V] bf16
        # The row pass (top k, bound, candidates in fp32): workers/kernels/csrc/cpu_screen.cpp.
        ids, how = self.ops.greedy_screen(
            screened, hidden, rounded, self.weight, self.top_k, self.max_row_norm,
            self.max_residual_norm, self.sum_bound, SAFETY)
        hows = how.tolist()  # one conversion: two torch reductions cost more at 32 rows
        self.num_widened_rows += sum(1 for h in hows if h > 0)
        for row in (r for r, h in enumerate(hows) if h == 2):  # a NaN or an infinity
            ids[row] = F.linear(hidden[row][None], self.weight)[0].max(dim=0).indices
        return ids
