"""Triton kernels of the CUDA attention path: paged K/V straight from the cache.

Layouts (see `workers/attention/metadata.py`): q and out `[T, H, hd]` (any row and head
strides, unit stride inside a head), the caches `[num_blocks, block_size, Hkv, hd]` contiguous,
so slot `s` of the flattened `[num_blocks * block_size, Hkv, hd]` view holds one token.

- `write_kv`: one program per token stores its K and V rows at `slot_mapping[t]` (nothing for
  a slot of -1: CUDA-graph padding).
- `unified_attention`: one kernel for any mix of prefill chunks and decodes. A program takes
  `BLOCK_Q` query tokens of one sequence and one KV head, with all `GROUP = H / Hkv` query heads
  sharing it: its `BLOCK_M = BLOCK_Q * GROUP` rows are (token, head) pairs, so GQA needs no
  repeated K/V and each K/V tile is loaded once for the whole group. Keys are read in tiles of
  `TILE_N` through the block table (block `pos // block_size`, offset `pos % block_size`, for
  any block size), causal against the query's global position (`seq_len - q_len + i`), hence
  full over earlier chunks and prefix-cached blocks; only the tiles that cross the causal
  diagonal of the program's rows are masked. Online softmax in fp32 (exp2, scale folded
  into log2 units); fp32 inputs use IEEE dots (no TF32). Sequence of a program: the q-block
  index of sequence i starts at `query_start[i] // BLOCK_Q + i` (vLLM's trick), so the grid is
  `T // BLOCK_Q + S` programs per KV head, known on the host without reading the device, and a
  binary search finds each program's sequence; spare programs return at once.
- `split_decode_attention`: flash-decoding for 1-token sequences with long contexts and few
  programs: each (sequence, KV head) is cut into `num_splits` key ranges whose partial
  outputs and log-sum-exps a second kernel merges.

Both attention kernels run their key loop through `_attend_tile` (one K/V tile: load through the
block table, scores, masking, online-softmax update), so the numerics exist once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # upper bound of `num_splits` (a runtime value: no recompile per split count)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    ok = offs < NUM_KV_HEADS * HEAD_DIM
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=ok)
    dst = slot * stride_cs + head * stride_ch + dim
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v [T, Hkv, hd] -> k_cache, v_cache at `slot_mapping` [T] (-1: skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    block = next_pow2(num_kv_heads * head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=block,
        num_warps=4 if block >= 512 else 2,
    )


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_t, stride_qt, stride_qh, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_P)
    d_ok = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + offs_d, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + offs_d, mask=d_ok, other=0.0)[None, :]
    row = qkv_ptr + token * stride_t
    # Query heads: rotated into q_out.
    offs_h = tl.arange(0, HEADS_P)
    ok = (offs_h < NUM_HEADS)[:, None] & d_ok[None, :]
    src = row + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = q_out_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=ok)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # CUDA-graph padding: nothing written
        return
    # Key heads: rotated into the cache; value heads copied.
    offs_kh = tl.arange(0, KV_HEADS_P)
    kv_ok = (offs_kh < NUM_KV_HEADS)[:, None] & d_ok[None, :]
    src = row + (NUM_HEADS + offs_kh[:, None]) * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(src, mask=kv_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=kv_ok, other=0.0).to(tl.float32)
    dst = slot * stride_cs + offs_kh[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, (x1 * cos - x2 * sin).to(k_cache_ptr.dtype.element_ty),
             mask=kv_ok)
    tl.store(k_cache_ptr + dst + HALF, (x2 * cos + x1 * sin).to(k_cache_ptr.dtype.element_ty),
             mask=kv_ok)
    src = src + NUM_KV_HEADS * HEAD_DIM
    v1 = tl.load(src, mask=kv_ok, other=0.0)
    v2 = tl.load(src + HALF, mask=kv_ok, other=0.0)
    tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)


def rope_write_kv(qkv: Tensor, cos_sin: Tensor, positions: Tensor, slot_mapping: Tensor,
                  k_cache: Tensor, v_cache: Tensor, num_heads: int) -> Tensor:
    """The fused layer's rotary and KV write in one kernel: qkv [T, (H + 2 Hkv) hd] (the fused
    projection's output, q then k then v heads), cos_sin [max_pos, hd] fp32 (cos of each
    position in the first half, sin in the second) -> rotated q [T, H, hd]; the rotated k and
    v are written at `slot_mapping` (-1: skipped). Rotate-half layout, products in fp32,
    rounded once to the model dtype."""
    num_tokens, width = qkv.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert width == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    half = head_dim // 2
    _rope_write_kv_kernel[(num_tokens,)](
        qkv, cos_sin, positions, slot_mapping, q, k_cache, v_cache,
        qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        HALF_P=next_pow2(half), HEADS_P=next_pow2(num_heads), KV_HEADS_P=next_pow2(num_kv_heads),
        num_warps=4,
    )
    return q


@triton.jit
def _dim_mask(offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """Lanes inside the head. All-true as a constant when no padding: a mask that varies along
    the contiguous dimension would stop the compiler from vectorising the loads (it costs
    registers and bandwidth, measured in ptxas' register counts)."""
    if HEAD_DIM_P == HEAD_DIM:
        return tl.full([HEAD_DIM_P], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start_n, kv_end, q_pos,
    k_cache_ptr, v_cache_ptr, table_row, head_off, stride_cs, scale_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over keys `start_n .. start_n + TILE_N` (those `< kv_end`) of
    the sequence whose block-table row is `table_row`, for the rows of `q` [M, HEAD_DIM_P]:
    returns the updated (m_i [M], l_i [M], acc [M, HEAD_DIM_P]), in log2 units (`scale_log2`
    folds the softmax scale and log2(e)). With CAUSAL, row r also drops keys past `q_pos[r]`
    (its global position); without, `q_pos` is not read. The only copy of the numerics: every
    attention kernel calls it, so a fix to masking or softmax reaches them all."""
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = _dim_mask(offs_d, HEAD_DIM, HEAD_DIM_P)
    offs_n = start_n + tl.arange(0, TILE_N)
    n_ok = offs_n < kv_end
    block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    row = slot * stride_cs + head_off  # [TILE_N] element offsets of the keys' rows
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_P]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, TILE_N]
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    else:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_P]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _find_seq(query_start_ptr, seq_begin, base, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest i < num_seqs with (query_start[seq_begin + i] - base) // BLOCK_Q + i <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_ptr + seq_begin + mid) - base
        if start // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["seq_begin", "num_seqs", "stride_bt"])
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_ptr, seq_lens_ptr, block_table_ptr,
    seq_begin, num_seqs, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cs, stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    base = tl.load(query_start_ptr + seq_begin)
    idx = _find_seq(query_start_ptr, seq_begin, base, num_seqs, q_block, BLOCK_Q)
    seq = seq_begin + idx
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local = q_block - ((q_start - base) // BLOCK_Q + idx)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local * BLOCK_Q + offs_m // GROUP  # query token within the sequence's span
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = seq_len - q_len + q_idx  # global position: sees keys 0..q_pos
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = _dim_mask(offs_d, HEAD_DIM, HEAD_DIM_P)
    token = (q_start + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    # Keys any row of this program sees: 0 .. (its last query's position).
    kv_end = seq_len - q_len + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    # Keys every row sees (0 .. the first query's position): whole tiles of them need no
    # causal mask; only the tiles from there to kv_end cross the diagonal.
    num_full = (seq_len - q_len + local * BLOCK_Q + 1) // TILE_N * TILE_N
    for start_n in range(0, num_full, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, kv_end, q_pos,
            k_cache_ptr, v_cache_ptr, table_row, head_off, stride_cs, scale_log2,
            HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, CAUSAL=False, PRECISION=PRECISION)
    for start_n in range(num_full, kv_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, kv_end, q_pos,
            k_cache_ptr, v_cache_ptr, table_row, head_off, stride_cs, scale_log2,
            HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, CAUSAL=True, PRECISION=PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key (padding): zeros
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _precision(q: Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only applies to fp32 inputs


def unified_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, scale: float, *,
    seq_begin: int, num_seqs: int, num_tokens: int,
    block_m: int = 16, tile_n: int = 32, num_warps: int = 4, num_stages: int = 2,
) -> None:
    """Attention of sequences `seq_begin .. seq_begin + num_seqs` (holding `num_tokens` query
    tokens) into `out`. `block_m` rows per program: a power of two >= the GQA group."""
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert block_m >= group and q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
        seq_begin, num_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=max(next_pow2(head_dim), 16),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        PRECISION=_precision(q), num_warps=num_warps, num_stages=num_stages,
    )


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _split_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
    query_start_ptr, seq_lens_ptr, block_table_ptr, num_splits, scale_log2,
    stride_qt, stride_qh, stride_bt, stride_cs, stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    begin = split * per_split
    end = tl.minimum(begin + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = _dim_mask(offs_d, HEAD_DIM, HEAD_DIM_P)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_P], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    for start_n in range(begin, end, TILE_N):
        # Not causal: the one query token is the sequence's last, it sees every key < end.
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start_n, end, seq_len - 1,
            k_cache_ptr, v_cache_ptr, table_row, head_off, stride_cs, scale_log2,
            HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, CAUSAL=False, PRECISION=PRECISION)
    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    row = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + head) * MAX_SPLITS + split
    tl.store(part_lse_ptr + row, lse, mask=h_ok)
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :], out,
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _split_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_ptr, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    offs_s = tl.arange(0, MAX_SPLITS)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = _dim_mask(offs_d, HEAD_DIM, HEAD_DIM_P)
    lse = tl.load(part_lse_ptr + row * MAX_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for empty splits
    total = tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + (row * MAX_SPLITS + offs_s)[:, None] * HEAD_DIM_P
                    + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, scale: float, *,
    num_seqs: int, num_splits: int, tile_n: int = 64, num_warps: int = 4, num_stages: int = 2,
) -> None:
    """Flash-decoding of sequences 0 .. num_seqs (one query token each) into `out`."""
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert 1 <= num_splits <= MAX_SPLITS and q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    head_dim_p = max(next_pow2(head_dim), 16)
    part_out = torch.empty((num_seqs, num_heads, MAX_SPLITS, head_dim_p), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((num_seqs, num_heads, MAX_SPLITS), dtype=torch.float32,
                           device=q.device)
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, query_start_loc, seq_lens, block_table,
        num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), block_table.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size,
        BLOCK_H=max(next_pow2(group), 16), TILE_N=tile_n, MAX_SPLITS=MAX_SPLITS,
        PRECISION=_precision(q), num_warps=num_warps, num_stages=num_stages,
    )
    _split_merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, query_start_loc, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, MAX_SPLITS=MAX_SPLITS, num_warps=1,
    )
