"""The JSON a calibration writes validates against its schema; broken ones do not."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from controller.budget import BudgetTable
from controller.budget_schema import validate


@pytest.fixture
def data(table_path: Path) -> dict[str, Any]:
    return json.loads(table_path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("use_jsonschema", [True, False], ids=["jsonschema", "hand-check"])
def test_fresh_table_validates(table_path: Path, data: dict[str, Any],
                               use_jsonschema: bool) -> None:
    validate(data, use_jsonschema=use_jsonschema)
    BudgetTable.load(table_path)  # loading validates too
    assert data["recommendation"]["itl_slo_ms"] == 20.0
    assert {p["context"] for p in data["prefill"]} == {0, 64}


def _broken(data: dict[str, Any]) -> list[dict[str, Any]]:
    cases = []
    for edit in (
        lambda d: d.pop("fit"),
        lambda d: d["prefill"][0].update(mean_s=-1.0),
        lambda d: d["spec"].update(block_size="16"),
        lambda d: d.update(schema_version=99),
        lambda d: d["table"][0].update(binding="vibes"),
        lambda d: d["kv"]["alloc_probe"][0].update(ok=1),
    ):
        case = copy.deepcopy(data)
        edit(case)
        cases.append(case)
    return cases


@pytest.mark.parametrize("use_jsonschema", [True, False], ids=["jsonschema", "hand-check"])
def test_broken_tables_are_refused(data: dict[str, Any], use_jsonschema: bool) -> None:
    for case in _broken(data):
        with pytest.raises(ValueError):
            validate(case, use_jsonschema=use_jsonschema)


def test_png_beside_the_json(table_path: Path) -> None:
    png = table_path.with_suffix(".png")
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_real_table_budget_is_monotone_in_the_slo(table_path: Path) -> None:
    table = BudgetTable.load(table_path)
    slos = [0.5, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144]
    budgets = [table.recommend(s)[0] for s in slos]
    assert budgets == sorted(budgets)
    for slo in slos:
        budget, chunk = table.recommend(slo)
        assert budget % 16 == 0 and chunk % 16 == 0 and chunk <= budget
