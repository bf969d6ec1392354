"""Paged KV cache and the torch (CPU or GPU) attention path.

KV layout: per layer a pair `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]` (block-wise, the layout paged flash-attention kernels take). Token `j` of a request
lives in slot `block_ids[j // block_size] * block_size + j % block_size` of the flattened
`[num_blocks * block_size, num_kv_heads, head_dim]` view. Indices are int64 so that large pools
cannot overflow.

Semantics (exact): positions are global (`num_computed + i`); a query at global position `p`
attends to keys `0..p` of its own request, i.e. causal inside the scheduled chunk and full over
earlier chunks and prefix-cached blocks. New K/V are written into the cache before any read.

Cost notes (why it is shaped like this):
- All index tensors are built once per step with a handful of vectorised torch ops
  (`AttentionMetadata.build`), not per request or per layer.
- Keys are read back per *block* (`index_select` of whole `[block_size, Hkv, hd]` blocks, one
  contiguous memcpy each), several times faster than gathering per-token slots.
- Every 1-token span (decodes, a prefill's last single token) shares one batched attention
  call; grouped-query heads are never materialised (`enable_gqa`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

KVCache = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the flat batch, as the worker schedules it."""

    query_start: int  # index of its first token in the flat batch
    num_query_tokens: int
    context_len: int  # num_computed + num_query_tokens, i.e. keys visible after this step
    block_ids: list[int]


@dataclass(frozen=True)
class PrefillSpan:
    """A span with more than one query token: one SDPA call with its own mask."""

    query_start: int
    num_query_tokens: int
    context_len: int
    # [ceil(context_len / block_size)] blocks holding keys 0..context_len-1, and the
    # [n, context_len] additive mask (0 = attend, -inf = not); both None when the chunk is the
    # whole context, so plain causal attention over the fresh K/V applies.
    block_ids: Tensor | None
    mask: Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """All 1-token spans of the step, attended in one padded call."""

    token_idx: Tensor  # [D] int64, rows of the flat batch
    block_table: Tensor  # [D, nb] int64, padded with block 0 past each context
    max_context: int  # keys read per row: the longest context (shorter rows are masked)
    # [D, 1, 1, max_context] additive (0 / -inf, built once per step rather than converted
    # from bool by every layer); None when every row has max_context keys.
    mask: Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    positions: Tensor  # [T] int64 global positions (also the rotary positions)
    slot_mapping: Tensor  # [T] int64, where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode: DecodeBatch | None

    @classmethod
    def build(
        cls, spans: list[SeqSpan], block_size: int, device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> AttentionMetadata:
        num_blocks = [-(-s.context_len // block_size) for s in spans]
        for span, needed in zip(spans, num_blocks, strict=True):
            if needed > len(span.block_ids):
                raise ValueError(
                    f"context of {span.context_len} tokens needs {needed} blocks, request "
                    f"holds {len(span.block_ids)}"
                )
        width = max(num_blocks)
        # One padded table for the whole step: the only per-request Python is this padding.
        block_table = torch.tensor(
            [s.block_ids[:n] + [0] * (width - n) for s, n in zip(spans, num_blocks, strict=True)],
            dtype=torch.int64,
        )  # [S, width]
        lengths = torch.tensor([s.num_query_tokens for s in spans], dtype=torch.int64)
        begins = torch.tensor([s.context_len - s.num_query_tokens for s in spans])
        span_of_token = torch.repeat_interleave(torch.arange(len(spans)), lengths)  # [T]
        offsets = torch.cumsum(lengths, 0) - lengths  # first row of each span
        positions = torch.arange(int(lengths.sum())) - offsets[span_of_token]
        positions += begins[span_of_token]
        blocks = block_table[span_of_token, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size

        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        for row, (span, needed) in enumerate(zip(spans, num_blocks, strict=True)):
            n = span.num_query_tokens
            if n == 1:
                decode_rows.append(row)
                continue
            span_blocks = mask = None
            if span.context_len > n:
                # Query i sits at global position context_len - n + i and sees keys 0..that.
                query_pos = torch.arange(span.context_len - n, span.context_len)
                visible = torch.arange(span.context_len)[None, :] <= query_pos[:, None]
                mask = _additive(visible, dtype).to(device)
                span_blocks = block_table[row, :needed].to(device)
            prefills.append(PrefillSpan(span.query_start, n, span.context_len, span_blocks, mask))
        decode = _decode_batch(spans, decode_rows, block_table, num_blocks, device, dtype)
        return cls(positions.to(device), slot_mapping.to(device), prefills, decode)


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """bool (True = attend) -> 0 / -inf in `dtype`, what SDPA adds to the scores."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def _decode_batch(
    spans: list[SeqSpan], rows: list[int], block_table: Tensor, num_blocks: list[int],
    device: torch.device, dtype: torch.dtype,
) -> DecodeBatch | None:
    if not rows:
        return None
    width = max(num_blocks[r] for r in rows)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    lengths = [spans[r].context_len for r in rows]
    max_context = max(lengths)
    mask = None
    if min(lengths) < max_context:
        visible = torch.arange(max_context)[None, :] < torch.tensor(lengths)[:, None]  # [D, L]
        mask = _additive(visible, dtype)[:, None, None, :].to(device)
    token_idx = torch.tensor([spans[r].query_start for r in rows], dtype=torch.int64)
    return DecodeBatch(token_idx.to(device), block_table[rows_t, :width].to(device),
                       max_context, mask)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def _read_blocks(cache: Tensor, block_ids: Tensor) -> Tensor:
    """cache [NB, bs, Hkv, hd], block_ids [...] -> keys [..., nb * bs, Hkv, hd] (a copy)."""
    gathered = cache.index_select(0, block_ids.reshape(-1))
    return gathered.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
) -> Tensor:
    """q [T, H, hd], k/v [T, Hkv, hd] (already rotated) -> [T, H, hd]."""
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # Write first: the spans below read their own new keys back from the cache.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.num_query_tokens)
        q_span = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if span.block_ids is None:
            # The chunk is the whole context: its fresh K/V equal what was just written.
            k_span, v_span = k[rows], v[rows]
        else:
            ctx = span.context_len
            k_span = _read_blocks(k_cache, span.block_ids)[:ctx]  # [ctx, Hkv, hd]
            v_span = _read_blocks(v_cache, span.block_ids)[:ctx]
        k_span = k_span.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, hd]
        v_span = v_span.to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q_span, k_span, v_span,
            attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True,
        )  # [1, H, n, hd]
        out[rows] = o[0].transpose(0, 1)

    dec = meta.decode
    if dec is not None:
        q_dec = q[dec.token_idx].unsqueeze(2)  # [D, H, 1, hd]
        keys = slice(0, dec.max_context)  # drop the padding common to all rows
        k_dec = _read_blocks(k_cache, dec.block_table)[:, keys].to(q.dtype).transpose(1, 2)
        v_dec = _read_blocks(v_cache, dec.block_table)[:, keys].to(q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q_dec, k_dec, v_dec, attn_mask=dec.mask, scale=scale, enable_gqa=True
        )  # [D, H, 1, hd]
        out[dec.token_idx] = o.squeeze(2)
    return out
