"""A decode-only step's layers in one C++ call (CPU fp32 worker, `worker.cpu_decode_stack`).

Why: at a decode step's few dozen rows the layers' kernels are short (the GEMMs 80-250 us,
the norms and rotary a few us each) and the Python loop around them (module calls, views,
slices, the KV write, the attention step's checks) is ~15 dispatches a layer, during which
torch's other threads wait: a few percent of an offline run's time on a 2-core CPU. The C++
stack (workers/kernels/csrc/cpu_stack.cpp) runs the same kernels in the same order on the
same inputs, so its hidden states are bit-equal to `LlamaForCausalLM._forward_cpu_layers`'s.

Taken only where that holds: fp32 weights and cache, the C++ layers and attention, every
linear layer with its C++ decode GEMM copy (`PackedLinear.decode_packed`), at most
`decode_max_rows` rows, every row a decode (no chunk, no padding) and every row sampled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from workers.attention import KVCache
from workers.models.packed import PackedLinear

PROFILER_NAME = "tokenflow::decode_stack"  # the stack's range in torch's profiler


def _decode_copy(linear: Any) -> tuple[Tensor, Tensor, int] | None:
    """(packed, bias or an empty tensor, max rows) of a linear with a C++ decode GEMM copy."""
    if not isinstance(linear, PackedLinear) or linear.decode_packed is None:
        return None
    bias = linear.bias if linear.bias is not None else torch.empty(0)
    return linear.decode_packed, bias, linear.decode_max_rows


class DecodeStack:
    """The model's layers over `kv_caches` as one C++ object; `forward` takes an all-decode
    step's embeddings."""

    def __init__(self, stack: Any, max_rows: int) -> None:
        self._stack, self.max_rows = stack, max_rows

    @classmethod
    def build(cls, model: Any, kv_caches: list[KVCache]) -> DecodeStack | None:
        """The stack of `model` (a `LlamaForCausalLM` with its C++ layers set), or None where
        any layer lacks what it needs (see the module's docstring)."""
        ops = model.cpu_layers
        if ops is None or not hasattr(ops, "DecodeStack") \
                or model.lm_head.weight.dtype != torch.float32:
            return None
        layers, max_rows = [], 1 << 30
        for layer, (k_cache, v_cache) in zip(model.model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            copies = [_decode_copy(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_proj,
                                                mlp.up_proj, mlp.down_proj)]
            caches_ok = all(c.dtype == torch.float32 and c.device.type == "cpu"
                            and c.is_contiguous() for c in (k_cache, v_cache))
            if any(c is None for c in copies) or not caches_ok:
                return None
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for packed, bias, rows in copies:  # type: ignore[misc]
                tensors += [packed, bias]
                max_rows = min(max_rows, rows)
            layers.append([t.detach() for t in tensors] + [k_cache, v_cache])
        first = model.model.layers[0].self_attn
        cfg = model.config
        stack = ops.DecodeStack(layers, model.model.norm.weight.detach(), cfg.rms_norm_eps,
                                first.num_heads, first.num_kv_heads, first.head_dim,
                                first.scale)
        return cls(stack, max_rows)

    def inputs(self, x: Tensor, attn: Any) -> tuple[Tensor, Tensor, Tensor] | None:
        """The step's (block_table, seq_lens, slot_mapping) where the stack runs it, else
        None (the layer loop runs it)."""
        if x.dtype != torch.float32 or x.shape[0] > self.max_rows \
                or not hasattr(attn, "decode_only_inputs"):
            return None
        return attn.decode_only_inputs()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                inputs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """x [T, hidden] embeddings (this forward's own tensor: the residual stream, written
        in place), cos/sin [T, hd/2] fp32 -> final-normed hidden states [T, hidden]."""
        block_table, seq_lens, slots = inputs
        # Named for torch's profiler, which sees no operator inside the C++ call (one range
        # a step: ~µs against a step's milliseconds).
        with torch.profiler.record_function(PROFILER_NAME):
            return self._stack.forward(x, cos, sin, block_table, seq_lens, slots)
