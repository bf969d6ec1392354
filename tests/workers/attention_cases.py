"""Random paged-attention steps and a naive reference, shared by the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from workers.attention import HostStaging, SeqSpan, StepMetadata
from workers.attention.torch_backend import TorchBackend

# (num_computed, num_query_tokens) per sequence, in the worker's flat order: decodes first,
# longest context first, then prefill chunks. Decodes cross block boundaries (1, 16, 33, 47
# keys); chunk (17, 9) continues a request over its cached blocks, (30, 14) crosses from one
# block into the next, (0, 11) is a fresh prompt.
MIXED = [(46, 1), (32, 1), (15, 1), (0, 1), (17, 9), (30, 14), (0, 11)]


def fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into an int (`range(0, n)` with a runtime `n`)
    by `int(array)`, and its scalars are 1-element arrays, which NumPy >= 2.4 refuses: patched
    to take the one element. Only for interpreter runs (triton_interpreted.py)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_tokenflow_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tokenflow_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


@dataclass
class Case:
    meta: StepMetadata
    q: Tensor  # [T, H, hd]
    k: Tensor  # [T, Hkv, hd]
    v: Tensor
    k_cache: Tensor  # [NB, bs, Hkv, hd], earlier tokens already written
    v_cache: Tensor
    spans: list[SeqSpan]
    scale: float


def make_case(
    shape: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, seed: int = 0, dtype: torch.dtype = torch.float32, pad_to: int | None = None,
    strided: bool = True,
) -> Case:
    """`shape`: (num_computed, num_query_tokens) per sequence, in flat-batch order. Blocks are a
    random permutation of the pool (so neighbours in a table are not neighbours in memory);
    the cache holds random K/V everywhere, i.e. for every computed (prefix-cached) token.
    `strided`: q, k and v are column slices of one fused qkv tensor, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-(done + n) // block_size) + 1 for done, n in shape]  # one spare
    num_blocks = sum(blocks_per_seq) + 3
    order = rng.permutation(num_blocks)
    spans, start, used = [], 0, 0
    for (done, n), nb in zip(shape, blocks_per_seq, strict=True):
        spans.append(SeqSpan(start, n, done + n, order[used : used + nb].astype(np.int64)))
        start, used = start + n, used + nb
    num_tokens = start
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen)
    if pad_to is not None:  # padding rows: anything (their outputs are discarded)
        qkv = torch.cat([qkv, torch.randn(pad_to - len(shape), width)])
    qkv = qkv.to(dtype)
    if not strided:
        qkv = qkv.clone()
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        -1, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ids = rng.integers(3, 100, num_tokens)
    meta = StepMetadata.build(spans, ids, block_size, HostStaging(torch.device("cpu")),
                              pad_to=pad_to)
    return Case(meta, q, k, v, k_cache, v_cache, spans, head_dim**-0.5)


def reference_attention(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """Token by token in float64: the written caches and the attention output [T, H, hd]."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    slots = case.meta.slot_mapping[: case.meta.num_real_tokens]
    flat_k[slots] = case.k[: len(slots)].to(k_cache.dtype)
    flat_v[slots] = case.v[: len(slots)].to(v_cache.dtype)
    num_heads = case.q.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    bs = k_cache.shape[1]
    for span in case.spans:
        ctx = span.context_len
        key_slots = [int(span.block_ids[j // bs]) * bs + j % bs for j in range(ctx)]
        keys = flat_k[key_slots].double()  # [ctx, Hkv, hd]
        values = flat_v[key_slots].double()
        for i in range(span.num_query_tokens):
            pos = ctx - span.num_query_tokens + i
            row = span.query_start + i
            for h in range(num_heads):
                scores = keys[: pos + 1, h // group] @ case.q[row, h].double() * case.scale
                out[row, h] = scores.softmax(0) @ values[: pos + 1, h // group]
    return out, k_cache, v_cache


def torch_reference(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """The torch backend's output and written caches (the reference the kernels must equal)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    _, _, num_kv_heads, head_dim = case.k_cache.shape
    step = TorchBackend(case.q.dtype, num_kv_heads, head_dim).prepare(case.meta)
    out = step.forward(case.q, case.k, case.v, (k_cache, v_cache), case.scale)
    return out, k_cache, v_cache
