"""Rooms of one purpose, checked on the source: no module of `cluster/`, `controller/`,
`workers/`, `kvcache/` over 450 lines, and no function or constructor there with more than
8 parameters. Exempt: Triton kernels (`@triton.jit`: a kernel takes its pointers and
strides one by one), and the GPU path's constructors and kernel launchers listed below,
which the GPU path's own work (issue 24) reshapes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "controller", "workers", "kvcache")
MAX_LINES = 450
MAX_PARAMETERS = 8
KNOWN_WIDE = {
    "workers/cuda_graphs.py:DecodeGraphs.__init__",
    "workers/attention/triton_backend.py:TritonBackend.__init__",
    "workers/attention/triton_kernels.py:unified_attention",
    "workers/attention/triton_kernels.py:split_decode_attention",
}


def _modules() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py"))


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def wide_functions(path: Path, root: Path = ROOT) -> list[str]:
    """'path:Class.name' of every function of `path` with more than MAX_PARAMETERS."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                         if a.arg not in ("self", "cls")]
                num = len(names) + (args.vararg is not None) + (args.kwarg is not None)
                if num > MAX_PARAMETERS and not _is_triton_kernel(child):
                    found.append(f"{path.relative_to(root).as_posix()}:{prefix}{child.name}")
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_module_over_450_lines() -> None:
    long = {p.relative_to(ROOT).as_posix(): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_function_over_8_parameters() -> None:
    wide = {name for p in _modules() for name in wide_functions(p)}
    assert wide - KNOWN_WIDE == set()


def test_the_check_sees_a_wide_function(tmp_path: Path) -> None:
    module = tmp_path / "workers" / "probe.py"
    module.parent.mkdir()
    module.write_text("class A:\n    def __init__(self, a, b, c, d, e, f, g, h, i): ...\n"
                      "def ok(a, b, c, d, e, f, g, h, *, k=0): ...\n"
                      "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h, i): ...\n")
    assert wide_functions(module, tmp_path) == [
        "workers/probe.py:A.__init__", "workers/probe.py:ok"]
