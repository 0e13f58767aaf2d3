"""No import circle anywhere in the package: the graph of which ``specdec_kernels`` module imports
which (at the top, inside functions and under ``TYPE_CHECKING`` alike) has no cycle, so every
module can be read, and loaded, after the ones it names.  A package's ``__init__`` re-exporting
its own modules is not a circle (a module importing its package's ``__init__`` is followed only
to the names it takes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "specdec_kernels"


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict:
    """module -> the package modules it imports (a name taken from a package's ``__init__``
    counts as the submodule of that name when there is one, else as the ``__init__``)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods:  # a.b.c where a.b is the module
                    t = t.rpartition(".")[0]
                if t and t != mod and not (is_pkg and t.startswith(mod + ".")):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_of_every_form():
    g = import_graph()
    adapter = "specdec_kernels.decoding.transformers_adapter."
    assert adapter + "processors" in g[adapter + "config"]  # at the top  # at the top
    assert "specdec_kernels.decoding.state" in g["specdec_kernels.decoding.drafters.base"]  # under TYPE_CHECKING
    assert "specdec_kernels.ops.verify.api" not in g["specdec_kernels.ops.verify"]  # a package's own modules
    assert "specdec_kernels.audit.vllm_bridge" in g["specdec_kernels.audit.adapters"]  # inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (each a set of modules that import one another): " + "; ".join(
        " <-> ".join(c) for c in found)
