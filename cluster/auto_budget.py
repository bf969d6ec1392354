"""Calibrated by default: the budget table of (model, device, dtype, block size, tile), from a
cache folder, or measured once by a short calibration and cached there.

The short run measures what the controller needs to size steps (prefill chunks up to 512
tokens at two depths, decode batches at two depths) with one warm-up and three kept runs per
point and small hardware probes, so it stays well under 30 s for `builtin:tiny` on a CPU;
`tokenflow calibrate` makes the precise table. A progress bar shows it running. Torch is only
imported when it has to measure.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

from cluster.budget_file import load_budget_table, validate_budget
from controller.budget import BudgetTable

logger = logging.getLogger("tokenflow.calibration")

# The short run's grid (what `tokenflow calibrate --quick` measures, plus its decode depths).
AUTO_WARMUP, AUTO_ITERS, AUTO_MAX_TOKENS = 1, 3, 512
AUTO_CONTEXTS, AUTO_DECODE_BATCHES = (0, 256), (1, 8)
AUTO_MATMUL_SIZE, AUTO_BANDWIDTH_BYTES = 1024, 64 * 2**20


def default_cache_dir() -> Path:
    root = os.environ.get("TOKENFLOW_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "tokenflow") / "budgets"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cache_path(cache_dir: Path, model: str, device: str, dtype: str, block_size: int,
               tile: int) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model}-{device}-{dtype}-b{block_size}-t{tile}")
    return cache_dir / f"{name}.json"


def load_or_calibrate(model: str, device: str, dtype: str, block_size: int, tile: int, *,
                      cache_dir: Path | None, threads: int, itl_slo_ms: float,
                      bandwidth_headroom: float, chunk_efficiency: float,
                      decode_contexts: tuple[int, ...], memory_fraction: float,
                      progress: bool = True) -> BudgetTable:
    """The cached table, or a short calibration written to the cache first."""
    device = resolve_device(device)
    path = cache_path(cache_dir or default_cache_dir(), model, device, dtype, block_size, tile)
    if path.exists():
        try:
            return load_budget_table(path)
        except ValueError as err:  # an older schema or a torn file: measure again
            logger.warning("ignoring cached budget table %s: %s", path, err)
    from workers.calibrate import CalibrationSpec, Calibrator, tile_grid

    spec = CalibrationSpec(
        model=model, dtype=dtype, device=device, block_size=block_size, tile_tokens=tile,
        warmup=AUTO_WARMUP, iters=AUTO_ITERS, threads=threads,
        prefill_tokens=tile_grid(math.lcm(block_size, tile), AUTO_MAX_TOKENS),
        contexts=AUTO_CONTEXTS, decode_batches=AUTO_DECODE_BATCHES,
        decode_contexts=decode_contexts, matmul_size=AUTO_MATMUL_SIZE,
        bandwidth_bytes=AUTO_BANDWIDTH_BYTES, memory_fraction=memory_fraction)
    logger.warning("no budget table for %s on %s (%s): a short calibration, cached in %s",
                   model, device, dtype, path)
    measured = Calibrator(spec, progress=progress).run()
    table = BudgetTable.build(measured, itl_slo_ms=itl_slo_ms,
                              bandwidth_headroom=bandwidth_headroom,
                              chunk_efficiency=chunk_efficiency, plan_context_tokens=None)
    validate_budget(table.data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    table.save(tmp)
    os.replace(tmp, path)  # a crash never leaves half a table in the cache
    return table
