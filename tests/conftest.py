"""Fixtures for the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def preset_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Builtin presets go to a per-session folder, never into the user's cache."""
    root = tmp_path_factory.mktemp("tokenflow-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENFLOW_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="session", autouse=True)
def fixed_budgets() -> Iterator[None]:
    """The suite's engines and clusters start with the fixed budgets: no calibration at
    start (a test that wants one asks for it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENFLOW_CALIBRATION__AUTO", "false")
        yield
