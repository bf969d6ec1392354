"""The last layer on the sampled rows only (CPU fp32 worker, the model's C++ layer path).

Why: only a step's sampled rows (each sampling request's last query row) reach the logits,
and no later layer reads the last layer's output, so for every other row the last layer
needs only its K/V (the next steps' attention reads them). The rest of that layer (its
queries' attention, o_proj, the MLP) and the final norm run on the sampled rows: a prefill
chunk of n tokens computes one row of it instead of n, a chunk that does not finish its
prompt none. On builtin:bench (8 layers) that is ~12 % of a prefill step's FLOPs.

Exact: every kept row is computed by the same operators from the same inputs; the sampled
rows' attention runs as decode queries over the context the step has just written, which
is what the row saw in the full step (keys 0..p of its own request). Not used when every
row samples (decode-only steps: nothing to skip), when a request asks for its prompt's
log-probabilities (every row's logits), or when the worker keeps every row's logits (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from workers.attention import AttentionBackend, AttentionStep
from workers.attention.metadata import HostStaging, SeqSpan, StepMetadata


@dataclass(frozen=True)
class SampledRows:
    """Which rows of the step's flat batch sample, in logits order, and their attention as
    one decode query each (None when no row samples: the last layer only writes K/V)."""

    rows: Tensor  # [S] int64 indices into the step's T rows
    attn: AttentionStep | None


def sampled_rows(spans: dict[str, SeqSpan], sampling_ids: list[str], num_tokens: int,
                 block_size: int, staging: HostStaging, backend: AttentionBackend
                 ) -> SampledRows | None:
    """The step's sampled rows and their decode view, or None when every row samples."""
    if len(sampling_ids) == num_tokens:
        return None
    last = [spans[rid] for rid in sampling_ids]
    rows = torch.tensor([s.query_start + s.num_query_tokens - 1 for s in last],
                        dtype=torch.long)
    if not last:
        return SampledRows(rows, None)
    # Row i of the view is sampled row i: one query at the end of its request's context.
    view = [SeqSpan(i, 1, s.context_len, s.block_ids) for i, s in enumerate(last)]
    meta = StepMetadata.build(view, [0] * len(view), block_size, staging)
    return SampledRows(rows, backend.prepare(meta))
