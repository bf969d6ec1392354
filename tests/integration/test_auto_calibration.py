"""The automatic budget table is measured where the model runs: in worker 0's process, with
its threads, on its device, never in the driver that built the configuration; the next
controller loads the cached table from the worker instead of measuring again.

A controller of its own (one CPU worker whose pool fits the short run, so it measures on
the serving worker itself) on the session's Ray cluster, started twice.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from cluster.config import TokenflowConfig
from controller.budget import BudgetTable
from controller.options import budgeted_scheduler
from workers.budget_file import load_budget_table


def _start(config: TokenflowConfig) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    import ray

    from controller.actor import get_or_create_controller

    options = config.controller_options()
    assert options.auto_budget is not None and options.step_cost is None  # nothing measured
    controller = get_or_create_controller(options)
    info = ray.get(controller.model_info.remote(), timeout=300)
    ping = ray.get(controller.ping.remote(), timeout=30)
    return controller, info, ping


def _stop(controller: Any) -> None:
    import ray

    ray.get(controller.shutdown.remote(), timeout=60)  # the workers are detached
    ray.kill(controller)


def test_worker_0_measures_once_and_the_next_start_loads(cluster, tmp_path: Path) -> None:
    config = TokenflowConfig(
        worker={"model": "builtin:tiny", "num_workers": 1, "device": "cpu"},
        cache={"num_kv_blocks": 640},
        calibration={"auto": True, "cache_dir": tmp_path},
        cluster={"namespace": "tokenflow-autocal", "worker_num_cpus": 1.0,
                 "controller_num_cpus": 0.1})
    assert not list(tmp_path.iterdir())  # building the options measured nothing
    controller, info, ping = _start(config)
    try:
        budget = info["budget"]
        worker_pid = ping["workers"][0]["pid"]
        assert budget["source"] == "measured" and budget["measure_s"] > 0
        assert budget["pid"] == worker_pid != os.getpid()
        assert budget["threads"] == info["torch_threads"][0]
        (cached,) = tmp_path.glob("*.json")
        assert Path(budget["path"]) == cached
        table = load_budget_table(cached)
        assert table.data["spec"]["threads"] == info["torch_threads"][0]
        assert table.data["spec"]["device"] == info["devices"][0] == "cpu"
        fitted = BudgetTable.fitted(table.data, config.calibration, config.slo.itl_ms)
        expected = budgeted_scheduler(config.scheduler, fitted, config.calibration, config.slo,
                                      config.cache)
        assert budget["max_num_batched_tokens"] == expected.max_num_batched_tokens
        stamp = cached.stat().st_mtime_ns
    finally:
        _stop(controller)

    # A fresh controller and worker process (another namespace: no name to wait for).
    again = config.model_copy(update={"cluster": dataclasses.replace(
        config.cluster, namespace="tokenflow-autocal-2")})
    controller, info, ping = _start(again)
    try:
        budget = info["budget"]
        assert budget["source"] == "cache" and budget["measure_s"] == 0
        assert budget["pid"] == ping["workers"][0]["pid"] != worker_pid
        assert cached.stat().st_mtime_ns == stamp and list(tmp_path.glob("*.json")) == [cached]
        assert ping["ok"]
    finally:
        _stop(controller)
