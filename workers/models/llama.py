"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat, paged batch.

Parameter names match Hugging Face exactly (`model.layers.{i}.self_attn.q_proj.weight`, ...), so
a HF state dict loads with a strict `load_state_dict`. Shapes in comments: T = tokens in the
flat batch, H = query heads, Hkv = KV heads, hd = head_dim, S = sampled rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.attention import AttentionStep, KVCache
from workers.model_config import ModelConfig, RopeConfig
from workers.models.packed import PACKED_DTYPE_TOL, maybe_pack
from workers.sampled_rows import SampledRows
from workers.sections import PackPolicy


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and scale after casting back, the order transformers uses; the
        # in-place ops only touch temporaries (one allocation fewer per norm).
        x32 = x.float()
        inv_rms = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x32 * inv_rms).to(x.dtype).mul_(self.weight)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> Tensor:
    """[hd/2] fp32 inverse frequencies, with llama3 frequency-dependent scaling if configured.

    On the CPU even while a model is built on `meta`: real values are cheap, and torch's
    first meta op imports its decompositions (~1.5 s of start-up)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.rope_theta**exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] global offsets -> cos, sin [T, hd/2] (computed in fp32).

        transformers builds [T, hd] tables from `cat(freqs, freqs)`; both halves are equal, so
        half tables give the same values at half the trigonometry."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, hd]; rotate-half layout (first half paired with second half).

    Written per half: (x1·c − x2·s, x2·c + x1·s) is, operation for operation, transformers'
    `x·cos + rotate_half(x)·sin` (negation is exact), without building the rotated copy."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    """q/k/v load under their Hugging Face names; `fuse()` (called by the loader) then merges
    them into one `qkv_proj`: one GEMM and one rotary pass over the adjacent q and k columns
    instead of three GEMMs and two passes (fewer ops per layer; the GEMM time itself is the
    same, see benchmarks/README.md)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qkv_proj: nn.Module | None = None

    def fuse(self) -> None:
        self.qkv_proj = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def pack(self, policy: PackPolicy) -> None:
        assert self.qkv_proj is not None, "fuse before packing"
        self.qkv_proj = maybe_pack(self.qkv_proj, policy)
        self.o_proj = maybe_pack(self.o_proj, policy)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, attn: AttentionStep
    ) -> Tensor:
        assert self.qkv_proj is not None, "call LlamaForCausalLM.fuse_projections() first"
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) hd]
        # q and k are adjacent columns: rotate them in one pass.
        qk = apply_rotary(qkv[:, : num_qk_heads * self.head_dim].view(
            num_tokens, num_qk_heads, self.head_dim), cos, sin)  # [T, H + Hkv, hd]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, num_qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, -1)
        o = attn.forward(q, k, v, kv_cache, self.scale)  # [T, H, hd]
        return self.o_proj(o.view(num_tokens, -1))  # [T, hidden]


class MLP(nn.Module):
    # gate/up are deliberately NOT fused like q/k/v: measured on CPU, one [hidden, 2*inter]
    # GEMM was no faster than two (plain or packed), and its strided halves made the SiLU
    # and product passes slower.
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def pack(self, policy: PackPolicy) -> None:
        self.gate_proj = maybe_pack(self.gate_proj, policy)
        self.up_proj = maybe_pack(self.up_proj, policy)
        self.down_proj = maybe_pack(self.down_proj, policy)

    def forward(self, x: Tensor) -> Tensor:
        # silu's output is a fresh temporary, so the product can be taken in place.
        return self.down_proj(F.silu(self.gate_proj(x)).mul_(self.up_proj(x)))  # [T, hidden]


