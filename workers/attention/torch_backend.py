"""The torch attention backend: SDPA over K/V gathered from the paged cache (CPU default, and
the exact reference the Triton kernels are tested against).

Semantics (exact): a query at global position `p` attends to keys `0..p` of its own request,
i.e. causal inside the scheduled chunk and full over earlier chunks and prefix-cached blocks.
New K/V are written into the cache before any read.

Cost notes:
- Everything per step (decode groups, masks, block ids) is prepared once, by `prepare`, from
  the step's metadata; layers only run the attention calls.
- Varlen decode: the 1-token spans come sorted by context, longest first, and are cut into
  groups; each group is one padded SDPA call over its own longest context. A row joins the
  group above it while the group's padding (keys read and masked for rows shorter than the
  group's first) stays within `group_waste_bytes` of K/V: past that, one more call costs less
  than reading the padding (a call's fixed cost on CPU is ~60 us; 128 rows between 100 and
  3,000 tokens ran 2x faster than with groups bounded by a context ratio). Padded keys are
  masked with -inf: each row's result equals an unpadded call's.
- Keys are read back per *block* (`index_select` of whole `[block_size, Hkv, hd]` blocks, one
  contiguous memcpy each), several times faster than gathering per-token slots.
- Masks are built on the device from `seq_lens` and positions (`arange` comparisons), once per
  step; grouped-query heads are never materialised (`enable_gqa` for chunks; a decode's query
  heads become the query rows of their KV head).
- With a `decode_kernel` (the `cpu` backend: workers/kernels/csrc/cpu_attention.cpp) every
  decode row is one call that reads its blocks in place: no groups, no gathered copies, no
  padding. With a `chunk_kernel` each chunk is one call of a flash-style kernel over its
  blocks in place (no gathered context, no mask): on the peer scene's shapes (8/2 heads of
  64, chunks of 100-500 queries at 0-6,000 keys, 2 threads) 1.2-1.7x SDPA's rate.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from workers.attention.metadata import StepMetadata

KVCache = tuple[Tensor, Tensor]
# (out, q, k_cache, v_cache, block_table, seq_lens, scale): decode rows' attention into `out`.
DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], None]
# (out, q, k_cache, v_cache, block_ids, context_len, scale): one chunk's attention into `out`,
# its queries the last of its context.
ChunkKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, float], None]


def profiled(name: str) -> AbstractContextManager[object]:
    """`name` for torch's profiler around a C++ kernel's call (not an aten op: it would show
    as no operator), only while a profiler runs: entering `record_function` took ~28 us with
    none running, against ~0.5 us for the check (one call per layer of every step)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


def decode_groups(seq_lens: np.ndarray, max_padding: int) -> list[tuple[int, int]]:
    """Contiguous row ranges `[a, b)` of `seq_lens` (sorted longest first, as the worker sorts
    decodes) in which the padding up to the range's first row, sum(first - len), stays within
    `max_padding` keys."""
    groups: list[tuple[int, int]] = []
    start, longest, padding = 0, -1, 0
    for row, length in enumerate(seq_lens.tolist()):
        if longest >= 0 and padding + longest - length <= max_padding:
            padding += longest - length
            continue
        if longest >= 0:
            groups.append((start, row))
        start, longest, padding = row, length, 0
    if longest >= 0:
        groups.append((start, len(seq_lens)))
    return groups


@dataclass(frozen=True)
class _DecodeGroup:
    rows: slice  # rows of the flat batch (= sequences: decodes have one token each)
    block_table: Tensor  # [g, nb]
    num_keys: int  # the group's longest context
    mask: Tensor | None  # [g, 1, 1, num_keys] additive; None when every row has num_keys


