"""Calibrated by default, where the model runs: the first start measures a short table on the
worker itself and caches it under a key of everything the measurement depends on, later
starts load it (re-fitted for the current SLO); a budget file still wins, `auto: false`
keeps the fixed budgets, and the process that builds the configuration measures nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine
from cluster.serve import describe_budget
from controller.budget import AutoBudgetResult
from controller.calibration import QUICK_RUN, CalibrationConfig
from controller.messages import SamplingParams
from controller.options import budgeted_scheduler
from tests.unit.test_controller_actor import _Method, make_actor
from workers import auto_budget
from workers.auto_budget import cache_key, load_or_calibrate, worker_budget_table
from workers.budget_file import load_budget_table
from workers.calibrate import CalibrationSpec, Calibrator
from workers.kernels import cpu_ops as cpu_ops_module
from workers.worker import Worker

Measure = Callable[[CalibrationSpec], dict[str, Any]]
SLO_MS = 100.0


def cal(cache_dir: Path, **changes: Any) -> CalibrationConfig:
    """The calibration section with its cache folder at `cache_dir`."""
    return CalibrationConfig(cache_dir=cache_dir, **changes)


BASE_SPEC = CalibrationSpec.of(
    TokenflowConfig().calibration.quick(), model="builtin:tiny", dtype="float32",
    device="cpu", block_size=16, tile_tokens=16, threads=1)
BASE_IDENTITY = {"model_config_sha256": "0" * 64, "device_name": "cpu Example 9000",
                 "attention_backend": "TorchBackend", "chunk_kernel": "True",
                 "cuda_graphs": "False", "torch": "2.0.0", "cpu_kernels": "0" * 16}
# One other value per key input; every field of the spec must be here.
SPEC_CHANGES: dict[str, Any] = {
    "model": "/models/other", "dtype": "bfloat16", "device": "cuda", "threads": 2,
    "block_size": 32, "tile_tokens": 32, "warmup": 2, "iters": 4, "prefill_tokens": (16, 32),
    "contexts": (0,), "decode_batches": (1, 4), "decode_contexts": (64, 512),
    "matmul_size": 512, "bandwidth_bytes": 2**20, "memory_fraction": 0.5,
    "agree_within": 0.0}
IDENTITY_CHANGES = {"model_config_sha256": "1" * 64, "device_name": "cpu Example 9001",
                    "attention_backend": "TritonBackend", "chunk_kernel": "False",
                    "cuda_graphs": "True", "torch": "2.0.1", "cpu_kernels": "1" * 16}


def fake_measure(table_path: Path) -> tuple[list[CalibrationSpec], Measure]:
    """A measurement that returns a real table's numbers for any spec, and counts calls."""
    data = load_budget_table(table_path).data
    calls: list[CalibrationSpec] = []

    def measure(spec: CalibrationSpec) -> dict[str, Any]:
        calls.append(spec)
        return {**data, "spec": cache_key(spec, {})["spec"]}

    return calls, measure


def test_the_change_lists_cover_every_key_input() -> None:
    assert set(SPEC_CHANGES) == {f.name for f in dataclasses.fields(CalibrationSpec)}
    assert set(IDENTITY_CHANGES) == set(BASE_IDENTITY)


@pytest.mark.parametrize("change", [*(("spec", k) for k in SPEC_CHANGES),
                                    *(("identity", k) for k in IDENTITY_CHANGES),
                                    ("format", "version")])
