"""Paged KV cache and the attention backends.

KV layout: per layer a pair `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads,
head_dim]` (block-wise, the layout paged attention kernels take). Token `j` of a request lives
in slot `block_ids[j // block_size] * block_size + j % block_size` of the flattened
`[num_blocks * block_size, num_kv_heads, head_dim]` view. Slot and element offsets are int64 so
that large pools cannot overflow.

A step: `StepMetadata.build` packs the step's integers on the host and copies them once to the
device (metadata.py); `backend.prepare(meta)` decides everything per step (groups, launch
sizes) and returns the object every layer calls, `step.forward(q, k, v, kv_cache, scale)`.
Backends, chosen by `make_backend` ("auto": triton on CUDA; on CPU cpu where its C++ kernels
build, else torch; on CUDA a Triton that fails to import is an error, not a fall back):
- `TorchBackend` (torch_backend.py): SDPA over gathered blocks, varlen decode groups; the
  reference the others are tested against.
- `cpu`: the torch backend with its decode rows in one C++ kernel that reads the paged cache
  in place (workers/kernels/csrc/cpu_attention.cpp), and each prefill chunk in another, a
  flash-style one over the paged cache (head sizes 64 and 128, on a CPU with AVX-512: an
  AVX2 build of it measured 0.75x SDPA's rate; elsewhere chunks keep SDPA).
- `TritonBackend` (triton_backend.py, kernels in triton_kernels.py): reads K/V straight from
  the paged cache; no gathered copies, no masks; CUDA-graph capturable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from workers.attention.metadata import HostStaging, SeqSpan, StepMetadata
from workers.attention.torch_backend import TorchBackend

log = logging.getLogger(__name__)

KVCache = tuple[Tensor, Tensor]
BACKENDS = ("auto", "torch", "cpu", "triton")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionStep", "HostStaging", "KVCache", "SeqSpan",
           "StepMetadata", "TorchBackend", "allocate_kv_cache", "make_backend"]


# Head sizes the C++ chunk kernel is built for (its register blocks are sized by them).
CHUNK_KERNEL_HEAD_DIMS = (64, 128)


class AttentionStep(Protocol):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache,
                scale: float) -> Tensor: ...

    def write_kv(self, k: Tensor, v: Tensor, kv_cache: KVCache) -> None:
        """The step's new K/V into the cache at its slots, no attention (`forward` does it
        first)."""


class AttentionBackend(Protocol):
    name: str
    supports_cuda_graphs: bool

    def prepare(self, meta: StepMetadata) -> AttentionStep: ...


def has_amx() -> bool:
    """Whether this CPU has AMX tiles, where oneDNN runs SDPA's bf16 blocks. Only there do
    they beat the C++ chunk kernel: with AVX512-BF16 alone (a Zen 5 EPYC) SDPA's bf16
    blocks ran at 150-177 GFLOP/s against the kernel's ~400."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch >= 2.3
    if is_amx is not None:
        return bool(is_amx())
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def make_backend(
    name: str, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device,
) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected one of {BACKENDS}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU only")
        from workers.kernels.cpu_ops import cpu_ops

        ops = cpu_ops()
        if ops is not None and dtype in (torch.float32, torch.bfloat16):
            # The chunk kernel has register blocks for these head sizes, and beats SDPA
            # where it was built for AVX-512 (16 floats a register); elsewhere SDPA serves.
            # Not for bf16 on a CPU with AMX: SDPA's blocks run on its tiles there, and the
            # kernel's fp32 FMAs ran at half its rate (512 queries over 5,500 keys: 27.5
            # against 12.5 ms a layer on a 2-core AMX Xeon).
            chunk = (ops.chunk_attention if head_dim in CHUNK_KERNEL_HEAD_DIMS
                     and getattr(ops, "chunk_attention_width", 0) == 16
                     and not (dtype == torch.bfloat16 and has_amx()) else None)
            return TorchBackend(dtype, num_kv_heads, head_dim,
                                decode_kernel=ops.decode_attention, chunk_kernel=chunk)
        name = "torch"  # no compiler here (logged once), or a dtype the kernel lacks
    if name == "triton":
        # On CUDA the Triton path is the served one: a failure here is an error at start,
        # never a silent fall back to SDPA (`attention_backend="torch"` chooses that).
        try:
            import triton  # noqa: F401
        except ImportError as err:
            raise RuntimeError(
                f"the triton attention backend cannot run: triton failed to import ({err}); "
                "install triton or choose worker.attention_backend=torch") from err
    if name == "torch":
        return TorchBackend(dtype, num_kv_heads, head_dim)
    if device.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device")
    from workers.attention.triton_backend import TritonBackend

    return TritonBackend(num_heads, num_kv_heads, head_dim, dtype, device)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]
