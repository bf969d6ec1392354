"""A calibration a person can run: the grid sized to the device after a pilot, the estimate
printed before the sweep, `--check` allowing for the noise both runs measured, and an
existing table never overwritten silently."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.cli import allowed_drift, drift_report, main
from cluster.config import TokenflowConfig
from controller.budget import BudgetTable
from tests.calibrator.conftest import SMALL_RUN
from workers.budget_file import load_budget_table
from workers.calibrate import CalibrationSpec, Calibrator
from workers.calibration_grid import (
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
    # A prefill point's admission is its warm-up run; a decode point warms up in round 0.
    assert GUESS.sweep_s(spec, LIMIT) == pytest.approx(one_prefill * 3 + one_decode * 3)
    no_warmup = dataclasses.replace(spec, warmup=0)
    assert GUESS.sweep_s(no_warmup, LIMIT) == pytest.approx(one_prefill * 3 + one_decode * 2)
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


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_an_admitted_point_counts_its_admission_as_a_warm_up_run(warmup: int) -> None:
    """Each point runs `warmup` discarded runs, then `iters` kept ones, in interleaved
    rounds; a prefill point already ran once to be admitted, so it sits out round 0."""
    spec = dataclasses.replace(FULL, warmup=warmup, iters=3)
    order: list[str] = []
    finished: list[object] = []

    def point(name: str) -> Callable[[], tuple[float, int]]:
        def run() -> tuple[float, int]:
            order.append(name)
            return float(len(order)), 0  # the n-th run of the sweep takes n seconds
        return run

    calibrator = SimpleNamespace(
        spec=spec, _admitted={"prefill"}, _plan=lambda **fields: fields,
        worker=SimpleNamespace(execute=finished.append))
    stats = Calibrator.sweep(calibrator, [point("prefill"), point("decode")],  # type: ignore[arg-type]
                             num_admitted=1)
    assert order.count("prefill") == max(warmup - 1, 0) + 3  # + its admission: warmup + 3
    assert order.count("decode") == warmup + 3
    # The kept runs are the last three of each point: its discarded ones are earlier.
    kept = {name: [i + 1 for i, n in enumerate(order) if n == name][-3:]
            for name in ("prefill", "decode")}
    assert [s["median_s"] for s in stats] == [kept["prefill"][1], kept["decode"][1]]
    assert finished == [{"finished_request_ids": {"prefill"}}]  # released once, at the end


def _scripted_sweep(spec: CalibrationSpec, times: dict[str, list[float]],
                    admission: float | None) -> tuple[list[dict[str, float]], list[str]]:
    """`Calibrator.sweep` over a prefill point (admitted, its admission taking `admission`
    seconds) and a decode point, each run taking the next of its scripted times."""
    order: list[str] = []

    def point(name: str) -> Callable[[], tuple[float, int]]:
        script = iter(times[name])

        def run() -> tuple[float, int]:
            order.append(name)
            return next(script), 0
        return run

    calibrator = SimpleNamespace(
        spec=spec, _admitted={"prefill"}, _plan=lambda **fields: fields,
        worker=SimpleNamespace(execute=lambda plan: None))
    stats = Calibrator.sweep(calibrator, [point("prefill"), point("decode")],  # type: ignore[arg-type]
                             num_admitted=1,
                             admission_runs=None if admission is None else [(admission, 0)])
    return stats, order


def test_runs_that_agree_stop_early_and_a_burst_or_a_cold_run_runs_on() -> None:
    """With agree_within (the short calibration): a warm prefill point (its admission
    agrees with its first kept run) runs once in the sweep; a decode point with a cold
    warm-up run keeps its next two, which agree; a burst in a kept run gets a third run
    and the median drops it."""
    spec = dataclasses.replace(FULL, warmup=1, iters=3, agree_within=0.05)
    stats, order = _scripted_sweep(
        spec, {"prefill": [1.02, 9.0, 9.0], "decode": [2.0, 1.0, 1.03, 9.0]}, admission=1.0)
    assert order.count("prefill") == 1 and order.count("decode") == 3
    assert stats[0]["median_s"] == pytest.approx(1.01)  # admission and first kept run
    assert stats[1]["median_s"] == pytest.approx(1.015)  # the cold 2.0 s dropped
    stats, order = _scripted_sweep(
        spec, {"prefill": [1.3, 1.0, 1.01], "decode": [1.0, 1.5, 1.0, 1.01]}, admission=1.0)
    assert order.count("prefill") == 3 and order.count("decode") == 4
    assert stats[0]["median_s"] == 1.01 and stats[1]["median_s"] == 1.01  # bursts dropped
    # Without it, every point runs warmup + iters times, as before.
    stats, order = _scripted_sweep(
        dataclasses.replace(spec, agree_within=0.0),
        {"prefill": [1.0, 1.0, 1.0], "decode": [1.0, 1.0, 1.0, 1.0]}, admission=1.0)
    assert order.count("prefill") == 3 and order.count("decode") == 4


def test_the_probes_stop_at_two_runs_that_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM and copy probes keep their best run: two that agree are enough, two that
    do not run on to iters."""
    import workers.calibrate as calibrate

    asked: dict[str, list[int]] = {"gemm": [], "copy": []}
    script = {"gemm": iter([[100.0, 101.0]]), "copy": iter([[10.0, 15.0], [16.0]])}

    def probe(name: str) -> Callable[..., list[float]]:
        def runs(*args: object, iters: int, **kwargs: object) -> list[float]:
            asked[name].append(iters)
            return next(script[name])
        return runs

    monkeypatch.setattr(calibrate, "matmul_flops_runs", probe("gemm"))
    monkeypatch.setattr(calibrate, "bandwidth_runs", probe("copy"))
    spec = dataclasses.replace(FULL, iters=3, agree_within=0.05)
    calibrator = SimpleNamespace(spec=spec, worker=SimpleNamespace(dtype=None, device="cpu"))
    peaks, _ = Calibrator.hardware(calibrator)  # type: ignore[arg-type]
    assert asked == {"gemm": [2], "copy": [2, 1]}
    assert peaks == {"peak_flops": 101.0, "memory_bandwidth": 16.0}
