"""The Triton attention backend (CUDA default): kernels in `triton_kernels.py`.

Per layer: one KV-write launch and one or two attention launches, all of whose arguments were
decided once per step by `prepare` (host ints only; nothing read back from the device):
- the decode sequences (the step's leading 1-token spans) go to the split-K decode kernel
  when they are too few to fill the GPU (`decode_splits`), else to the unified kernel with
  small programs (`decode` config: 16 rows, i.e. one token times the GQA group);
- the rest (prefill chunks, mixed in any way with earlier context) go to the unified kernel
  with large programs (`prefill` config).
A CUDA-graph capture prepares with `max_seq_len=None`: the split count then depends on the
batch size only, so the captured launches are right for any context.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from workers.attention.metadata import StepMetadata

KVCache = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows (query token x head of the group) per program
    tile_n: int  # keys per inner iteration
    num_warps: int = 4
    num_stages: int = 2


def default_configs(
    group: int, head_dim: int, dtype: torch.dtype
) -> tuple[LaunchConfig, LaunchConfig, LaunchConfig]:
    """(decode, prefill, split-decode) launch sizes for Hopper (sm_90). Chosen so that ptxas
    reports no register spills for head_dim 64 and 128 (compiled offline, from this repo's
    kernels, for sm_90a): bf16 prefill 128 x 64 tiles on 8 warps (wgmma); decode 16 rows
    (one token x the GQA group, padded) x 64 keys on 4 warps. fp32 (IEEE dots, no tensor
    cores: the exactness runs) needs smaller tiles and 8 warps. Not tuned by measurement yet."""
    wide = max(1 << (group - 1).bit_length(), 16)
    if dtype == torch.float32 or head_dim > 128:
        decode = LaunchConfig(block_m=wide, tile_n=32 if head_dim <= 128 else 16, num_warps=8)
        prefill = LaunchConfig(block_m=max(32, wide), tile_n=16, num_warps=8)
        split = LaunchConfig(block_m=wide, tile_n=32 if head_dim <= 128 else 16, num_warps=8)
        return decode, prefill, split
    decode = LaunchConfig(block_m=wide, tile_n=64, num_warps=4)
    prefill = LaunchConfig(block_m=max(128, wide), tile_n=64, num_warps=8)
    split = LaunchConfig(block_m=wide, tile_n=64, num_warps=4)
    return decode, prefill, split


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_seq_len: int | None,
                  max_splits: int = 16, min_keys_per_split: int = 256) -> int:
    """Key-range splits per decode (flash-decoding): 1 when `num_seqs * num_kv_heads`
    programs fill the multiprocessors already, else enough for about two waves, at most
    `max_splits`, each split at least `min_keys_per_split` keys where the context is known;
    a power of two."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = min(max_splits, -(-2 * num_sms // programs))
    if max_seq_len is not None:
        splits = min(splits, max(1, max_seq_len // min_keys_per_split))
    return 1 << (splits.bit_length() - 1)


class TritonAttentionStep:
    def __init__(self, backend: TritonBackend, meta: StepMetadata) -> None:
        self.meta, self.k = meta, backend.kernels
        self.decode_cfg, self.prefill_cfg = backend.decode_config, backend.prefill_config
        self.split_cfg = backend.split_config
        self.num_splits = 1
        if meta.num_decodes:
            self.num_splits = decode_splits(meta.num_decodes, backend.num_kv_heads,
                                            backend.num_sms, meta.max_seq_len)
        # Tokens of the leading decode sequences: one each.
        self.num_decode_tokens = meta.num_decodes

    def write_kv(self, k: Tensor, v: Tensor, kv_cache: KVCache) -> None:
        k_cache, v_cache = kv_cache
        self.k.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, scale: float) -> Tensor:
        """q [T, H, hd], k/v [T, Hkv, hd] (already rotated; strided views are fine)."""
        self.write_kv(k, v, kv_cache)
        return self._attend(q, kv_cache, scale)

    def forward_rotary(self, qkv: Tensor, cos_sin: Tensor, kv_cache: KVCache,
                       scale: float, num_heads: int) -> Tensor:
        """The fused layer's attention (workers/kernels/fused_llama.py): qkv [T, (H + 2 Hkv)
        hd] not yet rotated -> [T, H, hd]. Rotary and the KV write are one kernel
        (`rope_write_kv`, positions from the step's metadata), then the attention launches."""
        k_cache, v_cache = kv_cache
        q = self.k.rope_write_kv(qkv, cos_sin, self.meta.positions, self.meta.slot_mapping,
                                 k_cache, v_cache, num_heads)
        return self._attend(q, kv_cache, scale)

    def _attend(self, q: Tensor, kv_cache: KVCache, scale: float) -> Tensor:
        meta, kernels = self.meta, self.k
        k_cache, v_cache = kv_cache
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        args = (q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                meta.block_table, scale)
        num_decodes = meta.num_decodes
        if num_decodes and self.num_splits > 1:
            cfg = self.split_cfg
            kernels.split_decode_attention(
                *args, num_seqs=num_decodes, num_splits=self.num_splits, tile_n=cfg.tile_n,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        elif num_decodes:
            cfg = self.decode_cfg
            kernels.unified_attention(
                *args, seq_begin=0, num_seqs=num_decodes, num_tokens=self.num_decode_tokens,
                block_m=cfg.block_m, tile_n=cfg.tile_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
        if meta.num_seqs > num_decodes:
            cfg = self.prefill_cfg
            kernels.unified_attention(
                *args, seq_begin=num_decodes, num_seqs=meta.num_seqs - num_decodes,
                num_tokens=meta.num_tokens - self.num_decode_tokens,
                block_m=cfg.block_m, tile_n=cfg.tile_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
        return out


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, *, kernels: ModuleType | None = None, num_sms: int | None = None,
        decode_config: LaunchConfig | None = None, prefill_config: LaunchConfig | None = None,
        split_config: LaunchConfig | None = None,
    ) -> None:
        """`kernels`: the module holding the kernels (tests pass a copy loaded under the Triton
        interpreter); `num_sms`: multiprocessors (read off the device by default)."""
        if kernels is None:
            from workers.attention import triton_kernels as kernels
        self.kernels = kernels
        self.num_kv_heads = num_kv_heads
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                       if device.type == "cuda" else 132)
        self.num_sms = num_sms
        decode, prefill, split = default_configs(num_heads // num_kv_heads, head_dim, dtype)
        self.decode_config = decode_config or decode
        self.prefill_config = prefill_config or prefill
        self.split_config = split_config or split

    def prepare(self, meta: StepMetadata) -> TritonAttentionStep:
        return TritonAttentionStep(self, meta)
