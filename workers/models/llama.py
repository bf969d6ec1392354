"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat, paged batch.

Parameter names match Hugging Face exactly (`model.layers.{i}.self_attn.q_proj.weight`, ...), so
a HF state dict loads with a strict `load_state_dict`. Shapes in comments: T = tokens in the
flat batch, H = query heads, Hkv = KV heads, hd = head_dim, S = sampled rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.attention import AttentionMetadata, KVCache, paged_attention
from workers.model_config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and scale after casting back, the order transformers uses.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> Tensor:
    """[hd/2] fp32 inverse frequencies, with llama3 frequency-dependent scaling if configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
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
        """positions [T] global offsets -> cos, sin [T, hd] (computed in fp32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, hd]; rotate-half layout (first half paired with second half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, hd]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, H, hd]
        return self.o_proj(o.reshape(num_tokens, -1))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def tie_weights(self) -> None:
        """Share the output projection with the embedding (call again after `assign` loads)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rotary(self, device: torch.device) -> None:
        """Recompute the derived rope buffer (needed after building the model on `meta`)."""
        self.rotary_emb = RotaryEmbedding(self.config.head_dim, self.config.rope).to(device)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [T, hd] each, shared by all layers
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in fp32."""
        return self.lm_head(hidden).float()
