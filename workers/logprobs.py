"""Log-probabilities on the worker, from the logits the step computed anyway.

Raw model distribution: `log_softmax` of the fp32 logits before temperature, top-k and
top-p (controller/logprobs.py says why). Everything is queued on the logits' device and
read back once the step's tokens are on the host (`ScoredRows.to_entries`), so a CUDA step
gains no synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from controller.messages import TokenLogprob


@dataclass
class ScoredRows:
    """Rows scored on the device: the chosen tokens' log-probabilities and the top ones."""

    chosen: Tensor  # [R] fp32
    top_values: Tensor  # [R, max_top] fp32
    top_ids: Tensor  # [R, max_top] int64
    nums_top: list[int]  # per row, <= max_top

    def to_entries(self, token_ids: list[int]) -> list[TokenLogprob]:
        chosen = self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return [TokenLogprob(token, lp, tuple(row_ids[:k]), tuple(row_values[:k]))
                for token, lp, row_ids, row_values, k in zip(
                    token_ids, chosen, ids, values, self.nums_top, strict=True)]


def score_rows(logits: Tensor, token_ids: Tensor, nums_top: list[int]) -> ScoredRows:
    """logits [R, V] (any float dtype), token_ids [R] int64 on the same device ->
    the log-probability of token_ids[r] under row r, and each row's nums_top[r] best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
    max_top = min(max(nums_top, default=0), logprobs.shape[-1])
    top = logprobs.topk(max_top, dim=-1)
    return ScoredRows(chosen, top.values, top.indices, [min(k, max_top) for k in nums_top])
