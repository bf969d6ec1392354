"""Greedy token ids of a CPU fp32 worker from a bf16 screen of its lm_head, exact.

Why: at a decode step's few rows the fp32 lm_head streams its whole weight (vocab x hidden,
65 MB on builtin:bench) from memory for every step; on a CPU with bf16 units (AMX,
AVX512-BF16) the same GEMM from a bf16 copy reads half the bytes and ran 3-6x faster. A
greedy row needs only the argmax, so the bf16 logits pick the candidates and fp32 decides:

- screen: `approx = bf16(h) @ bf16(W)^T`, output rounded to bf16 (oneDNN, packed copy);
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
grammar (workers/worker.py decides); costs one bf16 copy of the lm_head's weight.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.models.packed import pack_weight, packed_linear

# Smaller lm_heads stay fp32: the screen's fixed costs (top k, bound, fp32 candidates, ~0.8
# ms a 32-row step) lost to the C++ decode GEMM on builtin:small's 2M (0.94x offline) and
# won on builtin:bench's 16M (1.11x).
SCREEN_MIN_ELEMENTS = 1 << 23
SCREEN_TOP_K = 16  # candidates recomputed in fp32 per row; the rest of the vocab is bounded
BLOCK = 128  # ids a block of the two-stage top k (`_top`)
SAFETY = 2.0  # the bound's margin (oneDNN's kernels may sum in another order, flush subnormals)


def has_bf16_units() -> bool:
    """Whether oneDNN has native bf16 dot products here (AMX tiles or AVX512-BF16): only
    there did the bf16 screen beat the fp32 GEMM it replaces."""
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(torch.cpu, name, None)
        if probe is not None and probe():
            return True
    return False


def _screen_ops() -> ModuleType | None:
    from workers.kernels.cpu_ops import cpu_ops

    return cpu_ops()


class GreedyHead:
    def __init__(self, weight: Tensor, packed_bf16: Tensor, top_k: int = SCREEN_TOP_K) -> None:
        self.weight = weight  # [V, H] fp32: the lm_head's own parameter, not a copy
        self.packed = packed_bf16  # oneDNN-packed bf16 copy of it
        w = weight.detach()
        rounded = w.bfloat16().float()  # Wb
        self.max_row_norm = float(torch.maximum(w.norm(dim=1), rounded.norm(dim=1)).max())
        self.max_residual_norm = float((w - rounded).norm(dim=1).max())  # max_j |dW_j|
        self.sum_bound = weight.shape[1] * 2.0**-24 * 1.01  # fp32 sums of H products
        self.num_blocks = -(-weight.shape[0] // BLOCK)
        self.top_k = top_k
        assert self.num_blocks >= top_k, "a vocab of fewer than k blocks: no screen"
        self.block_offsets = torch.arange(BLOCK)
        self.ops = _screen_ops()
        self.num_rows = 0  # rows whose ids the screen gave
        self.num_widened_rows = 0  # of them, rows whose top k did not decide (`_widened`)

    @classmethod
    def build(cls, weight: Tensor) -> GreedyHead | None:
        """The screen for a CPU fp32 lm_head weight, or None where it does not apply (not
        fp32 or not CPU, a small lm_head or a vocab under k blocks, no bf16 units, a torch
        build that cannot pack bf16)."""
        if (weight.device.type != "cpu" or weight.dtype != torch.float32
                or weight.shape[0] < SCREEN_TOP_K * BLOCK
                or weight.numel() < SCREEN_MIN_ELEMENTS or not has_bf16_units()):
            return None
        packed = pack_weight(weight.detach().bfloat16(), batch_hint=32)
        return None if packed is None else cls(weight.detach(), packed)

    @torch.inference_mode()
    def ids(self, hidden: Tensor) -> Tensor:
        """hidden [S, H] fp32 -> [S] int64: each row's argmax of hidden @ weight^T."""
        self.num_rows += hidden.shape[0]
        hidden = hidden.contiguous()
        rounded = hidden.bfloat16()  # hb
        screened = packed_linear(rounded, self.packed, None)  # [S, V] bf16
        if self.ops is not None:  # the row pass in C++ (workers/kernels/csrc/cpu_screen.cpp)
            ids, how = self.ops.greedy_screen(
                screened, hidden, rounded, self.weight, self.top_k, self.max_row_norm,
                self.max_residual_norm, self.sum_bound, SAFETY)
            self.num_widened_rows += int((how > 0).sum())
            for row in (how == 2).nonzero().squeeze(1).tolist():  # a NaN or an infinity
                ids[row] = F.linear(hidden[row][None], self.weight)[0].max(dim=0).indices
            return ids
        return self._ids_torch(hidden, rounded, self._padded(screened))

    def _ids_torch(self, hidden: Tensor, rounded: Tensor, approx: Tensor) -> Tensor:
        """The same in torch operators (where the C++ kernels did not build)."""
        top, top_ids = self._top(approx)  # [S, k], largest first; approx [S, V'] fp32
        rounded_norm = rounded.float().norm(dim=1)  # [S]
        residual_norm = (hidden - rounded.float()).norm(dim=1)  # [S], |dh|
        largest = torch.maximum(top[:, 0].abs(), top[:, -1].abs())  # [S]
        err = SAFETY * (residual_norm * self.max_row_norm
                        + rounded_norm * (self.max_residual_norm
                                          + self.sum_bound * self.max_row_norm)
                        + 2.0**-8 * largest)  # [S]
        is_decided = top[:, -1] + err < top[:, 0] - err  # [S]; False where NaN
        cand = top_ids.sort(dim=1).values  # [S, k], ascending: argmax's first is the lowest id
        exact = torch.bmm(self.weight[cand], hidden[:, :, None]).squeeze(2)  # [S, k]
        ids = cand.gather(1, exact.max(dim=1, keepdim=True).indices).squeeze(1)  # [S]
        if not bool(is_decided.all()):
            for row in (~is_decided).nonzero().squeeze(1).tolist():
                ids[row] = self._widened(hidden[row], approx[row], float(err[row]))
        return ids

    def _padded(self, screened: Tensor) -> Tensor:
        """[S, V] bf16 -> [S, BLOCK * num_blocks] fp32, the tail past V at -inf."""
        num_rows, vocab = screened.shape
        out = screened.new_empty((num_rows, self.num_blocks * BLOCK), dtype=torch.float32)
        out[:, vocab:] = -torch.inf
        out[:, :vocab] = screened
        return out

    def _top(self, approx: Tensor) -> tuple[Tensor, Tensor]:
        """The k largest of each row and their ids, in two stages (a third of `topk` over
        the whole row here): the k largest lie in the k blocks of the largest block maxima,
        since every block left out has k elements (those maxima) at least as large."""
        num_rows = approx.shape[0]
        blocks = approx.view(num_rows, self.num_blocks, BLOCK)
        kept = blocks.amax(dim=2).topk(self.top_k, dim=1).indices  # [S, k] block ids
        ids = kept[:, :, None] * BLOCK + self.block_offsets  # [S, k, BLOCK]
        ids = ids.reshape(num_rows, self.top_k * BLOCK)  # [S, k BLOCK]
        top, at = approx.gather(1, ids).topk(self.top_k, dim=1)  # [S, k]
        return top, ids.gather(1, at)

    def _widened(self, h: Tensor, approx: Tensor, err: float) -> int:
        """A row whose top k did not decide: every id whose screened logit is within 2e of
        the largest is recomputed in fp32 (a few dozen ids where the logits are flat);
        no bound holds on a NaN or an infinity: then the whole fp32 row."""
        self.num_widened_rows += 1
        approx = approx[: self.weight.shape[0]]  # without the padding's -inf
        largest = float(approx.max())
        if not bool(torch.isfinite(approx).all()) or err != err:
            return int(F.linear(h[None], self.weight)[0].max(dim=0).indices)
        cand = (approx >= largest - 2 * err).nonzero().squeeze(1)  # ascending ids
        exact = self.weight[cand] @ h  # [c]
        return int(cand[exact.max(dim=0).indices])