def test_one_changed_input_is_another_cache_entry(change: tuple[str, str], tmp_path: Path,
                                                  table_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls, measure = fake_measure(table_path)
    first = load_or_calibrate(BASE_SPEC, BASE_IDENTITY, cal(tmp_path), SLO_MS, measure)
    hit = load_or_calibrate(dataclasses.replace(BASE_SPEC), dict(BASE_IDENTITY), cal(tmp_path),
                            SLO_MS, measure)
    assert len(calls) == 1 and first.is_measured and not hit.is_measured
    assert hit.path == first.path and hit.data["spec"] == first.data["spec"]
    kind, name = change
    spec, identity = BASE_SPEC, BASE_IDENTITY
    if kind == "spec":
        spec = dataclasses.replace(BASE_SPEC, **{name: SPEC_CHANGES[name]})
    elif kind == "identity":
        identity = {**BASE_IDENTITY, name: IDENTITY_CHANGES[name]}
    else:
        monkeypatch.setattr(auto_budget, "CACHE_FORMAT_VERSION",
                            auto_budget.CACHE_FORMAT_VERSION + 1)
    other = load_or_calibrate(spec, identity, cal(tmp_path), SLO_MS, measure)
    assert len(calls) == 2 and other.is_measured and other.path != first.path
    assert calls[-1] == spec
    again = load_or_calibrate(spec, identity, cal(tmp_path), SLO_MS, measure)
    assert len(calls) == 2 and not again.is_measured and again.path == other.path


def test_a_new_slo_refits_the_cached_measurement(tmp_path: Path, table_path: Path) -> None:
    calls, measure = fake_measure(table_path)
    loose = load_or_calibrate(BASE_SPEC, BASE_IDENTITY, cal(tmp_path), SLO_MS, measure)
    tight_fit = cal(tmp_path, bandwidth_headroom=0.5, weight_bits=8)
    tight = load_or_calibrate(BASE_SPEC, BASE_IDENTITY, tight_fit, 5.0, measure)
    assert len(calls) == 1 and not tight.is_measured and tight.path == loose.path
    assert tight.data["recommendation"]["itl_slo_ms"] == 5.0
    assert loose.data["recommendation"]["itl_slo_ms"] == 100.0
    assert tight.data["limits"]["bandwidth_headroom"] == 0.5
    assert tight.data["model_stats"]["weight_bits"] == 8
    assert (tight.data["recommendation"]["max_num_batched_tokens"]
            <= loose.data["recommendation"]["max_num_batched_tokens"])


def test_a_torn_cache_file_is_measured_again(tmp_path: Path, table_path: Path) -> None:
    calls, measure = fake_measure(table_path)
    first = load_or_calibrate(BASE_SPEC, BASE_IDENTITY, cal(tmp_path), SLO_MS, measure)
    Path(first.path).write_text("{\"schema_version\": 1", encoding="utf-8")
    again = load_or_calibrate(BASE_SPEC, BASE_IDENTITY, cal(tmp_path), SLO_MS, measure)
    assert len(calls) == 2 and again.is_measured and again.path == first.path
    load_budget_table(again.path)  # whole again


def test_configs_differing_in_a_measured_setting_use_other_entries(
        tmp_path: Path, table_path: Path) -> None:
    """From the configuration through a real worker (its device, dtype, block size, this
    process's threads) to the cache entry."""
    calls, measure = fake_measure(table_path)
    base: dict[str, Any] = {"calibration": {"auto": True, "cache_dir": tmp_path}}

    def entry(changes: dict[str, dict[str, Any]]) -> AutoBudgetResult:
        sections = {**base, **{k: {**base.get(k, {}), **v} for k, v in changes.items()}}
        cfg = TokenflowConfig(**sections)
        request = cfg.auto_budget()
        assert request is not None
        worker = Worker(cfg.worker.model, num_kv_blocks=2, block_size=cfg.cache.block_size,
                        dtype=cfg.worker.dtype)
        return worker_budget_table(worker, cfg.worker.model, cfg.worker.dtype, request,
                                   measure=measure)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = entry({})
        assert entry({}).path == first.path and len(calls) == 1  # identical: a hit
        refit = entry({"slo": {"itl_ms": 40.0}, "calibration": {"chunk_efficiency": 0.5}})
        assert refit.path == first.path and len(calls) == 1  # not measured: re-fitted
        paths = {first.path}
        for changes in ({"cache": {"block_size": 32}}, {"calibration": {"tile_tokens": 32}},
                        {"calibration": {"decode_contexts": [64, 256]}},
                        {"calibration": {"matmul_size": 512}},
                        {"calibration": {"bandwidth_bytes": 2**20}},
                        {"calibration": {"memory_fraction": 0.5}},
                        {"worker": {"dtype": "bfloat16"}}):
            result = entry(changes)
            assert result.is_measured and result.path not in paths, changes
            paths.add(result.path)
        torch.set_num_threads(2)
        assert entry({}).path not in paths and calls[-1].threads == 2
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == len(paths) + 1


def test_the_configuration_measures_nothing_and_a_budget_file_wins(tmp_path: Path,
                                                                   table_path: Path) -> None:
    on = TokenflowConfig(calibration={"auto": True, "cache_dir": tmp_path})
    options = on.controller_options()  # in the driver or an ingress: no measurement
    assert options.auto_budget == on.auto_budget() and options.step_cost is None
    assert options.auto_budget is not None
    assert options.auto_budget.calibration.warmup == QUICK_RUN["warmup"]
    assert not list(tmp_path.iterdir())
    explicit = TokenflowConfig(calibration={"auto": True, "cache_dir": tmp_path,
                                            "budget_file": table_path})
    assert explicit.auto_budget() is None
    options = explicit.controller_options()
    assert options.auto_budget is None
    assert options.step_cost == load_budget_table(table_path).step_cost()
    off = TokenflowConfig(calibration={"auto": False, "cache_dir": tmp_path})
    assert off.auto_budget() is None and off.budget_table() is None
    assert off.controller_options().step_cost is None


def test_engine_measures_on_its_own_worker_once(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[Worker] = []
    real_run = Calibrator.run

    def counting_run(self: Calibrator, weight_bits: int | None = None) -> dict[str, object]:
        runs.append(self.worker)
        return real_run(self, weight_bits)

    monkeypatch.setattr(Calibrator, "run", counting_run)
    # A pool large enough for the short run: it measures on the serving worker itself.
    settings: dict[str, Any] = {"calibration": {"auto": True, "cache_dir": tmp_path},
                                "cache": {"num_kv_blocks": 640}}
    engine = LocalEngine(TokenflowConfig(**settings))
    assert len(runs) == 1 and runs[0] is engine.worker
    assert engine.worker.num_active_requests == 0
    (cached,) = tmp_path.glob("*.json")
    table = load_budget_table(cached)
    spec = table.data["spec"]
    assert spec["threads"] == torch.get_num_threads() and spec["device"] == "cpu"
    assert spec["warmup"] == QUICK_RUN["warmup"] and max(spec["prefill_tokens"]) <= 512
    assert engine.scheduler.step_cost == table.step_cost()
    # The CPU kernels' sources are part of the key: other kernels time the steps anew.
    assert table.data["cache_key"]["identity"]["cpu_kernels"] == cpu_ops_module.source_digest()
    again = LocalEngine(TokenflowConfig(**settings))
    assert len(runs) == 1  # loaded, not measured
    assert again.scheduler.step_cost == table.step_cost()
    monkeypatch.setattr(cpu_ops_module, "source_digest", lambda: "f" * 16)
    LocalEngine(TokenflowConfig(**settings))
    assert len(runs) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    cfg = again.config
    assert again.scheduler.config == budgeted_scheduler(cfg.scheduler, table, cfg.calibration,
                                                        cfg.slo, cfg.cache)
    # The calibration's steps left nothing behind that serving could see.
    fixed = LocalEngine(TokenflowConfig(**{**settings, "calibration": {"auto": False}}))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 60))]
    assert [c.output_token_ids for c in engine.generate(prompts, params)] == \
        [c.output_token_ids for c in fixed.generate(prompts, params)]


