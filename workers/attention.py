"""Paged KV cache and the torch (CPU or GPU) attention path.

KV layout: per layer a pair `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]` (block-wise). Token `j` of a request lives in slot
`block_ids[j // block_size] * block_size + j % block_size` of the flattened
`[num_blocks * block_size, num_kv_heads, head_dim]` view. Slot indices are int64 so that large
pools cannot overflow.

Semantics (exact): positions are global (`num_computed + i`); a query at global position `p`
attends to keys `0..p` of its own request, i.e. causal inside the scheduled chunk and full over
earlier chunks and prefix-cached blocks. New K/V are written into the cache before any read.

All index tensors are built once per step (`AttentionMetadata.build`) and reused by every layer.
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
    key_slots: Tensor  # [context_len] int64, slots of keys 0..context_len-1
    # [n, context_len] bool (True = attend); None when the chunk is the whole context, so
    # plain causal attention over the fresh K/V applies.
    mask: Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64, where each new token's K/V is written
    prefills: list[PrefillSpan]
    # Every 1-token span (decodes, and a prefill's last single token) goes into ONE batched call.
    decode_token_idx: Tensor | None  # [D] int64, rows of the flat batch
    decode_key_slots: Tensor | None  # [D, L] int64, padded with slot 0 past each context
    decode_mask: Tensor | None  # [D, 1, 1, L] bool, False on padding

    @classmethod
    def build(
        cls, spans: list[SeqSpan], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        num_tokens = sum(s.num_query_tokens for s in spans)
        slot_mapping = torch.empty(num_tokens, dtype=torch.int64)
        prefills: list[PrefillSpan] = []
        decode_spans: list[SeqSpan] = []
        for span in spans:
            slots = _slots(span.block_ids, span.context_len, block_size)  # [ctx]
            n = span.num_query_tokens
            slot_mapping[span.query_start : span.query_start + n] = slots[span.context_len - n :]
            if n == 1:
                decode_spans.append(span)
                continue
            mask = None
            if span.context_len > n:
                # Query i sits at global position context_len - n + i and sees keys 0..that.
                query_pos = torch.arange(span.context_len - n, span.context_len)
                mask = torch.arange(span.context_len)[None, :] <= query_pos[:, None]
                mask = mask.to(device)
            prefills.append(
                PrefillSpan(span.query_start, n, span.context_len, slots.to(device), mask)
            )
        decode_idx = decode_slots = decode_mask = None
        if decode_spans:
            max_len = max(s.context_len for s in decode_spans)
            decode_slots = torch.zeros(len(decode_spans), max_len, dtype=torch.int64)
            for row, span in enumerate(decode_spans):
                decode_slots[row, : span.context_len] = _slots(
                    span.block_ids, span.context_len, block_size
                )
            context_lens = torch.tensor([s.context_len for s in decode_spans])
            decode_mask = torch.arange(max_len)[None, :] < context_lens[:, None]  # [D, L]
            decode_idx = torch.tensor([s.query_start for s in decode_spans], dtype=torch.int64)
            decode_idx, decode_slots = decode_idx.to(device), decode_slots.to(device)
            decode_mask = decode_mask[:, None, None, :].to(device)
        return cls(slot_mapping.to(device), prefills, decode_idx, decode_slots, decode_mask)


def _slots(block_ids: list[int], context_len: int, block_size: int) -> Tensor:
    """Slot of every token 0..context_len-1 of a request: [context_len] int64."""
    num_blocks = -(-context_len // block_size)
    if num_blocks > len(block_ids):
        raise ValueError(
            f"context of {context_len} tokens needs {num_blocks} blocks, request holds "
            f"{len(block_ids)}"
        )
    blocks = torch.tensor(block_ids[:num_blocks], dtype=torch.int64)
    slots = blocks[:, None] * block_size + torch.arange(block_size)[None, :]
    return slots.reshape(-1)[:context_len]


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


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
) -> Tensor:
    """q [T, H, hd], k/v [T, Hkv, hd] (already rotated) -> [T, H, hd]."""
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, hd]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    # Write first: the spans below read their own new keys back from the cache.
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.num_query_tokens)
        q_span = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if span.mask is None:
            # The chunk is the whole context: its fresh K/V equal what was just written.
            k_span, v_span = k[rows], v[rows]
        else:
            k_span, v_span = k_flat[span.key_slots], v_flat[span.key_slots]  # [ctx, Hkv, hd]
        k_span = k_span.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, hd]
        v_span = v_span.to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q_span, k_span, v_span,
            attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True,
        )  # [1, H, n, hd]
        out[rows] = o[0].transpose(0, 1)

    if meta.decode_token_idx is not None:
        assert meta.decode_key_slots is not None and meta.decode_mask is not None
        q_dec = q[meta.decode_token_idx].unsqueeze(2)  # [D, H, 1, hd]
        k_dec = k_flat[meta.decode_key_slots].to(q.dtype).transpose(1, 2)  # [D, Hkv, L, hd]
        v_dec = v_flat[meta.decode_key_slots].to(q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q_dec, k_dec, v_dec, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )  # [D, H, 1, hd]
        out[meta.decode_token_idx] = o.squeeze(2)
    return out