@dataclass(frozen=True)
class _Chunk:
    rows: slice
    context_len: int
    block_ids: Tensor | None  # None: the chunk is the whole context (fresh K/V suffice)
    mask: Tensor | None  # [n, context_len] additive, bottom-right causal


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """bool (True = attend) -> 0 / -inf in `dtype`, what SDPA adds to the scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))


def _read_blocks(cache: Tensor, block_ids: Tensor, out: Tensor | None = None) -> Tensor:
    """cache [NB, bs, Hkv, hd], block_ids [...] -> keys [..., nb * bs, Hkv, hd] (a copy, into
    `out` [nb_total, bs, Hkv, hd] when given)."""
    gathered = torch.index_select(cache, 0, block_ids.reshape(-1), out=out)
    return gathered.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


class TorchAttentionStep:
    """One step's attention over every layer (built by `TorchBackend.prepare`)."""

    def __init__(self, meta: StepMetadata, dtype: torch.dtype, max_padding: int,
                 decode_kernel: DecodeKernel | None = None,
                 chunk_kernel: ChunkKernel | None = None) -> None:
        if meta.num_real_tokens != meta.num_tokens:
            raise ValueError("the torch backend runs unpadded steps only")
        self.meta = meta
        self.decode_kernel = decode_kernel
        self.chunk_kernel = chunk_kernel
        # One gather buffer for K and one for V, sized to the step's largest chunk context and
        # reused by every chunk of every layer (peak memory as with a fresh tensor per gather):
        # a chunk deep into a long prompt gathers MBs of context a layer, and a fresh tensor
        # each time (page faults) cost more than the copy. With them, a 6,000-token prompt
        # prefilled beside 8 decodes reached its first token sooner in 5 of 6 alternating
        # runs (median 6.1 s against 6.9 s); decode groups gather little and measured no
        # different, so they keep theirs.
        self._buffers: dict[int, Tensor] = {}
        device, bs = meta.seq_lens.device, meta.block_size
        lens = meta.seq_lens_np
        self.decodes: list[_DecodeGroup] = []
        groups = [] if decode_kernel else decode_groups(lens[: meta.num_decodes], max_padding)
        for a, b in groups:
            num_keys = int(lens[a:b].max())
            mask = None
            if int(lens[a:b].min()) < num_keys:
                visible = torch.arange(num_keys, device=device)[None, :] < meta.seq_lens[a:b, None]
                mask = _additive(visible, dtype)[:, None, None, :]
            width = -(-num_keys // bs)
            self.decodes.append(_DecodeGroup(slice(a, b), meta.block_table[a:b, :width],
                                             num_keys, mask))
        self.chunks: list[_Chunk] = []
        qsl = meta.query_start_np
        for seq in range(meta.num_decodes, meta.num_seqs):
            begin, end, ctx = int(qsl[seq]), int(qsl[seq + 1]), int(lens[seq])
            n = end - begin
            block_ids = mask = None
            # The kernel reads every chunk's blocks and is causal by position: no mask.
            if chunk_kernel is not None or ctx > n:
                block_ids = meta.block_table[seq, : -(-ctx // bs)]
                # SDPA: a lone query at the end of its context sees every key, no mask.
                if chunk_kernel is None and n > 1:
                    query_pos = torch.arange(ctx - n, ctx, device=device)
                    mask = _additive(torch.arange(ctx, device=device)[None, :]
                                     <= query_pos[:, None], dtype)
            self.chunks.append(_Chunk(slice(begin, end), ctx, block_ids, mask))
        self._max_chunk_blocks = max((c.block_ids.numel() for c in self.chunks
                                      if c.block_ids is not None), default=0)

    def _gather(self, which: int, cache: Tensor, block_ids: Tensor) -> Tensor:
        """A chunk's context blocks of `cache` (which: 0 K, 1 V) in the step's buffer."""
        buf = self._buffers.get(which)
        if buf is None:
            buf = torch.empty((self._max_chunk_blocks, *cache.shape[1:]), dtype=cache.dtype,
                              device=cache.device)
            self._buffers[which] = buf
        return _read_blocks(cache, block_ids, out=buf[: block_ids.numel()])

    def decode_only_inputs(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """(block_table [T, W], seq_lens [T], slot_mapping [T]) where every row of the step
        is a decode that the C++ kernel attends (what workers/decode_stack.py runs), else
        None."""
        meta = self.meta
        if self.decode_kernel is None or not meta.is_decode_only:
            return None
        return meta.block_table, meta.seq_lens, meta.slot_mapping

    def write_kv(self, k: Tensor, v: Tensor, kv_cache: KVCache) -> None:
        """k/v [T, Hkv, hd] into the cache at the step's slots (no attention)."""
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        slots = self.meta.slot_mapping
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, scale: float) -> Tensor:
        """q [T, H, hd], k/v [T, Hkv, hd] (already rotated) -> [T, H, hd]."""
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        self.write_kv(k, v, kv_cache)  # first: the spans below read their own new keys back

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for chunk in self.chunks:
            rows = chunk.rows
            if self.chunk_kernel is not None:
                with profiled("tokenflow::chunk_attention"):
                    self.chunk_kernel(out[rows], q[rows], k_cache, v_cache, chunk.block_ids,
                                      chunk.context_len, scale)
                continue
            q_span = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if chunk.block_ids is None:
                # The chunk is the whole context: its fresh K/V equal what was just written.
                k_span, v_span = k[rows], v[rows]
            else:
                ctx = chunk.context_len
                k_span = self._gather(0, k_cache, chunk.block_ids)[:ctx]  # [ctx, Hkv, hd]
                v_span = self._gather(1, v_cache, chunk.block_ids)[:ctx]
            k_span = k_span.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, hd]
            v_span = v_span.to(q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q_span, k_span, v_span, attn_mask=chunk.mask,
                is_causal=chunk.block_ids is None and chunk.mask is None,
                scale=scale, enable_gqa=True,
            )  # [1, H, n, hd]
            out[rows] = o[0].transpose(0, 1)

        nd = self.meta.num_decodes
        if self.decode_kernel is not None and nd:
            with profiled("tokenflow::decode_attention"):
                self.decode_kernel(out[:nd], q[:nd], k_cache, v_cache,
                                   self.meta.block_table[:nd], self.meta.seq_lens[:nd], scale)
        num_groups = q.shape[1] // num_kv_heads  # query heads per KV head
        for group in self.decodes:
            # A KV head's query heads as its query rows: [g, Hkv, H/Hkv, hd] (query head h
            # reads KV head h // (H/Hkv), as enable_gqa does). Each KV row is then read once
            # for all of them, not once per query head: decode attention ran 2x faster.
            g = group.rows.stop - group.rows.start
            q_dec = q[group.rows].reshape(g, num_kv_heads, num_groups, head_dim)
            keys = slice(0, group.num_keys)  # drop the padding common to all rows
            k_dec = _read_blocks(k_cache, group.block_table)[:, keys].to(q.dtype).transpose(1, 2)
            v_dec = _read_blocks(v_cache, group.block_table)[:, keys].to(q.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q_dec, k_dec, v_dec, attn_mask=group.mask, scale=scale
            )  # [g, Hkv, H/Hkv, hd]
            out[group.rows] = o.reshape(g, -1, head_dim)
        return out


class TorchBackend:
    name = "torch"
    supports_cuda_graphs = False

    def __init__(self, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                 group_waste_bytes: int = 512 * 1024,
                 decode_kernel: DecodeKernel | None = None,
                 chunk_kernel: ChunkKernel | None = None) -> None:
        self.dtype = dtype
        self.decode_kernel = decode_kernel
        self.chunk_kernel = chunk_kernel
        if decode_kernel is not None:
            self.name = "cpu"
        # Padding of a decode group, in keys: K and V rows of every KV head.
        key_bytes = 2 * num_kv_heads * head_dim * dtype.itemsize
        self.max_group_padding = group_waste_bytes // key_bytes

    def prepare(self, meta: StepMetadata) -> TorchAttentionStep:
        return TorchAttentionStep(meta, self.dtype, self.max_group_padding, self.decode_kernel,
                                  self.chunk_kernel)
