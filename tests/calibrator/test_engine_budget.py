"""A LocalEngine started with a budget file plans with the table's budget, and sizes each
chunk with its cost model under the SLO."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import TokenflowConfig
from cluster.engine import LocalEngine
from controller.budget import BudgetTable, StepCost
from controller.messages import SamplingParams
from workers.budget_file import load_budget_table

SLO_MS = 20.0


def _check_engine(engine: LocalEngine, table: BudgetTable) -> None:
    cfg = engine.config
    block_size = cfg.cache.block_size
    budget, _ = table.recommend(SLO_MS, block_size=block_size, context=0,
                                kv_capacity_tokens=cfg.cache.num_kv_blocks * block_size)
    sched = engine.scheduler.config
    assert (sched.max_num_batched_tokens, sched.max_chunk_tokens) == (budget, None)
    assert budget != TokenflowConfig().scheduler.max_num_batched_tokens  # really the table's
    cost = engine.scheduler.step_cost
    assert cost is not None and engine.scheduler.itl_slo_s == SLO_MS / 1e3
    engine.keep_step_log = True
    prompt = list(range(3, 3 + 3 * budget + 5))  # several chunks
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    [done] = engine.generate([prompt], params)
    assert len(done.output_token_ids) == 2
    scheduled = [plan.total_num_scheduled_tokens for plan, _ in engine.step_log]
    assert max(scheduled) <= budget
    depth, unit = 0, engine.scheduler.chunk_unit
    for plan, _ in engine.step_log:  # every chunk's step is predicted under the SLO
        n = plan.num_scheduled_tokens[done.request_id]
        if depth < len(prompt):
            assert n == unit or cost.step_s([(n, depth)], 0, 0) <= SLO_MS / 1e3
        depth += n


def test_engine_uses_budget_file_field(table_path: Path) -> None:
    engine = LocalEngine(calibration={"budget_file": table_path}, slo={"itl_ms": SLO_MS},
                         cache={"num_kv_blocks": 64})
    table = load_budget_table(table_path)
    _check_engine(engine, table)
    # Deviation warnings and budget_score compare against the table's cost model.
    step_cost = engine.core.workers[0].protections.step_cost
    assert step_cost.chunk_s(48, 16) == pytest.approx(table.predict(48, 16))
    uncalibrated = StepCost.per_token(TokenflowConfig().protections.seconds_per_token)
    assert step_cost.chunk_s(48, 16) != uncalibrated.chunk_s(48, 16)


def test_engine_uses_budget_file_env(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_CALIBRATION__BUDGET_FILE", str(table_path))
    monkeypatch.setenv("TOKENFLOW_SLO__ITL_MS", str(SLO_MS))
    config = TokenflowConfig(cache={"num_kv_blocks": 64})
    assert config.calibration.budget_file == table_path
    _check_engine(LocalEngine(config), load_budget_table(table_path))


def test_bad_budget_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "budget.json"
    bad.write_text('{"schema_version": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"budget\.json .*fit: Field required"):
        TokenflowConfig(calibration={"budget_file": bad}).budget_table()
