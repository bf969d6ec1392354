"""The CPU worker's C++ kernels (workers/kernels/csrc/), built with torch's extension builder
on first use and cached per machine under `~/.cache/tokenflow/cpu_ops/` (`make install`
builds them ahead, so a first start does not wait on the compiler).

Built with `-march=native` against the installed torch, so a build only runs on the CPU and
torch it was built for: the cache folder is keyed by the CPU's model and flags and torch's
version and folder (links resolved). A finished build leaves a stamp naming its sources'
digest and flags; a start that finds it imports the module directly (`_import_built`).
Not under `$TOKENFLOW_CACHE_DIR` (the presets' root): a build is the installed
code's, not a model's, and a per-run preset folder (the test suite's) must not recompile it.
Where they cannot be built (no compiler, no ninja), `cpu_ops()` is None and the worker keeps
the torch path; that is logged once.

    python -m workers.kernels.cpu_ops   # build (or load) now and print where
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).parent / "csrc" / "cpu_attention.cpp",
           Path(__file__).parent / "csrc" / "cpu_decode.cpp",
           Path(__file__).parent / "csrc" / "cpu_layers.cpp",
           Path(__file__).parent / "csrc" / "cpu_threads.cpp",
           Path(__file__).parent / "csrc" / "cpu_gemm.cpp",
           Path(__file__).parent / "csrc" / "cpu_screen.cpp",
           Path(__file__).parent / "csrc" / "cpu_screen_i16.cpp",
           Path(__file__).parent / "csrc" / "cpu_stack.cpp")
# Included by the sources; copied beside their copies (ninja's depfiles rebuild on a change).
HEADERS = (Path(__file__).parent / "csrc" / "cpu_vec.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' sources: a budget table measured with other kernels (their
    step times) is not this build's (workers/auto_budget.py keys its cache with it)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cpu_tag() -> str:
    """A key of this CPU and torch: the CPU's model name and feature flags, torch's version and
    folder (a `-march=native` build linked against one libtorch is valid only there)."""
    import torch

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    # The torch: its version and where it is, links resolved (a venv reached through a link,
    # as the README tests' scratch folders reach the checkout's, is the same torch).
    lines.append(f"torch {torch.__version__} {Path(torch.__file__).resolve().parent}")
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:12]


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module (attention: `decode_attention`, `chunk_attention`; the layers'
    elementwise ops: `add_rms_norm`, `rotary_`, `silu_mul_`), or None where it cannot be
    built."""
    if sys.platform != "linux":
        return None
    try:
        from torch.utils.cpp_extension import load

        tag = cpu_tag()
        build_dir = Path.home() / ".cache" / "tokenflow" / "cpu_ops" / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        # One builder at a time, by a lock the kernel drops when its holder dies. torch's own
        # lock is a file that a killed builder leaves behind (a worker killed mid-build),
        # and every later start then waits on it forever: under ours, it is stale.
        name = f"tokenflow_cpu_ops_{tag}"
        with open(build_dir / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            built = build_dir / f"{name}.so"
            stamp = build_dir / f"built-{build_key()}"
            if stamp.exists() and built.exists():
                return _import_built(name, built)
            for old in build_dir.glob("built-*"):  # the .so is about to be another build's
                old.unlink()
            for header in HEADERS:
                _stable_copy(header, build_dir)
            sources = [_stable_copy(source, build_dir) for source in SOURCES]
            module = load(name=name, sources=[str(s) for s in sources],
                          extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                          build_directory=str(build_dir), verbose=False)
            stamp.touch()
            return module
    except Exception as err:  # any build failure means: the torch path
        log.warning("CPU kernels unavailable, decode attention stays on SDPA: %s", err)
        return None


def build_key() -> str:
    """The sources' digest and the compiler's flags: a build of other sources or flags is
    not this one."""
    flags = hashlib.sha256(" ".join((*CFLAGS, "|", *LDFLAGS)).encode()).hexdigest()[:8]
    return f"{source_digest()}-{flags}"


def _import_built(name: str, path: Path) -> ModuleType:
    """The module a finished build left (its stamp names these sources and flags), imported
    as torch's loader imports it, without the loader. Why: the loader rewrites the build
    file with the include paths of the torch it runs from, and ninja rebuilds everything
    when they change; a venv reached through a link (the README tests' scratch folders) and
    the checkout's own then rebuilt the kernels each time the other had (60-90 s each on a
    2-core Zen 3, past those tests' time limits). It also skips the loader's checks at every
    start."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stable_copy(source: Path, build_dir: Path) -> Path:
    """`source` copied into the build folder, rewritten only when its text changed. The
    build file names its sources' paths, and a path that moves (a Ray job runs the code from
    a per-job copy of the working directory) made every job recompile (tens of seconds of
    compiler, orphaned when the job's head stopped, on the cores of whatever ran next)."""
    text = source.read_bytes()
    copy = build_dir / source.name
    if not copy.exists() or copy.read_bytes() != text:  # (under the build lock)
        copy.write_bytes(text)
    return copy


if __name__ == "__main__":
    module = cpu_ops()
    print(f"CPU kernels: {module.__file__ if module else 'unavailable (see the warning)'}")
    sys.exit(0 if module else 1)
