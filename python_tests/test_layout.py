"""The package's layout, checked on its source: folders are layers and imports point one way
(ops <- decoding <- the front-ends; the CPU accelerators beside the loop), no private name is
used outside its folder, and no module is much over 400 lines (none in decoding/ over 400).

A static check (``ast``): it reads every module of ``specdec_kernels/`` and resolves its imports,
module-level and inside functions alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "specdec_kernels"
# no module over ~400 lines (400 with a few lines' slack); none in decoding/ over 400
MAX_LINES = 420
MAX_DECODING_LINES = 400

# layer -> the layers it may import from (its own included)
ALLOWED = {
    "ops": {"ops"},
    "models": {"models"},
    "cpu": {"cpu", "ops"},
    "decoding": {"decoding", "ops", "models", "cpu"},
    "integrations": {"integrations", "ops", "decoding"},
    "front": {"front", "ops", "decoding", "models", "cpu", "integrations"},
}


def _layer(module: str) -> str:
    """The layer of a dotted module under specdec_kernels ('' = the package itself)."""
    head = module.split(".")[0] if module else ""
    return head if head in ("ops", "models", "cpu", "decoding", "integrations") else "front"


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield path, ".".join(parts), is_pkg


def _imports(path: Path, module: str, is_pkg: bool):
    """(line, the imported module under specdec_kernels, the names taken from it, at module
    level?) for every import of the package's own modules."""
    tree = ast.parse(path.read_text())
    package = module.split(".") if is_pkg else module.split(".")[:-1]
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "specdec_kernels" or node.module.startswith("specdec_kernels.")):
                target = node.module[len("specdec_kernels."):] if "." in node.module else ""
            else:
                continue
            names = [a.name for a in node.names]
            # "from .pkg import mod": a module, not a name
            mods = [n for n in names if (PKG / Path(*target.split(".")) / f"{n}.py").exists()
                    or (PKG / Path(*target.split(".")) / n).is_dir()] if target or node.level else []
            for n in mods:
                yield node.lineno, (target + "." if target else "") + n, [], id(node) in top_level
            yield node.lineno, target, [n for n in names if n not in mods], id(node) in top_level
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("specdec_kernels."):
                    yield node.lineno, a.name[len("specdec_kernels."):], [], id(node) in top_level


def _folder(module: str, is_pkg: bool) -> str:
    parts = module.split(".") if module else []
    return ".".join(parts if is_pkg else parts[:-1])


MODULES = list(_modules())


def test_the_walk_sees_the_package():
    names = {m for _, m, _ in MODULES}
    assert {"ops.verify", "decoding.decoder", "decoding.drafters.base", "cpu.accelerator", "cli"} <= names


@pytest.mark.parametrize("path,module,is_pkg", MODULES, ids=[m or "specdec_kernels" for _, m, _ in MODULES])
def test_imports_point_one_way(path, module, is_pkg):
    mine = _layer(module)
    bad = [f"{path.name}:{line}: imports {target or 'specdec_kernels'} ({_layer(target)})"
           for line, target, _, _ in _imports(path, module, is_pkg)
           if _layer(target) not in ALLOWED[mine]]
    assert not bad, f"{module} is in layer {mine!r}, which may import {sorted(ALLOWED[mine])}: " + "; ".join(bad)


@pytest.mark.parametrize("path,module,is_pkg", MODULES, ids=[m or "specdec_kernels" for _, m, _ in MODULES])
def test_no_private_name_crosses_a_folder(path, module, is_pkg):
    here = _folder(module, is_pkg)
    bad = []
    for line, target, names, _ in _imports(path, module, is_pkg):
        target_pkg_dir = PKG / Path(*target.split(".")) if target else PKG
        there = target if target_pkg_dir.is_dir() else ".".join(target.split(".")[:-1])
        if there == here:
            continue
        private_module = any(p.startswith("_") and p != "__init__" for p in target.split(".") if p)
        private_names = [n for n in names if n.startswith("_")]
        if private_module or private_names:
            bad.append(f"{path.name}:{line}: {target} {private_names or '(a private module)'}")
    assert not bad, f"{module} uses private names of another folder: " + "; ".join(bad)


def test_the_loop_imports_no_accelerator():
    """The decoding layer imports ``cpu/`` in one place only, the assembly of a decoder's parts
    (where it builds the default accelerator), never at module level: the loop is handed it."""
    sites = [(m, line, top) for path, m, is_pkg in MODULES if _layer(m) == "decoding"
             for line, target, _, top in _imports(path, m, is_pkg) if _layer(target) == "cpu"]
    assert [m for m, _, _ in sites] == ["decoding.parts"], sites
    assert not any(top for _, _, top in sites), sites


@pytest.mark.parametrize("path,module,is_pkg", MODULES, ids=[m or "specdec_kernels" for _, m, _ in MODULES])
def test_no_module_is_long(path, module, is_pkg):
    n = path.read_text().count("\n")
    limit = MAX_DECODING_LINES if _layer(module) == "decoding" else MAX_LINES
    assert n <= limit, f"{module} has {n} lines (> {limit}): split it by responsibility"


def test_the_package_imports_public_names_only():
    """``specdec_kernels/__init__.py`` imports only what it exports (no import for its side effects)."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    exported = set(ast.literal_eval(next(n.value for n in tree.body if isinstance(n, ast.Assign)
                                         and any(getattr(t, "id", None) == "__all__" for t in n.targets))))
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert imported - exported == {"hf"}, imported - exported  # hf: the public module of custom_generate


def _decoder_private_members() -> set:
    """The private members of ``SpeculativeDecoder``: its methods and attributes named ``_x``
    (the class's own, and those its methods assign on ``self``), dunders aside."""
    tree = ast.parse((PKG / "decoding" / "decoder.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeDecoder")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


FRONT_ENDS = [(path, m) for path, m, _ in MODULES if _layer(m) in ("front", "integrations")]


@pytest.mark.parametrize("path,module", FRONT_ENDS, ids=[m or "specdec_kernels" for _, m in FRONT_ENDS])
def test_front_ends_reach_no_private_member_of_the_decoder(path, module):
    """``hf.py``, the CLI and the integrations drive ``SpeculativeDecoder`` through its public
    members (``start``, ``decode``, ``generate``, ``vocab_size``, ...): no attribute named like
    one of its private members is read or written in them."""
    private = _decoder_private_members()
    bad = [f"{path.name}:{n.lineno}: .{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
           if isinstance(n, ast.Attribute) and n.attr in private]
    assert not bad, f"{module} reaches private members of SpeculativeDecoder: " + "; ".join(bad)
