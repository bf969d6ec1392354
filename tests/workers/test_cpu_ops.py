"""The C++ kernels' build cache (workers/kernels/cpu_ops.py): a builder killed mid-build
does not leave every later start waiting, a source that moves (a Ray job runs a per-job
copy of the code) is not recompiled, nor is anything for a venv reached through a link."""

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


def test_a_venv_reached_through_a_link_imports_the_same_build(build_dir: Path,
                                                              tmp_path: Path) -> None:
    """The README tests' scratch folders link the checkout's .venv: their processes are
    the same torch, find the finished build's stamp and import it, rebuilding nothing
    (before, each rebuilt every kernel whenever the other kind of process had)."""
    stamps = sorted(p.name for p in build_dir.glob("built-*"))
    assert stamps == [f"built-{ops.build_key()}"]
    built = build_dir / f"tokenflow_cpu_ops_{ops.cpu_tag()}.so"
    before = built.stat().st_mtime_ns, (build_dir / "build.ninja").stat().st_mtime_ns
    venv = Path(sys.prefix)
    link = tmp_path / "venv"
    link.symlink_to(venv)
    python = link / Path(sys.executable).relative_to(venv)
    probe = ("from workers.kernels import cpu_ops as o; m = o.cpu_ops(); "
             "print(o.cpu_tag(), m.decode_gemm_block())")
    out = subprocess.run([str(python), "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    tag, block = out.stdout.split()
    assert tag == ops.cpu_tag() and int(block) == ops.cpu_ops().decode_gemm_block()
    after = built.stat().st_mtime_ns, (build_dir / "build.ninja").stat().st_mtime_ns
    assert after == before  # nothing rebuilt, not even the build file rewritten


BIND_PROBE = """
import json, os, torch
torch.set_num_threads({threads})
from workers.cpu_setup import bind_threads_to_cores
cores = bind_threads_to_cores()
x = torch.randn(512, 512)
for _ in range(20):
    x @ x  # regions on the pinned threads
lists = [open(f"/proc/self/task/{{t}}/status").read().split("Cpus_allowed_list:")[1].split()[0]
         for t in os.listdir("/proc/self/task")]
print(json.dumps({{"cores": cores, "main": sorted(os.sched_getaffinity(0)), "lists": lists}}))
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_bind_threads_pins_each_torch_thread_to_its_own_core(build_dir: Path,
                                                             threads: int) -> None:
    """In a process of its own (pinning is process state): with as many torch threads as
    cores each thread gets one core, the main thread the first; with fewer threads nothing
    is pinned. The worker actor calls it (`worker.cpu_bind_threads`)."""
    import json
    import os

    cores = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", BIND_PROBE.format(threads=threads)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if threads == len(cores) and threads > 1:
        assert got["cores"] == cores
        assert got["main"] == cores[:1]  # thread 0 of the pool is the caller
        # every core has a thread pinned to it alone
        assert {str(c) for c in cores} <= set(got["lists"])
    else:
        assert got["cores"] == [] and got["main"] == cores
        assert all(not entry.isdigit() or len(cores) == 1 for entry in got["lists"])
