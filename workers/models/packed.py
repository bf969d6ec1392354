"""Linear layers with a oneDNN-packed copy of their weight, for the CPU fp32 and bf16 paths.

Why: `F.linear` on CPU re-packs the weight into the GEMM's blocked layout on every call;
for the few rows of a decode step that re-pack is a large share of the call, and oneDNN's
pre-packed kernel skips it (the worker's decode GEMMs take about half the time at 8-64
rows; a prefill chunk of hundreds of rows gains less). For very few rows on a small weight
the packed call's own overhead loses, so each layer keeps the plain path for those.
Results differ from the plain GEMM by summation order only (~1e-6 relative in fp32, within
bf16's rounding in bf16); the packed copy is checked against the plain one once, at packing
time. bf16 gains most: on a CPU with AMX the packed bf16 kernel ran 3-6x faster than fp32
at 32-512 rows, where the plain bf16 call re-packs per call and lost most of that.
An fp32 layer where the C++ kernels build with AVX-512 or AVX2 + FMA also keeps a copy for
their decode GEMM (workers/kernels/csrc/cpu_gemm.cpp), which takes calls of up to
`decode_max_rows` rows: there oneDNN's kernel left half the memory bandwidth unused.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.kernels.cpu_ops import cpu_ops
from workers.sections import PackPolicy


def _packed_op(x: Tensor, packed_weight: Tensor, bias: Tensor | None, *rest: object) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, *rest)


def packed_linear(x: Tensor, packed_weight: Tensor, bias: Tensor | None) -> Tensor:
    return _packed_op(x.contiguous(), packed_weight, bias, "none", [], "")


# Packable weight dtypes -> the tolerance of the packed-vs-plain check.
PACKED_DTYPE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def pack_weight(weight: Tensor, batch_hint: int = 16) -> Tensor | None:
    """The packed copy of a CPU fp32 or bf16 weight, or None where this torch build (or
    CPU) cannot, or the packed result disagrees with the plain one."""
    tol = PACKED_DTYPE_TOL.get(weight.dtype)
    if weight.device.type != "cpu" or tol is None:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        probe = torch.linspace(-1.0, 1.0, weight.shape[1], dtype=weight.dtype)[None, :]
        plain = F.linear(probe, weight.detach()).float()
        ok = torch.allclose(packed_linear(probe, packed, None).float(), plain,
                            rtol=tol, atol=tol * float(plain.abs().max().clamp(min=1.0)))
    except (AttributeError, RuntimeError):  # op missing in this torch build
        return None
    return packed if ok else None


class PackedLinear(nn.Module):
    """An `nn.Linear` (same parameter names) that calls the C++ decode GEMM up to
    `decode_max_rows` rows (where it has `decode_packed`), else the oneDNN-packed copy from
    `min_rows` rows up (where it has `packed`: a weight too small for oneDNN's copy keeps
    only the decode GEMM's), else the plain GEMM. The parameters stay the source of truth
    (state dicts, ties, byte counts); each packed copy is not a parameter and costs one
    extra copy of the weight."""

    def __init__(self, linear: nn.Linear, packed: Tensor | None, min_rows: int,
                 decode_packed: Tensor | None = None, decode_max_rows: int = 0) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed, self.min_rows = packed, min_rows
        self.decode_packed, self.decode_max_rows = decode_packed, decode_max_rows

    def forward(self, x: Tensor) -> Tensor:
        if self.decode_packed is not None and x.shape[0] <= self.decode_max_rows:
            return cpu_ops().decode_linear(x.contiguous(), self.decode_packed, self.bias)
        if self.packed is not None and x.shape[0] >= self.min_rows:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def maybe_pack(linear: nn.Linear, policy: PackPolicy) -> nn.Module:
    """`linear` as a `PackedLinear` where the policy and the build give it a packed copy,
    else itself. The two copies are decided apart: a weight under `policy.min_elements`
    gets no oneDNN copy, and one whose oneDNN copy fails keeps the decode GEMM's."""
    # Without a decode copy of every layer the decode stack is off for the whole model:
    # builtin:small's o_proj (256 x 256) had kept its 4 layers in the Python loop; with the
    # stack its decode iterations ran 2-11 % faster on a 2-core Zen 3.
    decode_packed, decode_max_rows = _decode_packed(linear.weight, policy)
    numel = linear.weight.numel()
    packed = pack_weight(linear.weight) if numel >= policy.min_elements else None
    if packed is None and decode_packed is None:
        return linear
    min_rows = 1 if numel >= policy.any_rows_elements else policy.min_rows
    return PackedLinear(linear, packed, min_rows, decode_packed, decode_max_rows)


def decode_gemm_preferred(ops: ModuleType) -> bool:
    """Whether this build's decode GEMM is the one to use (AVX-512 and AVX2 with FMA:
    measured faster than oneDNN's; narrower builds keep oneDNN's)."""
    return bool(ops.decode_gemm_preferred())


def _decode_packed(weight: Tensor, policy: PackPolicy) -> tuple[Tensor | None, int]:
    """The C++ decode GEMM's copy of an fp32 weight and its row limit, or (None, 0) where it
    does not apply (off, another dtype, no kernels or not preferred here, N not a multiple
    of its block) or disagrees with the plain GEMM on a probe (checked once, as
    `pack_weight` checks its copy)."""
    ops = cpu_ops() if policy.decode_max_rows > 0 and weight.dtype == torch.float32 \
        else None
    if ops is None or not decode_gemm_preferred(ops) \
            or weight.shape[0] % ops.decode_gemm_block() != 0:
        return None, 0
    packed = ops.pack_decode_weight(weight.detach())
    probe = torch.linspace(-1.0, 1.0, 3 * weight.shape[1]).view(3, -1)
    plain = F.linear(probe, weight.detach())
    tol = PACKED_DTYPE_TOL[torch.float32] * float(plain.abs().max().clamp(min=1.0))
    if not torch.allclose(ops.decode_linear(probe, packed), plain, rtol=1e-4, atol=tol):
        return None, 0
    return packed, policy.decode_max_rows