def _fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs (same input)."""
    weight = torch.cat([lin.weight for lin in linears], dim=0)
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias,
                      device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, attn: AttentionStep
    ) -> Tensor:
        # In place: the residual stream is this forward's own tensor, never a caller's.
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # The C++ elementwise layers (workers/kernels/csrc/cpu_layers.cpp), set by a CPU fp32
        # or bf16 worker (workers/cpu_setup.py); None: torch's operators.
        self.cpu_layers: Any = None
        # A decode-only step's layers in one C++ call (workers/decode_stack.py), set by a CPU
        # fp32 worker once its KV cache exists; None: the layer loop.
        self.decode_stack: Any = None

    def tie_weights(self) -> None:
        """Share the output projection with the embedding (call again after `assign` loads)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Merge q/k/v into one matmul (after loading HF-named weights).

        Parameter count and values are unchanged; only the module names change."""
        for layer in self.model.layers:
            layer.self_attn.fuse()

    def reset_rotary(self, device: torch.device) -> None:
        """Recompute the derived rope buffer (needed after building the model on `meta`)."""
        self.rotary_emb = RotaryEmbedding(self.config.head_dim, self.config.rope).to(device)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionStep,
        kv_caches: list[KVCache],
        sampled: SampledRows | None = None,
    ) -> Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]. `attn`: the
        step's attention (`backend.prepare(meta)`), called by every layer. With `sampled`
        (only where `runs_cpu_layers`): [S, hidden], the last layer run on the sampled
        rows alone (workers/sampled_rows.py)."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.runs_cpu_layers(x.dtype, x.device):
            # The C++ rotary takes fp32 tables whatever the model's dtype (bf16 rotated in fp32).
            cos, sin = self.rotary_emb(positions, torch.float32)  # [T, hd/2] each
            stack = self.decode_stack
            inputs = None if stack is None or sampled is not None else stack.inputs(x, attn)
            if inputs is not None:  # bit-equal to the loop below, in one call
                return stack.forward(x, cos, sin, inputs)
            return self._forward_cpu_layers(x, cos, sin, attn, kv_caches, sampled)
        cos, sin = self.rotary_emb(positions, x.dtype)  # [T, hd/2] each, shared by all layers
        assert sampled is None, "the last layer on sampled rows is the C++ layers' path"
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn)
        return self.model.norm(x)

    def runs_cpu_layers(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `forward` runs the C++ layers (CPU fp32 or bf16, where they built) for a
        step of this dtype on this device: the only path that takes `sampled`."""
        return (self.cpu_layers is not None and dtype in (torch.float32, torch.bfloat16)
                and device.type == "cpu")

    def _forward_cpu_layers(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionStep,
                            kv_caches: list[KVCache], sampled: SampledRows | None) -> Tensor:
        """The same layers with their elementwise work in C++ passes: each residual add is
        fused into the norm that follows it (the MLP's into the next layer's input norm,
        the last into the final norm); rotary runs in place on qkv's q and k columns."""
        ops, eps = self.cpu_layers, self.config.rms_norm_eps
        delta: Tensor | None = None  # the MLP output not yet added to the residual x
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            attn_mod, mlp = layer.self_attn, layer.mlp
            h = ops.add_rms_norm(x, delta, layer.input_layernorm.weight, eps)  # [T, hidden]
            num_tokens, hd = h.shape[0], attn_mod.head_dim
            num_qk_heads = attn_mod.num_heads + attn_mod.num_kv_heads
            qkv = attn_mod.qkv_proj(h)  # [T, (H + 2 Hkv) hd]
            ops.rotary_(qkv, cos, sin, num_qk_heads, hd)
            q = qkv[:, : attn_mod.num_heads * hd].view(num_tokens, attn_mod.num_heads, hd)
            k = qkv[:, attn_mod.num_heads * hd : num_qk_heads * hd].view(
                num_tokens, attn_mod.num_kv_heads, hd)
            v = qkv[:, num_qk_heads * hd :].view(num_tokens, attn_mod.num_kv_heads, hd)
            if i == last and sampled is not None:
                # Every row's K/V for the steps to come; the rest for the sampled rows only.
                attn.write_kv(k, v, kv_cache)
                if sampled.attn is None:  # nothing samples: no row's output is read
                    return x.new_empty((0, x.shape[1]))
                rows = sampled.rows
                x, q, k, v = x[rows], q[rows], k[rows], v[rows]  # [S, ...]
                num_tokens, attn = rows.numel(), sampled.attn
            o = attn.forward(q, k, v, kv_cache, attn_mod.scale)  # [T, H, hd]
            h = ops.add_rms_norm(x, attn_mod.o_proj(o.view(num_tokens, -1)),
                                 layer.post_attention_layernorm.weight, eps)
            delta = mlp.down_proj(ops.silu_mul_(mlp.gate_proj(h), mlp.up_proj(h)))
        return ops.add_rms_norm(x, delta, self.model.norm.weight, eps)

    def pack_linears(self, policy: PackPolicy | None = None) -> None:
        """Give the linear layers oneDNN-packed weights (CPU fp32 or bf16; see
        workers/models/packed.py); a no-op elsewhere. Call after loading, fusing and tying."""
        weight = self.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPE_TOL:
            return
        policy = policy or PackPolicy()
        for layer in self.model.layers:
            layer.self_attn.pack(policy)
            layer.mlp.pack(policy)
        self.lm_head = maybe_pack(self.lm_head, policy)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32."""
        return self.lm_head(hidden).float()
