"""The settings a worker is built from: the `worker:` and `cache:` sections as it reads
them (validated in cluster/config.py, passed whole), and how its steps run on its device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RunOptions:
    """How a worker runs its steps on its device (the `worker:` section's fields)."""

    num_threads: int | None = None
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    max_graph_batch: int = 256


class WorkerSection(Protocol):
    """The `worker:` section as the worker reads it (`WorkerConfig`, taken whole)."""

    model: str
    dtype: str
    device: str
    seed: int
    telemetry: bool
    peak_bandwidth_bytes_s: float | None
    num_threads: int | None
    attention_backend: str
    cuda_graphs: bool
    max_graph_batch: int


class CacheSection(Protocol):
    """The `cache:` section as the worker reads it (`CacheConfig`, taken whole)."""

    num_kv_blocks: int
    block_size: int
