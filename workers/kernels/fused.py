"""Triton kernels of the fused decoder layer, with the numerics of the torch path.

- `add_rmsnorm(delta, residual, weight, eps)`: `residual += delta` (rounded to the model dtype,
  as torch's in-place add rounds), then RMSNorm of the new residual, transformers' order:
  normalise in fp32, cast to the model dtype, then scale by the weight. One program per row;
  the residual is updated in place, the normed rows are a new tensor.
- `silu_mul(gate_up)`: `silu(gate) * up` over the merged `[T, 2 I]` projection output (gate the
  first I columns): silu in fp32 rounded to the model dtype, then the product rounded, as
  `F.silu(g).mul_(u)` rounds.
Each wrapper launches exactly one kernel (`dispatch_count.py` relies on it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@triton.jit
def _add_rmsnorm_kernel(
    delta_ptr, residual_ptr, weight_ptr, out_ptr, stride_d, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rmsnorm(delta: Tensor | None, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """delta, residual [T, N] (residual updated in place: += delta) -> RMSNorm(residual) [T, N].
    `delta` None: only the norm (the first layer's input)."""
    num_rows, n = residual.shape
    assert residual.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((num_rows, n), dtype=residual.dtype, device=residual.device)
    if num_rows == 0:
        return out
    if delta is not None:
        assert delta.shape == residual.shape and delta.stride(1) == 1
    block = next_pow2(n)
    _add_rmsnorm_kernel[(num_rows,)](
        residual if delta is None else delta, residual, weight, out,
        0 if delta is None else delta.stride(0), residual.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, HAS_DELTA=delta is not None,
        num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2,
    )
    return out


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out,
    INTER: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < INTER
    g = tl.load(gate_up_ptr + row * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_in + INTER + offs, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs,
             (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2 I] (gate first) -> silu(gate) * up [T, I]."""
    num_rows, width = gate_up.shape
    inter = width // 2
    assert gate_up.stride(1) == 1 and width == 2 * inter
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(SILU_BLOCK, next_pow2(inter))
    _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4,
    )
    return out
