"""The C++ kernels' build cache (workers/kernels/cpu_ops.py): a builder killed mid-build
does not leave every later start waiting, and a source that moves (a Ray job runs a per-job
copy of the code) is not recompiled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.kernels import cpu_ops as ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build_dir() -> Path:
    if ops.cpu_ops() is None:
        pytest.skip("no C++ toolchain here: the torch path serves")
    return Path.home() / ".cache" / "tokenflow" / "cpu_ops" / ops.cpu_tag()


def test_a_dead_builders_lock_does_not_block_the_next_start(build_dir: Path) -> None:
    (build_dir / "lock").touch()  # torch's lock file, as a builder killed mid-build leaves it
    out = subprocess.run([sys.executable, "-m", "workers.kernels.cpu_ops"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert not (build_dir / "lock").exists()


def test_the_build_reads_a_stable_copy_rewritten_only_when_the_text_changes(
        build_dir: Path, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere" / "cpu_attention.cpp"  # a job's copy of the same file
    moved.parent.mkdir()
    moved.write_bytes(ops.SOURCES[0].read_bytes())
    folder = tmp_path / "build"
    folder.mkdir()
    copy = ops._stable_copy(moved, folder)
    assert copy.parent == folder and copy.read_bytes() == moved.read_bytes()
    stamp = copy.stat().st_mtime_ns
    assert ops._stable_copy(moved, folder) == copy
    assert copy.stat().st_mtime_ns == stamp  # same text: untouched, nothing to rebuild
    moved.write_bytes(moved.read_bytes() + b"\n// changed\n")
    ops._stable_copy(moved, folder)
    assert copy.read_bytes().endswith(b"// changed\n")
    # The real build reads its copy, never the tree's path.
    assert f"compile {build_dir / 'cpu_attention.cpp'}" in (build_dir / "build.ninja").read_text()
