"""`ControllerOptions`: the controller actor's slice of the configuration.

Ray-free and torch-free so `cluster.config` can build it without importing Ray; the
controller does not import the composition root (`cluster/`), which owns the full config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.scheduler import SchedulerConfig
from controller.worker_loop import RecoveryConfig


@dataclass(frozen=True)
class ControllerOptions:
    """Built by `TokenflowConfig.controller_options()`; see its fields' descriptions."""

    model: str = "builtin:tiny"
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    num_workers: int = 1
    worker_num_cpus: float = 0.5
    worker_max_restarts: int = -1  # Ray restarts a dead worker actor forever
    worker_cls: str = "workers.actor:WorkerActor"
    block_size: int = 16
    num_kv_blocks: int = 2048
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Keyword arguments of ControllerCore: flow control, protections, degraded path.
    core: dict[str, Any] = field(default_factory=dict)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    max_model_len: int = 8192
    max_queue_len: int = 1024
    namespace: str = "tokenflow"
    num_cpus: float = 0.25
    max_restarts: int = 3
    max_concurrency: int = 10_000
    detached: bool = False
    telemetry: bool = True  # workers sample bandwidth utilisation every step
    peak_bandwidth_bytes_s: float | None = None  # None: each CPU worker measures it
