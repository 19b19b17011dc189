"""Rules that keep the package importable and installable the same way from a clone and from a wheel.

- no ``sys.path`` edit anywhere in mechprobe/: a module that edits the import path imports different code
  depending on where it runs from;
- no module imports a private (underscore) name from another subpackage: a rename inside one subpackage must not
  break another (inside one subpackage, private names are shared freely);
- no function-level import of a standard-library module: they cost nothing at module level, where a reader sees
  every dependency at once (function-level imports of mechprobe itself are caught by
  ``test_layers.test_no_package_import_hides_inside_a_function``; argparse below cli/ by
  ``test_cli_imports.test_argparse_is_imported_only_by_the_command_line``);
- the package reads no path under tests/: a wheel has no tests/ folder, so its data lives in mechprobe/data/.

Each checker runs on a small file that breaks its rule once, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.architecture.test_layers import PKG, import_from_module, modules

SYS_PATH_EDITS = {"append", "insert", "extend", "remove", "pop", "clear", "__setitem__", "__delitem__"}


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(path: Path) -> list[int]:
    """Lines of ``path`` that change ``sys.path`` (a call of one of its mutating methods, an assignment to it or to
    an item or slice of it, or ``site.addsitedir``)."""
    lines = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr in SYS_PATH_EDITS and _is_sys_path(n.func.value):
                lines.append(n.lineno)
            elif n.func.attr == "addsitedir":
                lines.append(n.lineno)
        elif isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = n.targets if isinstance(n, ast.Assign | ast.Delete) else [n.target]
            for t in targets:
                if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                    lines.append(n.lineno)
    return sorted(lines)


def _subpackage(module: str) -> str:
    """``mechprobe.judges.local`` -> ``judges``; a top-level module (``mechprobe.stages``) is its own subpackage."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_cross_imports(name: str, path: Path, known: set[str]) -> list[str]:
    """Private names that module ``name`` takes from a module of another subpackage: ``from m import _x``, or
    ``m._x`` where ``m`` was imported as a module (``from mechprobe.lm import chat`` then ``chat._x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> the mechprobe module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = import_from_module(name, is_pkg, node)
            if not src.startswith("mechprobe."):
                continue
            for a in node.names:
                if _private(a.name) and _subpackage(src) != _subpackage(name):
                    found.append(f"{name}:{node.lineno} imports {a.name} from {src}")
                if f"{src}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mechprobe.") and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _private(node.attr) and _subpackage(bound[node.value.id]) != _subpackage(name)):
            found.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr} of {bound[node.value.id]}")
    return found


def function_level_stdlib_imports(path: Path) -> list[str]:
    """``line: module`` for every standard-library import inside a function of ``path``."""
    found: list[str] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            inner = in_func or isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if in_func and isinstance(ch, ast.Import | ast.ImportFrom):
                if isinstance(ch, ast.Import):
                    names = [a.name for a in ch.names]
                else:
                    names = [] if ch.level else [ch.module or ""]
                found.extend(f"{ch.lineno}: {m}" for m in names if m.split(".")[0] in sys.stdlib_module_names)
            visit(ch, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def paths_under_tests(path: Path) -> list[str]:
    """``line: string`` for every string of ``path`` (docstrings aside) that names the repository's tests/ folder:
    the component ``"tests"`` or ``"fixtures"``, or a path starting with or containing ``tests/``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            s = n.value.replace("\\", "/")
            if s in ("tests", "fixtures") or s.startswith("tests/") or "/tests/" in s:
                found.append(f"{n.lineno}: {n.value!r}")
    return found


def test_no_module_edits_sys_path():
    found = [f"{p.relative_to(PKG.parent)}:{line}" for p in sorted(PKG.rglob("*.py")) for line in sys_path_edits(p)]
    assert not found, ("sys.path edits in the package (import through the installed package instead):\n  "
                       + "\n  ".join(found))


def test_no_module_imports_a_private_name_of_another_subpackage():
    mods = modules()
    found = [u for name, p in mods.items() for u in private_cross_imports(name, p, set(mods))]
    assert not found, ("private names used across subpackages; make each public in its module (a name without the "
                       "underscore and a docstring saying who needs it):\n  " + "\n  ".join(found))


def test_no_standard_library_import_hides_inside_a_function():
    found = [f"{p.relative_to(PKG.parent)}:{u}" for p in sorted(PKG.rglob("*.py"))
             for u in function_level_stdlib_imports(p)]
    assert not found, "standard-library imports inside functions (move them to module level):\n  " + "\n  ".join(found)


def test_the_package_reads_no_path_under_tests():
    found = [f"{p.relative_to(PKG.parent)}:{u}" for p in sorted(PKG.rglob("*.py")) for u in paths_under_tests(p)]
    assert not found, ("the package names files under tests/, which a wheel does not have; copy the data into "
                       "mechprobe/data/ and read it with importlib.resources:\n  " + "\n  ".join(found))


def test_the_checkers_catch_what_they_forbid(tmp_path):
    """Each checker on a file that breaks its rule (and on one that keeps it)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nfrom pathlib import Path\nfrom mechprobe.lm import chat\n"
        "from mechprobe.activations.backends import _hidden\nfrom mechprobe.judges.base import _same\n"
        "sys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n"
        "def f():\n    import json\n    from collections import OrderedDict\n    import torch\n"
        "    return chat._cut(), Path(__file__).parents[2] / 'tests' / 'fixtures' / 'x.jsonl'\n"
        "DATA = 'tests/fixtures/x.jsonl'\n")
    good = tmp_path / "good.py"
    good.write_text('"""Reads tests/fixtures in its docstring only."""\nimport sys\nprint(sys.path)\n'
                    "def f():\n    import torch\n    return torch\n")
    known = set(modules())
    assert sys_path_edits(bad) == [6, 7] and sys_path_edits(good) == []
    cross = private_cross_imports("mechprobe.judges.x", bad, known)
    assert len(cross) == 2 and "_hidden" in cross[0] and "chat._cut" in cross[1], cross  # judges' own _same is fine
    assert function_level_stdlib_imports(bad) == ["9: json", "10: collections"]
    assert function_level_stdlib_imports(good) == []
    assert sorted(u.split(":")[0] for u in paths_under_tests(bad)) == ["12", "12", "13"] and paths_under_tests(good) == []


def test_every_subpackage_says_what_it_holds():
    """Each subpackage's ``__init__`` docstring tells a newcomer what the package is for and which module holds
    what; a placeholder such as ``mechprobe.lm.`` tells nothing."""
    pkg = Path(__file__).resolve().parents[2] / "mechprobe"
    thin = []
    for init in sorted(pkg.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if len(doc) < 120 or doc.strip().startswith("mechprobe."):
            thin.append(f"{init.parent.name}: {doc[:40]!r}")
    assert not thin, "subpackages without a real docstring: " + "; ".join(thin)
