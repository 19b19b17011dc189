"""The command line stays a thin top layer: it uses only public names of the package, and argparse lives in it.

Why: a command that reaches for ``_helper`` of a lower module ties the command line to that module's insides
(a rename below breaks the CLI), and an argparse import below ``cli/`` means a namespace or a flag parser
travels into the package, where a typed config belongs. A failure names the file, the line and the fix.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mechprobe"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, pkg: Path) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module if is_pkg else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def private_uses(path: Path, pkg: Path = PKG) -> list[str]:
    """Private names of other mechprobe modules that ``path`` imports (``from m import _x``) or reads (``m._x``)."""
    module = _module_name(path, pkg)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: set[str] = set()  # local names bound to mechprobe modules or objects
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _absolute(module, path.name == "__init__.py", node)
            if src == "mechprobe" or src.startswith("mechprobe."):
                for a in node.names:
                    if _private(a.name):
                        found.append(f"{path.name}:{node.lineno}: from {src} import {a.name}")
                    bound.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mechprobe."):
                    bound.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _private(node.attr)):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def argparse_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import argparse (at module level or inside a function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree)
            if (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "argparse")]


def below_cli(pkg: Path = PKG) -> list[Path]:
    return [p for p in sorted(pkg.rglob("*.py")) if p.relative_to(pkg).parts[0] not in ("cli", "__main__.py")]


def test_cli_modules_use_only_public_names_of_the_package():
    found = [u for p in sorted((PKG / "cli").glob("*.py")) for u in private_uses(p)]
    assert not found, ("the command line uses private names of the package; make each public in its module (a "
                       "name without the underscore and a docstring saying why the CLI needs it):\n  "
                       + "\n  ".join(found))


def test_argparse_is_imported_only_by_the_command_line():
    found = [f"{p.relative_to(PKG.parent)}:{line}" for p in below_cli() for line in argparse_imports(p)]
    assert not found, ("argparse below mechprobe/cli: parse flags in cli/ (argparse type= helpers go to "
                       "cli/common.py) and pass a typed config down:\n  " + "\n  ".join(found))


def test_the_checks_catch_what_they_forbid(tmp_path):
    """Both checks on a small package that breaks each rule once (so a check that sees nothing cannot pass)."""
    pkg = tmp_path / "mechprobe"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "lm").mkdir()
    (pkg / "lm" / "models.py").write_text("import argparse\n\ndef _load():\n    pass\n")
    (pkg / "cli" / "x.py").write_text("from mechprobe.lm.models import _load\nfrom mechprobe.lm import models\n"
                                      "from ..lm.models import _load as again\nmodels._load()\nmodels.__name__\n")
    uses = private_uses(pkg / "cli" / "x.py", pkg)
    assert len(uses) == 3 and all("_load" in u for u in uses), uses
    assert [p.name for p in below_cli(pkg)] == ["models.py"] and argparse_imports(pkg / "lm" / "models.py") == [1]
