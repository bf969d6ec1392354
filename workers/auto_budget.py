"""Calibrated by default, where the model runs: the budget table of a worker, from a cache
folder, or measured once on that worker's device by the short calibration and cached there.

The controller asks worker 0 (`WorkerActor.budget_table`) before it builds its schedulers;
`LocalEngine` asks its own worker. The measurement is `tokenflow calibrate --quick`'s grid
(`CalibrationConfig.quick`, one definition) on the serving worker itself where its KV pool
is big enough (its weights, backend and CUDA graphs are what the table is for), with the
worker's own thread count.

A cache entry is named by a hash of everything that changes the measurement: the whole
`CalibrationSpec` (model name, dtype, device, threads, block size, tile, grid, probes), the
model's identity (the hash of its config.json), the device's name, the worker's attention
backend and CUDA-graph use, the torch version and the formats (`CACHE_FORMAT_VERSION`, the
budget file's schema version). The ITL SLO and the planning limits are not measured: a
cached table is re-fitted with the current ones (`BudgetTable.fitted`), not re-measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from controller.budget import SCHEMA_VERSION, AutoBudget, AutoBudgetResult, BudgetTable
from controller.calibration import CalibrationConfig
from workers.calibrate import CalibrationSpec, Calibrator, model_config_sha256
from workers.contention import measure_quietly
from workers.worker import Worker

logger = logging.getLogger("tokenflow.calibration")

# Bump when a cached table's meaning changes without any key input changing (the worker's
# step code, what is stored): older entries are then never read.
CACHE_FORMAT_VERSION = 2
# The key's hex digits in a cache file name (80 bits: collisions are not a concern, and the
# stored key is compared on load anyway).
_KEY_DIGITS = 20

Measure = Callable[[CalibrationSpec], dict[str, Any]]  # spec -> Calibrator.run()'s dict


def default_cache_dir() -> Path:
    root = os.environ.get("TOKENFLOW_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "tokenflow") / "budgets"


def cache_key(spec: CalibrationSpec, identity: Mapping[str, str]) -> dict[str, Any]:
    """Everything the measured table depends on, as JSON-able data."""
    spec_json = {k: list(v) if isinstance(v, tuple) else v
                 for k, v in dataclasses.asdict(spec).items()}
    return {"format": CACHE_FORMAT_VERSION, "schema": SCHEMA_VERSION, "spec": spec_json,
            "identity": dict(identity)}


def cache_path(cache_dir: Path, spec: CalibrationSpec, identity: Mapping[str, str]) -> Path:
    text = json.dumps(cache_key(spec, identity), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:_KEY_DIGITS]
    readable = "".join(c if c.isalnum() or c in "_.-" else "_"
                       for c in f"{spec.model}-{spec.device}-{spec.dtype}")
    return cache_dir / f"{readable}-{digest}.json"


def load_or_calibrate(spec: CalibrationSpec, identity: Mapping[str, str],
                      cal: CalibrationConfig, itl_slo_ms: float | None,
                      measure: Measure) -> AutoBudgetResult:
    """The cached table of (spec, identity) in `cal.cache_dir` fitted with `cal`'s planning
    limits for `itl_slo_ms`, or `measure(spec)` written to the cache first. Only a cache
    miss calls `measure`."""
    path = cache_path(cal.cache_dir or default_cache_dir(), spec, identity)
    key = cache_key(spec, identity)
    if path.exists():
        from workers.budget_file import load_budget_table

        try:
            cached = load_budget_table(path)
            if cached.data.get("cache_key") != key:
                raise ValueError("its stored key differs")
            table = BudgetTable.fitted(cached.data, cal, itl_slo_ms)
            return AutoBudgetResult(table.data, str(path), False, 0.0, os.getpid())
        except (ValueError, KeyError) as err:  # an older format or a torn file: measure again
            logger.warning("ignoring cached budget table %s: %s", path, err)
    logger.warning("no budget table for %s on %s (%s, threads=%s): a short calibration, "
                   "cached in %s", spec.model, identity.get("device_name", spec.device),
                   spec.dtype, spec.threads, path)
    started = time.perf_counter()
    measured, quiet = measure_quietly(lambda: measure(spec), spec.threads,
                                      cal.max_contention_cores, cal.quiet_wait_s,
                                      cal.max_measure_attempts)
    measure_s = time.perf_counter() - started
    if quiet.waited_s >= 1.0:
        logger.warning("calibration: waited %.1f s for other processes to leave this "
                       "worker's cores", quiet.waited_s)
    table = BudgetTable.fitted({**measured, "cache_key": key}, cal, itl_slo_ms)
    is_quiet = quiet.is_quiet(cal.max_contention_cores)
    if is_quiet:
        _save(table, path)
        logger.warning("budget table measured in %.1f s: %s", measure_s, path)
    else:  # a disturbed table serves this run only: the next start measures again
        logger.warning("budget table measured in %.1f s while other processes used %.2f "
                       "cores of this worker's (%d tries): used now, not cached", measure_s,
                       quiet.contention_cores, quiet.attempts)
    return AutoBudgetResult(table.data, str(path), True, measure_s, os.getpid(),
                            is_cached=is_quiet, contention_cores=quiet.contention_cores)


def _save(table: BudgetTable, path: Path) -> None:
    from workers.budget_file import validate_budget

    validate_budget(table.data)  # what a later load accepts
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique temporary name: two processes measuring the same key must not share one; the
    # rename is atomic, so a reader never sees half a table.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        table.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def device_name(device: torch.device) -> str:
    """The device's model: the GPU's name, or the CPU's (two machines sharing a cache
    folder must not share a table)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"cpu {line.partition(':')[2].strip()}"
    except OSError:
        pass
    return f"cpu {platform.processor() or platform.machine()}"


