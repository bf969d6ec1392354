"""The controller and the worker are each built by one factory from the configuration's
section objects: `ControllerCore.for_workers(options, ...)` over `ControllerOptions`
(`TokenflowConfig.controller_options()` from the validated config), `build_worker(worker,
cache)`; the benchmarks build through the same ones (docs/architecture.md, "Built once")."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cluster.config import TokenflowConfig
from controller.core import ControllerCore
from controller.options import ControllerOptions
from workers.worker import build_worker

ROOT = Path(__file__).resolve().parents[2]
# Where each constructor may be called outside tests, and why.
CONSTRUCTED_IN = {
    "ControllerCore": set(),  # only as `cls(...)` in its for_workers
    "Worker": {"workers/worker.py",  # build_worker
               "workers/calibrate.py"},  # the calibrator's own pool of just the needed size
    # The validated config's factory, and the GPU benchmark that runs where pydantic is not
    # installed: the same section classes and the same core factory, without the validation.
    "ControllerOptions": {"cluster/config.py", "benchmarks/gpu_bench.py",
                          "controller/core.py"},  # the defaults, for a test that passes none
}


def _calls(name: str) -> set[str]:
    """Files of cluster/, controller/, workers/, benchmarks/ that call `name(...)`."""
    found = set()
    for top in ("cluster", "controller", "workers", "benchmarks"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and (
                        (isinstance(node.func, ast.Name) and node.func.id == name)
                        or (isinstance(node.func, ast.Attribute) and node.func.attr == name)):
                    found.add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("name", sorted(CONSTRUCTED_IN))
def test_each_is_constructed_only_by_its_factory(name: str) -> None:
    assert _calls(name) <= CONSTRUCTED_IN[name]


def test_the_scan_sees_the_factories_called() -> None:
    assert {"controller/actor.py", "cluster/engine.py", "benchmarks/gpu_bench.py",
            "benchmarks/metrics_bench.py"} <= _calls("for_workers")
    assert {"workers/actor.py", "cluster/engine.py", "benchmarks/gpu_bench.py",
            "benchmarks/engine_bench.py"} <= _calls("build_worker")
    assert "workers/worker.py" in _calls("Worker")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a worker reports at start (`WorkerFacts`)."""

    num_kv_blocks: int = 64
    block_size: int = 8
    vocab_size: int = 100
    eos_token_ids: tuple[int, ...] = (2,)
    max_model_len: int = 4096


def test_the_controller_is_built_from_the_validated_config_whole() -> None:
    config = TokenflowConfig(
        worker={"max_model_len": 512}, cache={"num_kv_blocks": 64, "block_size": 8},
        scheduler={"max_num_seqs": 7, "scheduling_policy": "prefill-first"},
        flow={"throttle_chunks": 3}, protections={"max_queue_len": 9},
        slo={"max_headroom": 1.1}, calibration={"auto": False})
    options = config.controller_options()
    # Every section the controller reads is the config's own object, not a copy by hand.
    for f in dataclasses.fields(ControllerOptions):
        if f.name in type(config).model_fields and f.name != "scheduler":
            assert getattr(options, f.name) is getattr(config, f.name), f.name
    assert options.scheduler == config.scheduler  # a copy: comparison policies mutate theirs
    core = ControllerCore.for_workers(options, [Facts(), Facts()])
    assert core.max_model_len == 512 and core.max_queue_len == 9  # worker, protections
    assert len(core.workers) == 2
    assert core.scheduler(1).config.max_num_seqs == 7
    assert core.scheduler(1).config.scheduling_policy == "prefill-first"
    assert core.workers[0].refit is None  # no budget table: nothing to refit


def test_the_worker_is_built_from_its_two_sections() -> None:
    config = TokenflowConfig(worker={"model": "builtin:tiny", "telemetry": False},
                             cache={"num_kv_blocks": 16, "block_size": 8})
    worker = build_worker(config.worker, config.cache)
    assert (worker.num_kv_blocks, worker.block_size) == (16, 8)
    assert worker.telemetry is None  # worker.telemetry off: no source
    watched = build_worker(dataclasses.replace(config.worker, telemetry=True,
                                               peak_bandwidth_gbs=10.0), config.cache)
    assert watched.telemetry is not None
