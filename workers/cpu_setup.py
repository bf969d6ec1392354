"""What a CPU worker sets up beside its model (the CPU fields of `RunOptions`): oneDNN-packed
linear weights, the C++ elementwise layers, a decode-only step's layers as one C++ call over
its KV cache, the decode GEMM's prefetch (timed), and glibc's allocator told to keep freed
memory.
Each is a no-op where it does not apply (CUDA, another dtype, kernels that did not build)."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, cast

import torch

from workers.attention import KVCache
from workers.decode_stack import DecodeStack
from workers.gemm_prefetch import GemmPrefetch, choose_prefetch
from workers.models.llama import LlamaForCausalLM
from workers.sections import RunOptions

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h) and the largest mmap threshold it takes on 64-bit.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAX_MMAP_THRESHOLD = 32 << 20


def keep_freed_memory() -> bool:
    """Allocations up to 32 MiB from glibc's heap, freed memory never trimmed: a step's
    activations ([T, intermediate] fp32 is 25 MB at 4,096 tokens on builtin:bench) then
    reuse mapped pages. By default glibc maps each block over its (dynamic) threshold
    afresh and unmaps it when freed, so every step faulted its pages in again. Process-wide,
    as torch's thread count is; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1
        return ok and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False


def bind_threads_to_cores() -> list[int]:
    """Pin torch's intra-op thread t to the t-th core this process may run on, where there
    are exactly as many threads as such cores (one worker owning its cores); the cores
    pinned, [] where nothing was (fewer threads, one thread, no kernels, not Linux)."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    if torch.get_num_threads() != len(cores) or len(cores) < 2:
        return []
    from workers.kernels.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None or ops.bind_threads(cores) != len(cores):
        return []
    return cores


def prepare_cpu(model: LlamaForCausalLM, run: RunOptions, device: torch.device,
                attention_backend: str, kv_caches: list[KVCache]) -> dict[str, Any] | None:
    """-> the decode GEMM's prefetch as chosen (`choose_prefetch`), None where the model
    has no decode GEMM copies or the device is not a CPU."""
    if device.type != "cpu":
        return None
    if run.keep_freed_memory and not keep_freed_memory():
        log.info("glibc's mallopt is not available: freed memory goes back to the system")
    if run.packing is not None:
        model.pack_linears(run.packing)  # fp32 or bf16
    # Beside the C++ attention (`auto` or `cpu`); a forced `torch` backend is the reference.
    dtype_ok = model.lm_head.weight.dtype in (torch.float32, torch.bfloat16)
    if run.fused_layers and attention_backend in ("auto", "cpu") and dtype_ok:
        from workers.kernels.cpu_ops import cpu_ops

        model.cpu_layers = cpu_ops()  # None where they did not build: the torch operators
    if run.decode_stack and model.runs_cpu_layers(model.lm_head.weight.dtype, device):
        model.decode_stack = DecodeStack.build(model, kv_caches)  # None where it cannot run
    return choose_prefetch(model, cast(GemmPrefetch, run.gemm_prefetch))