def worker_identity(worker: Worker) -> dict[str, str]:
    """What the spec does not say about the worker and what changes its step times (on a
    CPU, the C++ kernels' sources: a kernel made faster times the steps anew)."""
    identity = {"model_config_sha256": model_config_sha256(worker),
                "device_name": device_name(worker.device),
                "attention_backend": type(worker.backend).__name__,
                # Whether chunks run the C++ kernel or SDPA (bf16 chooses by the CPU).
                "chunk_kernel": str(getattr(worker.backend, "chunk_kernel", None) is not None),
                "cuda_graphs": str(worker.graphs is not None),
                # A plain str: torch.__version__ is torch's TorchVersion, and unpickling the
                # answer in the controller then imported torch there (2 s on a 2-core Zen 1,
                # on a first start's path to ready; ~200 MB).
                "torch": str(torch.__version__)}
    if worker.device.type == "cpu":
        from workers.kernels.cpu_ops import source_digest

        identity["cpu_kernels"] = source_digest()
    return identity


def worker_budget_table(worker: Worker, model: str, dtype: str, request: AutoBudget,
                        progress: bool = False,
                        measure: Measure | None = None) -> AutoBudgetResult:
    """`request` on `worker` (holding no request): its device, dtype, block size and this
    process's torch threads. Measures on `worker` itself when its pool is large enough (else
    on a second, smaller one); no request is left on it. `measure`: instead of the
    calibrator (tests count its calls)."""
    cal = request.calibration
    spec = CalibrationSpec.of(
        cal, model=model, dtype=dtype, device=str(worker.device),
        block_size=worker.block_size, tile_tokens=cal.tile_tokens,
        threads=torch.get_num_threads())

    def calibrate(spec: CalibrationSpec) -> dict[str, Any]:
        # Its timing steps attend over contexts they never computed: not the KV check's.
        checked, worker.kv_provenance = worker.kv_provenance, None
        try:
            return Calibrator(spec, progress=progress, worker=worker).run()
        finally:
            worker.kv_provenance = checked

    return load_or_calibrate(spec, worker_identity(worker), cal, request.itl_slo_ms,
                             measure or calibrate)
