"""A calibration a person can run: the grid sized to the device after a pilot, the estimate
printed before the sweep, `--check` allowing for the noise both runs measured, and an
existing table never overwritten silently."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cluster.cli import allowed_drift, drift_report, main
from cluster.config import TokenflowConfig
from controller.budget import BudgetTable
from tests.calibrator.conftest import SMALL_RUN
from workers.budget_file import load_budget_table
from workers.calibrate import (
    CalibrationSpec,
    GridSizing,
    StepGuess,
    prefill_points,
    relative_iqr,
    size_grid,
)

FULL = CalibrationSpec.of(TokenflowConfig().calibration, model="builtin:bench",
                          dtype="float32", device="cpu", block_size=16, tile_tokens=16,
                          threads=1)
# Roughly builtin:bench on one core of this VM: 18 ms a step, 0.6 ms a token, 0.4 us a pair.
GUESS = StepGuess(base_s=0.018, token_s=6e-4, pair_s=3.7e-7)
SIZING = GridSizing(max_duration_s=150.0, min_iters=10, min_chunk_sizes=3)
LIMIT = 8192


def test_the_default_grid_is_cut_to_the_budget_samples_first() -> None:
    assert GUESS.sweep_s(FULL, LIMIT) > 20 * 60  # the uncut grid: the 24+ minutes seen
    sized = size_grid(FULL, GUESS, LIMIT, SIZING, budget_s=150.0)
    assert GUESS.sweep_s(sized, LIMIT) <= 150.0
    assert (sized.iters, sized.warmup) == (10, 1)
    assert sized.prefill_tokens == FULL.prefill_tokens[:len(sized.prefill_tokens)]
    assert 3 <= len(sized.prefill_tokens) < len(FULL.prefill_tokens)
    assert sized.decode_batches == FULL.decode_batches  # decodes are cheap: all kept
    # A grid that fits is measured as asked; a budget nothing fits keeps the minimum.
    assert size_grid(FULL, GUESS, LIMIT, SIZING, budget_s=1e9) == FULL
    tiny = size_grid(FULL, GUESS, LIMIT, SIZING, budget_s=0.001)
    assert len(tiny.prefill_tokens) == 3 and len(tiny.contexts) == 1


def test_the_estimate_counts_admissions_and_rounds() -> None:
    spec = dataclasses.replace(FULL, prefill_tokens=(16,), contexts=(0,), decode_batches=(1,),
                               decode_contexts=(128,), warmup=1, iters=2)
    one_prefill, one_decode = GUESS.prefill_s(16, 0), GUESS.decode_s(1, 128)
    assert GUESS.sweep_s(spec, LIMIT) == pytest.approx(one_prefill * 4 + one_decode * 3)
    assert prefill_points(spec, 8) == []  # past the model's length: never measured


def test_relative_iqr_ignores_one_burst() -> None:
    assert relative_iqr([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert relative_iqr([1.0, 1.0, 1.0, 1.0, 1.0, 30.0]) == 0.0  # one stolen-time burst
    assert relative_iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0 / 3.0)


def test_check_allows_for_the_measured_noise(table_path: Path) -> None:
    old = load_budget_table(table_path)
    assert set(old.data["noise"]) == {"prefill_time", "decode_time", "peak_flops",
                                      "memory_bandwidth"}

    def with_noise(data: dict, spread: float, factor: float) -> BudgetTable:
        data = json.loads(json.dumps(data))
        data["noise"] = dict.fromkeys(data["noise"], spread)
        for point in data["prefill"]:
            point["median_s"] *= factor
        return BudgetTable(data)

    quiet, noisy = with_noise(old.data, 0.0, 1.0), with_noise(old.data, 0.05, 1.0)
    drifted = with_noise(old.data, 0.05, 1.15)  # 15 % slower prefill
    assert allowed_drift(quiet, quiet, 0.10, 2.0)["prefill_time"] == pytest.approx(0.10)
    allowed = allowed_drift(noisy, drifted, 0.10, 2.0)
    assert allowed["prefill_time"] == pytest.approx(0.20)
    assert allowed["capacity_tokens"] == pytest.approx(0.10)  # computed, not timed
    assert drift_report(noisy, drifted)["prefill_time"] <= allowed["prefill_time"]
    # Without the noise, the same 15 % is drift; a table without noise gets the tolerance.
    assert drift_report(quiet, with_noise(old.data, 0.0, 1.15))["prefill_time"] > 0.10
    bare = dict(old.data)
    bare.pop("noise")
    assert allowed_drift(BudgetTable(bare), BudgetTable(bare), 0.1, 2.0)["peak_flops"] == 0.1


def test_calibrate_prints_its_estimate_first_and_keeps_an_existing_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "budget.json"
    args = ["calibrate", "--model", "builtin:tiny", "--out", str(out), "--no-plot",
            *SMALL_RUN]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("calibrate: estimated ")
    assert lines[1].startswith(f"wrote {out}")
    table = load_budget_table(out)
    assert table.data["spec"]["iters"] == 2  # what was measured is what --check repeats
    before = out.read_bytes()
    assert main(args) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == before
