"""Fixtures of the calibrator tests: one real (small) calibration of builtin:tiny per session.

Sample counts are far below the seed's 5 + 20 (one warm-up run, two kept) so the whole
directory stays well under a minute on two shared cores; the tests only need a table that is
real, not a precise one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main

SMALL_RUN = ["--warmup", "1", "--iters", "2", "--max-tokens", "64", "--contexts", "0,64",
             "--decode-batches", "1,4", "--threads", "1", "--no-progress",
             "--matmul-size", "512", "--bandwidth-bytes", str(64 * 2**20)]


@pytest.fixture(scope="session")
def table_path(tmp_path_factory: pytest.TempPathFactory, preset_cache: Path) -> Path:
    """A fresh budget table of builtin:tiny, written through the CLI (PNG beside it)."""
    path = tmp_path_factory.mktemp("calibration") / "budget.json"
    code = main(["calibrate", "--model", "builtin:tiny", "--out", str(path),
                 "--itl-slo-ms", "20", *SMALL_RUN])
    assert code == 0
    return path
