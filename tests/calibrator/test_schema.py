"""The JSON a calibration writes validates against the budget file's model; broken ones are
refused with the offending field named."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from workers.budget_file import load_budget_table, validate_budget


@pytest.fixture
def data(table_path: Path) -> dict[str, Any]:
    return json.loads(table_path.read_text(encoding="utf-8"))


def test_fresh_table_validates(table_path: Path, data: dict[str, Any]) -> None:
    validate_budget(data)
    load_budget_table(table_path)  # loading validates too
    assert data["recommendation"]["itl_slo_ms"] == 20.0
    assert {p["context"] for p in data["prefill"]} == {0, 64}


# Each edit breaks one field; the error names it (dotted path, list indices included).
BROKEN = [
    (lambda d: d.pop("fit"), "fit"),
    (lambda d: d["prefill"][0].update(mean_s=-1.0), "prefill.0.mean_s"),
    (lambda d: d["spec"].update(block_size="16"), "spec.block_size"),
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d["table"][0].update(binding="vibes"), "table.0.binding"),
    (lambda d: d["kv"]["alloc_probe"][0].update(ok=1), "kv.alloc_probe.0.ok"),
    (lambda d: d["limits"].update(chunk_efficiency=1.5), "limits.chunk_efficiency"),
]


@pytest.mark.parametrize(("edit", "where"), BROKEN, ids=[w for _, w in BROKEN])
def test_broken_tables_are_refused_naming_the_field(data: dict[str, Any], edit: Any,
                                                    where: str) -> None:
    case = copy.deepcopy(data)
    edit(case)
    with pytest.raises(ValueError, match=rf"{where}: ") as info:
        validate_budget(case)
    assert "schema version 1" in str(info.value)


def test_loading_a_broken_file_names_the_file(data: dict[str, Any], tmp_path: Path) -> None:
    data["spec"]["iters"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.json .*spec\.iters: Input should be greater"):
        load_budget_table(path)


def test_png_beside_the_json(table_path: Path) -> None:
    png = table_path.with_suffix(".png")
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_real_table_budget_is_monotone_in_the_slo(table_path: Path) -> None:
    table = load_budget_table(table_path)
    slos = [0.5, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144]
    budgets = [table.recommend(s)[0] for s in slos]
    assert budgets == sorted(budgets)
    for slo in slos:
        budget, chunk = table.recommend(slo)
        assert budget % 16 == 0 and chunk % 16 == 0 and chunk <= budget
