"""The dependency direction: the cores import neither torch nor Ray, and no module of
`cluster/` imports itself back through another one."""

import ast
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


def _cluster_import_graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "cluster").rglob("*.py"))
    names = {}
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
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


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_cluster_modules() -> None:
    graph = _cluster_import_graph()
    assert {"cluster.batch", "cluster.batch_io", "cluster.remote_batch"} <= graph.keys()
    assert "cluster.batch_io" in graph["cluster.remote_batch"]  # imports are seen
    assert "cluster.protocol" in graph["cluster.frontend"]  # `from cluster import protocol`
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
