"""An explicit setting wins over an automatic one, and start-up says which budget it uses.

`scheduler.max_num_batched_tokens` set in the environment, as a keyword (serve.yaml `args`)
or as a section is the step budget: no automatic calibration replaces it, a budget file's
recommendation does not either (its cost model still sizes chunks), and the line `make
serve` prints says so. A budget file measured for another model is refused unless
`calibration.allow_other_model` says to use it anyway.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine
from cluster.serve import describe_budget
from controller.actor import ControllerActor
from controller.options import WorkerConfig, budgeted_scheduler
from tests.unit.fake_runner import FakeRunner
from tests.unit.test_controller_actor import VOCAB, FakeWorkerHandle
from workers.budget_file import load_budget_table
from workers.presets import resolve_model

BUDGET_ENV = "TOKENFLOW_SCHEDULER__MAX_NUM_BATCHED_TOKENS"


def test_what_counts_as_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert not TokenflowConfig().budget_is_explicit
    assert not TokenflowConfig(scheduler={"max_num_seqs": 8}).budget_is_explicit
    assert TokenflowConfig(scheduler={"max_num_batched_tokens": 4096}).budget_is_explicit
    monkeypatch.setenv("TOKENFLOW_SCHEDULER", '{"max_num_seqs": 4}')
    assert not TokenflowConfig().budget_is_explicit
    monkeypatch.setenv("TOKENFLOW_SCHEDULER", '{"max_num_batched_tokens": 4096}')
    assert TokenflowConfig().budget_is_explicit
    monkeypatch.delenv("TOKENFLOW_SCHEDULER")
    monkeypatch.setenv(BUDGET_ENV, "4096")
    config = TokenflowConfig()
    assert config.budget_is_explicit
    # The ingress rebuilds its configuration from a dump: the answer travels with it.
    monkeypatch.delenv(BUDGET_ENV)
    assert TokenflowConfig(**config.model_dump()).budget_is_explicit
    assert not TokenflowConfig(**TokenflowConfig().model_dump()).budget_is_explicit


def test_an_env_budget_is_the_budget_the_controller_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUDGET_ENV, "4096")
    config = TokenflowConfig(calibration={"auto": True})
    assert config.auto_budget() is None  # nothing automatic replaces it

    async def main() -> None:
        handles = [FakeWorkerHandle(FakeRunner(vocab_size=VOCAB, block_size=4))
                   for _ in range(2)]
        options = dataclasses.replace(config.controller_options(),
                                      worker=WorkerConfig(num_workers=2))
        actor = ControllerActor(options, worker_factory=lambda _: handles,
                                kill_worker=FakeWorkerHandle.kill)
        info = await actor.model_info()
        assert info["budget"]["max_num_batched_tokens"] == 4096
        for w in range(2):
            assert actor.core.scheduler(w).config.max_num_batched_tokens == 4096
        line = describe_budget(info["budget"], config)  # what `make serve` prints
        assert line.startswith("step budget 4096 tokens: set explicitly")

    asyncio.run(asyncio.wait_for(main(), 10))
    monkeypatch.delenv(BUDGET_ENV)
    assert TokenflowConfig(calibration={"auto": True}).auto_budget() is not None


def test_an_explicit_budget_beats_the_budget_files(
        table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = load_budget_table(table_path)
    settings = {"worker": {"model": "builtin:tiny"},
                "calibration": {"budget_file": str(table_path)}}
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    implicit = TokenflowConfig(**settings)
    recommended = budgeted_scheduler(implicit.scheduler, table, implicit.calibration, implicit.slo,
                                     implicit.cache).max_num_batched_tokens
    assert implicit.controller_options().scheduler.max_num_batched_tokens == recommended
    budget = {"source": "file", "max_num_batched_tokens": recommended}
    assert str(table_path) in describe_budget(budget, implicit)
    assert recommended != 4096
    monkeypatch.setenv(BUDGET_ENV, "4096")
    explicit = TokenflowConfig(**settings)
    options = explicit.controller_options()
    assert options.scheduler.max_num_batched_tokens == 4096
    assert options.step_cost == table.step_cost()  # the file still sizes chunks
    line = describe_budget({"source": "file", "max_num_batched_tokens": 4096}, explicit)
    assert "set explicitly" in line and "recommended budget is not used" in line
    engine = LocalEngine(explicit)  # the in-process engine follows the same rule
    assert engine.scheduler.config.max_num_batched_tokens == 4096


def test_a_budget_file_for_another_model_is_refused(
        table_path: Path, preset_cache: Path) -> None:
    other = TokenflowConfig(worker={"model": "builtin:bench"},
                            calibration={"budget_file": str(table_path)})
    with pytest.raises(ValueError) as err:
        other.controller_options()
    message = str(err.value)
    assert "measured for model 'builtin:tiny', but this runs 'builtin:bench'" in message
    assert "TOKENFLOW_CALIBRATION__ALLOW_OTHER_MODEL=true" in message
    forced = TokenflowConfig(worker={"model": "builtin:bench"},
                             calibration={"budget_file": str(table_path),
                                          "allow_other_model": True})
    assert forced.budget_table() is not None
    # The same model under its folder's path is the same model (config.json's hash).
    folder = TokenflowConfig(worker={"model": str(resolve_model("builtin:tiny"))},
                             calibration={"budget_file": str(table_path)})
    assert folder.budget_table() is not None
