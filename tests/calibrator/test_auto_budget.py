"""Calibrated by default: the first start measures a short table and caches it, later starts
load it; a budget file still wins, and `auto: false` keeps the fixed budgets."""

from __future__ import annotations

from pathlib import Path

from cluster.auto_budget import cache_path
from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine


def test_first_start_calibrates_and_caches_later_starts_load(tmp_path: Path,
                                                              table_path: Path) -> None:
    settings = {"calibration": {"auto": True, "cache_dir": tmp_path},
                "cache": {"num_kv_blocks": 64}}
    config = TokenflowConfig(**settings)
    table = config.budget_table()
    assert table is not None
    cached = cache_path(tmp_path, "builtin:tiny", "cpu", "float32", 16, 16)
    assert cached.exists()
    stamp = cached.stat().st_mtime_ns
    engine = LocalEngine(TokenflowConfig(**settings))  # loads, does not measure again
    assert cached.stat().st_mtime_ns == stamp
    assert engine.scheduler.step_cost == table.step_cost()
    unit = engine.scheduler.chunk_unit
    assert engine.scheduler.config.max_num_batched_tokens > unit  # above the floor
    # A budget file wins over the cache; auto off means no table at all.
    explicit = TokenflowConfig(calibration={"auto": True, "cache_dir": tmp_path,
                                            "budget_file": table_path}).budget_table()
    assert explicit is not None and explicit.data["spec"] != table.data["spec"]
    assert TokenflowConfig(calibration={"auto": False}).budget_table() is None
