"""Importing `workers` bounds OpenMP's spin before torch loads libgomp, and leaves a policy
the environment already states alone (workers/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import workers, os; print(os.environ.get('GOMP_SPINCOUNT'), "
         "os.environ.get('OMP_WAIT_POLICY'))")


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_bare_environment_gets_the_bounded_spin() -> None:
    from workers import SPIN_COUNT

    assert _probe() == f"{SPIN_COUNT} None"


@pytest.mark.parametrize(("env", "expected"), [
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),
    ({"GOMP_SPINCOUNT": "7"}, "7 None"),
])
def test_a_stated_policy_is_kept(env: dict[str, str], expected: str) -> None:
    assert _probe(**env) == expected
