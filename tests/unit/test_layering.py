"""The dependency direction: the cores import neither torch nor Ray; every import of every
module of `cluster/`, `controller/`, `workers/` and `kvcache/` runs along the declared order
`cluster -> controller, workers -> kvcache` (workers reach the controller only through its
message and budget modules); and no module imports itself back through others.

Imports are read from the source (AST), at the top, inside a function or under
`TYPE_CHECKING`: each one ties the two modules together, lazily or not.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "controller", "workers", "kvcache")
# package -> the packages it may import. `cluster` is the composition root.
MAY_IMPORT = {
    "cluster": {"controller", "workers", "kvcache"},
    "controller": {"kvcache"},
    "workers": {"controller", "kvcache"},
    "kvcache": set(),
}
# What of the controller the workers may import: the messages that cross the door and the
# budget table the worker measures (with the step cost model it is fitted into, and the
# calibration section that says what to measure).
# `controller.gc_freeze` is a process utility beside them and `controller.settings` the
# sections' field helper: standard library only (checked below), so they open no path back
# into the controller.
WORKERS_MAY_IMPORT = {"controller.messages", "controller.budget", "controller.step_cost",
                      "controller.calibration", "controller.settings", "controller.gc_freeze"}


def test_controller_and_kvcache_cores_import_no_torch_ray_or_pydantic():
    modules = sorted(
        f"{p.parent.name}.{p.stem}" for d in ("controller", "kvcache")
        for p in (ROOT / d).glob("*.py")
        # The Ray actor's facade and its start-up (spawning worker actors) import Ray.
        if p.stem not in ("__init__", "actor", "startup"))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in ('torch', 'ray', 'pydantic') if m in sys.modules)\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "", f"imported by the cores: {out.stdout.strip()}"
    assert len(modules) > 10


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` imports, at the top or inside a function (a lazy import still
    ties the two modules together), as dotted names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return found


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports, for every module under `root`."""
    names = {}
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            names[path] = ".".join(parts[:-1] if is_package else parts)
    modules = set(names.values())
    graph = {}
    for path, name in names.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        imported = _imported_modules(path, package) & modules
        # A package's own submodules are parts of it, not a cycle with it.
        graph[name] = {m for m in imported if m != name and not m.startswith(f"{name}.")
                       and not name.startswith(f"{m}.")}
    return graph


def wrong_way_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs against the declared order, as 'a -> b'."""
    wrong = []
    for name, imported in sorted(graph.items()):
        top = name.partition(".")[0]
        for other in sorted(imported):
            other_top = other.partition(".")[0]
            if other_top == top:
                continue
            is_upward = other_top not in MAY_IMPORT[top]
            is_past_the_door = (top == "workers" and other_top == "controller"
                                and other != "controller" and other not in WORKERS_MAY_IMPORT)
            if is_upward or is_past_the_door:
                wrong.append(f"{name} -> {other}")
    return wrong


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for top in PACKAGES:
        (root / top).mkdir(parents=True, exist_ok=True)
        (root / top / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)


_SOUND_TREE = {
    "kvcache/pool.py": "import os\n",
    "controller/messages.py": "from dataclasses import dataclass\n",
    "controller/core.py": "from controller import messages\nfrom kvcache.pool import x\n",
    "workers/worker.py": "from controller.messages import StepPlan\nimport kvcache.pool\n",
    "cluster/engine.py": ("from controller.core import Core\n"
                          "def make():\n    from workers.worker import Worker\n"),
}


def test_a_sound_synthetic_tree_passes(tmp_path: Path) -> None:
    _write_tree(tmp_path, _SOUND_TREE)
    graph = import_graph(tmp_path)
    assert graph["cluster.engine"] == {"controller.core", "workers.worker"}  # lazy too
    assert graph["controller.core"] == {"controller.messages", "kvcache.pool"}
    assert wrong_way_imports(graph) == []
    assert find_cycle(graph) is None


@pytest.mark.parametrize(("path", "text", "wrong"), [
    ("kvcache/pool.py", "from controller.messages import StepPlan\n",
     "kvcache.pool -> controller.messages"),
    ("controller/core.py", "def f():\n    from workers.worker import Worker\n",
     "controller.core -> workers.worker"),
    ("controller/core.py", "import typing\nif typing.TYPE_CHECKING:\n"
     "    from cluster.engine import E\n", "controller.core -> cluster.engine"),
    ("workers/worker.py", "from controller.core import Core\n",
     "workers.worker -> controller.core"),
    ("workers/worker.py", "from cluster import engine\n", "workers.worker -> cluster.engine"),
])
def test_an_upward_import_fails(tmp_path: Path, path: str, text: str, wrong: str) -> None:
    _write_tree(tmp_path, {**_SOUND_TREE, path: _SOUND_TREE[path] + text})
    assert wrong in wrong_way_imports(import_graph(tmp_path))


def test_a_cycle_inside_a_package_fails(tmp_path: Path) -> None:
    _write_tree(tmp_path, {**_SOUND_TREE, "controller/messages.py":
                           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from controller.core import Core\n"})
    graph = import_graph(tmp_path)
    assert wrong_way_imports(graph) == []  # the direction holds, the circle does not
    assert find_cycle(graph) == ["controller.core", "controller.messages", "controller.core"]


def test_every_import_runs_the_declared_way() -> None:
    graph = import_graph(ROOT)
    assert {"cluster.batch", "controller.core", "workers.worker", "kvcache.manager"} <= \
        graph.keys()
    assert "cluster.batch_io" in graph["cluster.remote_batch"]  # imports are seen
    assert "cluster.protocol" in graph["cluster.frontend"]  # `from cluster import protocol`
    assert wrong_way_imports(graph) == []


def test_no_import_cycle_anywhere() -> None:
    cycle = find_cycle(import_graph(ROOT))
    assert cycle is None, " -> ".join(cycle or [])


def test_what_workers_may_import_of_the_controller_opens_no_path_back() -> None:
    """The modules workers may import reach no further into the controller (the budget
    module and the messages import no other controller module; gc_freeze nothing)."""
    graph = import_graph(ROOT)
    for name in WORKERS_MAY_IMPORT:
        assert graph[name] <= WORKERS_MAY_IMPORT, (name, graph[name])
    assert graph["controller.gc_freeze"] == graph["controller.settings"] == set()
