"""The last layer on the sampled rows only (CPU fp32 or bf16 worker, the model's C++ layer path).

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

from torch import Tensor

from workers.attention import AttentionBackend, AttentionStep
from workers.attention.metadata import HostStaging, SeqSpan, StepMetadata


@dataclass(frozen=True)
class SampledRows:
    """Which rows of the step's flat batch sample, in logits order, and their attention as
    one decode query each (None when no row samples: the last layer only writes K/V)."""

    rows: Tensor  # [S] int64 indices into the step's T rows
    attn: AttentionStep | None


def sampled_rows(meta: StepMetadata, sampled: list[SeqSpan], staging: HostStaging,
                 backend: AttentionBackend) -> SampledRows:
    """The step's sampled rows (`meta.logits_indices`, one per span of `sampled`, in that
    order) and their decode view. The caller has checked that some row does not sample."""
    if not sampled:
        return SampledRows(meta.logits_indices, None)
    # Row i of the view is sampled row i: one query at the end of its request's context.
    view = [SeqSpan(i, 1, s.context_len, s.block_ids) for i, s in enumerate(sampled)]
    view_meta = StepMetadata.build(view, [0] * len(view), meta.block_size, staging)
    return SampledRows(meta.logits_indices, backend.prepare(view_meta))
