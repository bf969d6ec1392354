"""The dependency direction of DESIGN.md: the cores import neither torch nor Ray."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_controller_and_kvcache_cores_import_no_torch_ray_or_pydantic():
    modules = sorted(
        f"{p.parent.name}.{p.stem}" for d in ("controller", "kvcache")
        for p in (ROOT / d).glob("*.py")
        if p.stem not in ("__init__", "actor"))  # actor.py is the thin Ray wrapper
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in ('torch', 'ray', 'pydantic') if m in sys.modules)\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "", f"imported by the cores: {out.stdout.strip()}"
    assert len(modules) > 10
