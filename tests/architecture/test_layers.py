"""The package's layers: every import (module level *and* inside functions) points down or sideways, never up,
and no module is part of an import cycle. The layer order is written once, here; docs/architecture.md draws it.

A failure names the importing module, the imported one and their layers, so the fix is clear: move the shared
code down to the lower layer (or into :mod:`mechprobe.cli` if it is command-line wiring).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "mechprobe"

# Lowest first. A module may import its own layer and any layer before it; inside a layer, no cycles.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("errors", "io", "records", "taxonomy", "stats", "redact", "plots", "splits")),
    ("audit", ("audit",)),
    ("findings", ("findings",)),
    ("lm", ("lm",)),
    ("turns", ("turns",)),
    ("judges", ("judges",)),
    ("activations", ("activations",)),
    ("stages", ("stages",)),
    ("linear", ("linear",)),
    ("steering", ("steering",)),
    ("post_train", ("post_train",)),
    ("study", ("study",)),
    ("cli", ("cli", "__main__")),
]
TOP = {"__init__"}  # the public API re-exports from every layer


def layer_of(module: str) -> int:
    """Rank of ``mechprobe.x.y`` by its first component after the package name."""
    first = module.split(".")[1] if "." in module else "__init__"
    for rank, (_, heads) in enumerate(LAYERS):
        if first in heads:
            return rank
    raise AssertionError(f"{module}: not in any layer of tests/architecture/test_layers.py; add it to LAYERS")


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def import_from_module(name: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in module ``name`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = name if is_pkg else name.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every mechprobe import of a file."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def resolve(mod: str) -> str:
        while mod not in known and "." in mod:  # `from mechprobe.x import name` where name is not a module
            mod = mod.rsplit(".", 1)[0]
        return mod

    def visit(node: ast.AST, in_func: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            inner = in_func or isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(ch, ast.ImportFrom):
                mod = import_from_module(name, is_pkg, ch)
                if mod == "mechprobe" or mod.startswith("mechprobe."):
                    for a in ch.names:  # `from mechprobe.lm import chat` imports the module mechprobe.lm.chat
                        sub = f"{mod}.{a.name}"
                        found.append((sub if sub in known else resolve(mod), ch.lineno, inner))
            elif isinstance(ch, ast.Import):
                for a in ch.names:
                    if a.name.startswith("mechprobe"):
                        found.append((resolve(a.name), ch.lineno, inner))
            visit(ch, inner)

    visit(tree, False)
    return found


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = modules()
    known = set(mods)
    return {name: [(t, ln, f) for t, ln, f in imports_of(name, p, known) if t != name] for name, p in mods.items()}


def test_every_module_has_a_layer():
    for name in modules():
        if name != "mechprobe":
            layer_of(name)


def test_no_import_points_up_a_layer():
    bad = []
    for src, deps in graph().items():
        if src == "mechprobe" or src.split(".")[-1] in TOP and src.count(".") == 0:
            continue
        for dst, line, in_func in deps:
            if dst == "mechprobe":
                bad.append(f"{src}:{line} imports the package root (import from the defining module instead)")
                continue
            if layer_of(dst) > layer_of(src):
                where = "inside a function" if in_func else "at module level"
                bad.append(f"{src}:{line} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]}) "
                           f"{where}")
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_no_import_cycles():
    g = {src: sorted({d for d, _, _ in deps if d != "mechprobe"}) for src, deps in graph().items()}
    # package __init__ files re-export their children: an edge parent -> child is not a cycle through the parent
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, []):
            if w not in index:
                strong(w)
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
                sccs.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    assert not sccs, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in sccs)


def test_the_package_runs_no_script_of_the_repository():
    """The package must work from a wheel: nothing under mechprobe/ reads or runs experiments/."""
    offenders = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
                 if "spec_from_file_location" in p.read_text()
                 or '"experiments"' in p.read_text() or "'experiments'" in p.read_text()]
    assert not offenders


@pytest.mark.parametrize("script", sorted((PKG.parent / "experiments").glob("*.py")), ids=lambda p: p.name)
def test_experiment_scripts_are_thin(script):
    n = len(script.read_text().splitlines())
    assert n <= 40, f"{script.name} has {n} lines: move its logic into mechprobe/ (the script only calls main)"


def test_the_checker_catches_an_upward_import(tmp_path):
    """The checker itself can fail: a foundation module importing a judge is reported."""
    fake = tmp_path / "stats.py"
    fake.write_text("def f():\n    from mechprobe.judges.factory import make_judge\n")
    deps = imports_of("mechprobe.stats", fake, set(modules()))
    assert deps == [("mechprobe.judges.factory", 2, True)]
    assert layer_of("mechprobe.judges.factory") > layer_of("mechprobe.stats")


def test_no_package_import_hides_inside_a_function():
    """Imports of mechprobe modules sit at module level, where a reader (and this test) sees them; a function-level
    import is how cycles used to hide. Lazy imports stay only for optional heavy third-party packages."""
    hidden = [f"{src}:{line} imports {dst}" for src, deps in graph().items() for dst, line, in_func in deps if in_func]
    assert not hidden, "function-level imports of the package:\n" + "\n".join(hidden)


def test_every_package_import_names_an_existing_module():
    """``from .errors import X`` inside a subpackage, or a module path that moved, fails only when that line runs:
    read every import statement and check its module exists."""
    known = set(modules())
    missing = []
    for name, path in modules().items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = import_from_module(name, is_pkg, node)
                if (mod == "mechprobe" or mod.startswith("mechprobe.")) and mod not in known:
                    missing.append(f"{name}:{node.lineno} imports {mod}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
