"""Fixtures shared by the worker tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.presets import resolve_model


@pytest.fixture(scope="session")
def tiny_path(preset_cache: Path) -> Path:
    return resolve_model("builtin:tiny")
