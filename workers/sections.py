"""The settings a worker is built from: the `worker:` and `cache:` sections as it reads
them (validated in cluster/config.py, passed whole), and how its steps run on its device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PackPolicy:
    """Which linear weights a CPU fp32 worker packs for oneDNN, and from how many rows a
    call uses the packed copy (the `worker.cpu_packed_*` fields; workers/models/packed.py)."""

    min_rows: int = 8  # below, the plain GEMM: the packed call's overhead dominates
    min_elements: int = 1 << 17  # smaller weights: no oneDNN copy (the decode GEMM's still)
    any_rows_elements: int = 1 << 20  # from this size packed even for one row
    decode_max_rows: int = 64  # fp32, up to this many rows: the C++ decode GEMM (0: never)


@dataclass(frozen=True)
class RunOptions:
    """How a worker runs its steps on its device (the `worker:` section's fields)."""

    num_threads: int | None = None
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    max_graph_batch: int = 256
    packing: PackPolicy | None = PackPolicy()  # None: plain GEMMs only
    fused_layers: bool = True  # CPU fp32/bf16: the C++ norm, rotary and SiLU-and-mul
    keep_freed_memory: bool = True  # CPU: glibc keeps freed memory (workers/cpu_setup.py)
    sampled_last_layer: bool = True  # CPU fp32/bf16: last layer on sampled rows (sampled_rows.py)
    greedy_screen: bool = True  # CPU fp32: greedy ids from a lm_head screen (greedy_head.py)
    decode_stack: bool = True  # CPU fp32: a decode-only step's layers in one C++ call
    gemm_prefetch: str = "on"  # CPU fp32: the decode GEMM's prefetch (workers/gemm_prefetch.py)


class WorkerSection(Protocol):
    """The `worker:` section as the worker reads it (`WorkerConfig`, taken whole)."""

    model: str
    dtype: str
    device: str
    seed: int
    telemetry: bool
    peak_bandwidth_bytes_s: float | None
    num_threads: int | None
    check_kv_provenance: bool
    attention_backend: str
    cuda_graphs: bool
    max_graph_batch: int
    cpu_packed_weights: bool
    cpu_packed_min_rows: int
    cpu_packed_min_elements: int
    cpu_packed_any_rows_elements: int
    cpu_decode_gemm_max_rows: int
    cpu_fused_layers: bool
    cpu_keep_freed_memory: bool
    cpu_sampled_last_layer: bool
    cpu_greedy_screen: bool
    cpu_decode_stack: bool
    cpu_gemm_prefetch: str
    cpu_bind_threads: bool


class CacheSection(Protocol):
    """The `cache:` section as the worker reads it (`CacheConfig`, taken whole)."""

    num_kv_blocks: int
    block_size: int


def packing_policy(section: WorkerSection) -> PackPolicy | None:
    if not section.cpu_packed_weights:
        return None
    return PackPolicy(section.cpu_packed_min_rows, section.cpu_packed_min_elements,
                      section.cpu_packed_any_rows_elements, section.cpu_decode_gemm_max_rows)
