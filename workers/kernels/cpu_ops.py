"""The CPU worker's C++ kernels (workers/kernels/csrc/), built with torch's extension builder
on first use and cached per machine under `~/.cache/tokenflow/cpu_ops/` (`make install`
builds them ahead, so a first start does not wait on the compiler).

Built with `-march=native` against the installed torch, so a build only runs on the CPU and
torch it was built for: the cache folder is keyed by the CPU's model and flags and torch's
version. Not under `$TOKENFLOW_CACHE_DIR` (the presets' root): a build is the installed
code's, not a model's, and a per-run preset folder (the test suite's) must not recompile it.
Where they cannot be built (no compiler, no ninja), `cpu_ops()` is None and the worker keeps
the torch path; that is logged once.

    python -m workers.kernels.cpu_ops   # build (or load) now and print where
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).parent / "csrc" / "cpu_attention.cpp",)


def cpu_tag() -> str:
    """A key of this CPU and torch: the CPU's model name and feature flags and torch's version
    (a `-march=native` build linked against libtorch is only valid where all three match)."""
    import torch

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    lines.append(f"torch {torch.__version__}")
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:12]


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module (`decode_attention`), or None where it cannot be built."""
    if sys.platform != "linux":
        return None
    try:
        from torch.utils.cpp_extension import load

        tag = cpu_tag()
        build_dir = Path.home() / ".cache" / "tokenflow" / "cpu_ops" / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        return load(name=f"tokenflow_cpu_ops_{tag}", sources=[str(s) for s in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                    verbose=False)
    except Exception as err:  # any build failure means: the torch path
        log.warning("CPU kernels unavailable, decode attention stays on SDPA: %s", err)
        return None


if __name__ == "__main__":
    module = cpu_ops()
    print(f"CPU kernels: {module.__file__ if module else 'unavailable (see the warning)'}")
    sys.exit(0 if module else 1)
