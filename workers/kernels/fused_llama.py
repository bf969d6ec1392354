"""The Llama-family forward of the CUDA path: the same weights as `LlamaForCausalLM`, fewer
kernels per layer.

Per layer, in a decode step: residual-add + input RMSNorm (one kernel), the q/k/v GEMM,
rotary + KV write (one kernel, the attention's), attention (one launch, two when split), the
o GEMM, residual-add + post-attention RMSNorm, the merged gate/up GEMM, SiLU·mul, the down
GEMM: 9 or 10 launches. The MLP's residual add is fused into the next layer's norm (the
last one into the final norm). Same order of roundings as the torch path except inside
rotary (products in fp32, one rounding instead of three) and the norms' fp32 sums.

`kernels`: the module of the fused kernels (`workers.kernels.fused`); the tests pass one loaded
under the Triton interpreter, the dispatch counter one that counts launches.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.attention import KVCache
from workers.models.llama import LlamaForCausalLM, rope_inv_freq


def rope_table(model: LlamaForCausalLM, num_positions: int, device: torch.device,
               dtype: torch.dtype) -> Tensor:
    """[num_positions, hd] fp32: cos of each position's frequencies, then sin; computed as the
    torch path computes them (fp32) and rounded to the model dtype as it rounds them."""
    inv_freq = rope_inv_freq(model.config.head_dim, model.config.rope).to(device)
    pos = torch.arange(num_positions, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos().to(dtype).float(), freqs.sin().to(dtype).float()), dim=-1)


def merge_gate_up(model: LlamaForCausalLM) -> list[tuple[Tensor, Tensor | None]]:
    """Per layer one [2 I, hidden] weight (gate rows first) and bias; gate_proj and up_proj
    keep their names and become views of it, so no memory is duplicated."""
    merged = []
    for layer in model.model.layers:
        mlp = layer.mlp
        inter = mlp.gate_proj.weight.shape[0]
        weight = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
        mlp.gate_proj.weight = nn.Parameter(weight[:inter], requires_grad=False)
        mlp.up_proj.weight = nn.Parameter(weight[inter:], requires_grad=False)
        bias = None
        if mlp.gate_proj.bias is not None:
            bias = torch.cat((mlp.gate_proj.bias, mlp.up_proj.bias))
            mlp.gate_proj.bias = nn.Parameter(bias[:inter], requires_grad=False)
            mlp.up_proj.bias = nn.Parameter(bias[inter:], requires_grad=False)
        merged.append((weight, bias))
    return merged


class FusedLlama:
    """Called like `LlamaForCausalLM.forward(input_ids, positions, attn, kv_caches)`, with an
    attention step that has `forward_rotary` (the Triton backend's)."""

    def __init__(self, model: LlamaForCausalLM, kernels: ModuleType | Any | None = None,
                 num_positions: int | None = None) -> None:
        if kernels is None:
            from workers.kernels import fused as kernels
        self.model, self.kernels = model, kernels
        weight = model.model.embed_tokens.weight
        cfg = model.config
        self.cos_sin = rope_table(model, num_positions or cfg.max_model_len, weight.device,
                                  weight.dtype)
        self.gate_up = merge_gate_up(model)
        self.eps = cfg.rms_norm_eps

    def __call__(self, input_ids: Tensor, positions: Tensor, attn: Any,
                 kv_caches: list[KVCache]) -> Tensor:
        """-> final-normed hidden states [T, hidden]. `positions` are the step metadata's,
        which `attn` reads itself."""
        k, eps, inner = self.kernels, self.eps, self.model.model
        num_tokens = input_ids.shape[0]
        residual = inner.embed_tokens(input_ids)  # [T, hidden], this forward's own tensor
        delta: Tensor | None = None
        for layer, kv_cache, (gate_up_w, gate_up_b) in zip(
                inner.layers, kv_caches, self.gate_up, strict=True):
            sa = layer.self_attn
            h = k.add_rmsnorm(delta, residual, layer.input_layernorm.weight, eps)
            o = attn.forward_rotary(sa.qkv_proj(h), self.cos_sin, kv_cache, sa.scale,
                                    sa.num_heads)  # [T, H, hd]
            h = k.add_rmsnorm(sa.o_proj(o.view(num_tokens, -1)), residual,
                              layer.post_attention_layernorm.weight, eps)
            delta = layer.mlp.down_proj(k.silu_mul(F.linear(h, gate_up_w, gate_up_b)))
        return k.add_rmsnorm(delta, residual, inner.norm.weight, eps)