def test_the_answer_to_the_controller_unpickles_without_torch(tmp_path: Path,
                                                             table_path: Path) -> None:
    """The controller imports no torch code: worker 0's budget answer must not make it.
    It did (`torch.__version__` in the cache key is torch's own str subclass): the
    controller's loop then stalled ~2 s importing torch on a first start's path to ready."""
    worker = Worker("builtin:tiny", num_kv_blocks=640, block_size=16)
    request = TokenflowConfig(calibration={"auto": True, "cache_dir": tmp_path}).auto_budget()
    assert request is not None
    _, measure = fake_measure(table_path)
    answer = pickle.dumps(worker_budget_table(worker, "builtin:tiny", "float32", request,
                                              measure=measure))
    check = ("import pickle, sys; result = pickle.loads(sys.stdin.buffer.read()); "
             "assert result.data['cache_key']['identity']['torch']; "
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", check], input=answer, check=True, timeout=120,
                   cwd=Path(__file__).resolve().parents[2])


def test_controller_asks_worker_0_before_it_schedules(table_path: Path) -> None:
    table = load_budget_table(table_path)
    request = TokenflowConfig(calibration={"auto": True}).auto_budget()
    assert request is not None

    async def main() -> None:
        actor, handles = make_actor()
        fixed = actor.options.scheduler
        actor.options = dataclasses.replace(actor.options, auto_budget=request)
        asked: list[Any] = []

        async def budget_table(req: Any) -> AutoBudgetResult:
            asked.append(req)
            return AutoBudgetResult(table.data, "/cache/t.json", True, 1.5, 4242)

        handles[0].budget_table = _Method(budget_table)  # worker 1 is never asked
        info = await actor.model_info()
        assert asked == [request]
        budget = info["budget"]
        assert budget["source"] == "measured" and budget["pid"] == 4242
        line = describe_budget(budget)  # what `make serve` prints
        assert "measured on worker 0" in line and "/cache/t.json" in line
        expected = budgeted_scheduler(fixed, table, request.calibration, actor.options.slo,
                                      actor.options.cache)
        assert budget["max_num_batched_tokens"] == expected.max_num_batched_tokens
        for w in range(2):
            sched = actor.core.scheduler(w)
            assert sched.config.max_num_batched_tokens == expected.max_num_batched_tokens
            assert sched.step_cost == table.step_cost()
        assert actor.options.auto_budget is None

    asyncio.run(asyncio.wait_for(main(), 10))


