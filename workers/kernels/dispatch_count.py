"""Kernels per decode step of the CUDA path, counted without a GPU.

The CUDA path's own code (`FusedLlama`, the Triton attention step, logits, greedy sampling)
runs on `meta` tensors under a `TorchDispatchMode` that counts every ATen op that launches a
kernel (views and allocations launch none); the Triton wrappers are swapped for stand-ins
that count their launches (each real wrapper launches one kernel, the split decode two) and
return tensors of the right shape. What is counted is what a CUDA graph of the step holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from controller.messages import SamplingParams
from workers.attention import HostStaging, SeqSpan, StepMetadata
from workers.attention.triton_backend import TritonBackend
from workers.kernels.fused_llama import FusedLlama
from workers.model_config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.sampler import Sampler, SamplingRow

# ATen ops that launch no kernel (allocations, aliasing); views are recognised by `is_view`.
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "detach", "alias",
                       "lift_fresh", "split", "split_with_sizes", "unbind"})


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_KERNEL):
            self.ops[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


class CountingKernels:
    """The surface of `workers.kernels.fused` and `workers.attention.triton_kernels`: each
    call counts the launches the real wrapper makes."""

    def __init__(self, ops: Counter[str]) -> None:
        self.ops = ops

    def add_rmsnorm(self, delta: Tensor | None, residual: Tensor, weight: Tensor,
                    eps: float) -> Tensor:
        self.ops["triton::add_rmsnorm"] += 1
        return torch.empty_like(residual)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        self.ops["triton::silu_mul"] += 1
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    def write_kv(self, *args: Any) -> None:
        self.ops["triton::write_kv"] += 1

    def rope_write_kv(self, qkv: Tensor, cos_sin: Tensor, positions: Tensor, slots: Tensor,
                      k_cache: Tensor, v_cache: Tensor, num_heads: int) -> Tensor:
        self.ops["triton::rope_write_kv"] += 1
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[3])

    def unified_attention(self, *args: Any, **kwargs: Any) -> None:
        self.ops["triton::unified_attention"] += 1

    def split_decode_attention(self, *args: Any, **kwargs: Any) -> None:
        self.ops["triton::split_decode"] += 1
        self.ops["triton::split_merge"] += 1


def _to_meta(meta: StepMetadata) -> StepMetadata:
    fields = {f: getattr(meta, f) for f in meta.__dataclass_fields__}
    return StepMetadata(**{f: v.to("meta") if isinstance(v, Tensor) else v
                           for f, v in fields.items()})


def count_step(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
               block_size: int = 16, num_sms: int = 132, fused: bool = True,
               chunk: tuple[int, int] | None = None) -> Counter[str]:
    """Kernels of one decode-only step of `batch` sequences at `context` tokens, as captured
    in a CUDA graph (prepared without a known context), logits and greedy sampling included.
    `fused` False: the unfused torch layers (`LlamaForCausalLM.forward`) over the same
    attention kernels, for comparison. `chunk` (depth, tokens): a mixed step instead, the
    decodes plus one prefill chunk starting at `depth`, prepared as an eager step is; its
    count is also the ATen ops the host dispatches for it, one by one."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.fuse_projections()
    model.reset_rotary(torch.device("meta"))
    ops: Counter[str] = Counter()
    kernels = CountingKernels(ops)
    depth, chunk_len = chunk or (0, 0)
    num_positions = max(context, depth + chunk_len) + 1
    forward = FusedLlama(model, kernels=kernels, num_positions=num_positions) if fused else model
    backend = TritonBackend(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            dtype, torch.device("meta"), kernels=kernels, num_sms=num_sms)
    blocks = -(-context // block_size)
    spans = [SeqSpan(i, 1, context, np.arange(i * blocks, (i + 1) * blocks))
             for i in range(batch)]
    num_blocks = batch * blocks
    if chunk_len:
        chunk_blocks = -(-(depth + chunk_len) // block_size)
        spans.append(SeqSpan(batch, chunk_len, depth + chunk_len,
                             np.arange(num_blocks, num_blocks + chunk_blocks)))
        num_blocks += chunk_blocks
    num_tokens = batch + chunk_len
    rows_sampled = [*range(batch), *([num_tokens - 1] if chunk_len else [])]
    meta = StepMetadata.build(spans, np.zeros(num_tokens, np.int64), block_size,
                              HostStaging(torch.device("cpu")), logits_indices=rows_sampled)
    meta = _to_meta(meta)
    if not chunk_len:
        meta = replace(meta, max_seq_len=None)  # as a graph capture prepares it
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv_caches = [(torch.empty(shape, dtype=dtype, device="meta"),
                  torch.empty(shape, dtype=dtype, device="meta"))
                 for _ in range(cfg.num_hidden_layers)]
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0)] * len(rows_sampled)
    counter = OpCounter()
    with counter:
        attn = backend.prepare(meta)
        hidden = forward(meta.input_ids, meta.positions, attn, kv_caches)
        logits = model.compute_logits(hidden[meta.logits_indices])
        Sampler().ids_on_device(logits, rows)
    return ops + counter.ops


def count_decode_kernels(cfg: ModelConfig, batch: int, context: int,
                         dtype: torch.dtype = torch.bfloat16, fused: bool = True,
                         chunk: tuple[int, int] | None = None) -> dict[str, Any]:
    """-> {"per_step", "per_layer", "outside_layers", "per_layer_ops", "outside_layer_ops"}:
    a layer's kernels are the difference between the model and the same model one layer
    shorter (`cfg` needs two layers or more). `chunk`: a mixed step (see `count_step`)."""
    full = count_step(cfg, batch, context, dtype, fused=fused, chunk=chunk)
    shorter = count_step(replace(cfg, num_hidden_layers=cfg.num_hidden_layers - 1), batch,
                         context, dtype, fused=fused, chunk=chunk)
    layer = full - shorter
    outside = shorter - Counter({k: v * (cfg.num_hidden_layers - 1) for k, v in layer.items()})
    return {"batch": batch, "context": context, "num_layers": cfg.num_hidden_layers,
            "per_step": sum(full.values()), "per_layer": sum(layer.values()),
            "outside_layers": sum(outside.values()), "per_layer_ops": dict(layer),
            "outside_layer_ops": dict(outside)}