def test_controller_serves_with_fixed_budgets_when_the_table_fails() -> None:
    request = TokenflowConfig(calibration={"auto": True}).auto_budget()

    async def main() -> None:
        actor, handles = make_actor()
        actor.options = dataclasses.replace(actor.options, auto_budget=request)

        async def budget_table(req: Any) -> AutoBudgetResult:
            raise RuntimeError("no space left on device")

        handles[0].budget_table = _Method(budget_table)
        info = await actor.model_info()
        assert info["budget"]["source"] == "fixed"
        assert "no space left" in info["budget"]["error"]
        assert "fixed" in describe_budget(info["budget"])
        assert actor.core.scheduler(0).config.max_num_batched_tokens == 64
        assert actor.core.scheduler(0).step_cost is None
        assert (await actor.ping())["ok"]

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_worker_class_without_budget_tables_serves_with_fixed_budgets() -> None:
    """A custom `worker_cls` (the benchmarks' stand-in) need not measure anything: the
    missing method is a failure like any other, not a controller that never starts."""
    request = TokenflowConfig(calibration={"auto": True}).auto_budget()

    async def main() -> None:
        actor, handles = make_actor()
        actor.options = dataclasses.replace(actor.options, auto_budget=request)
        assert not hasattr(handles[0], "budget_table")
        info = await actor.model_info()
        assert info["budget"]["source"] == "fixed"
        assert "AttributeError" in info["budget"]["error"]
        assert (await actor.ping())["ok"]

    asyncio.run(asyncio.wait_for(main(), 10))
