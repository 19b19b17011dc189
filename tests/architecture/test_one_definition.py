"""One definition per name: a public function or class is defined in one module of the package.

Two definitions of one name either repeat the same logic (a fix lands in one copy only) or give the name two
meanings (``latest_checkpoint`` of the SFT loop and of the DPO trainer read different directories), and an
import then picks one by accident. The shared helper lives in the lowest layer that needs it and is imported
everywhere else; a name with another meaning gets another name.

Exceptions are names that mean "this package's own X" in each package that has one (a command module's
``add_args``/``run``, a package's ``write_report``); they are listed below with that reason. And
``mechprobe.lm.models`` exports only what it defines: its callers import device, forward and registry
helpers from the module that defines them.

Each checker runs on a small tree that breaks its rule once, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.architecture.test_layers import PKG

# The command protocol of cli/ (docs/architecture.md, "A command"): every command module defines these.
COMMAND_PROTOCOL = {"add_args", "build_parser", "config_from_args", "main", "run", "show"}
# "This package's report / sheet / argument check", one per package that writes or checks one.
PER_PACKAGE = {"build_report", "report", "report_markdown", "validate_args", "write_report", "write_sheet"}
# A fitted judge kind's own weights file: each kind with weights defines these for its own format (judges/ only).
JUDGE_KIND_PROTOCOL = {"feature_rows", "weights_digest", "check_weights", "load_weights"}


def public_definitions(root: Path) -> dict[str, list[str]]:
    """Public top-level function and class names -> the modules (paths relative to ``root``) defining them."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(path.relative_to(root).as_posix())
    return where


def duplicated(root: Path) -> dict[str, list[str]]:
    """Names defined in more than one module, less the listed exceptions (command protocol names count only
    inside cli/)."""
    out = {}
    for name, mods in public_definitions(root).items():
        if name in PER_PACKAGE:
            continue
        if name in COMMAND_PROTOCOL:
            mods = [m for m in mods if not m.startswith("cli/")]
        if name in JUDGE_KIND_PROTOCOL:
            mods = [m for m in mods if not m.startswith("judges/")]
        if len(mods) > 1:
            out[name] = mods
    return out


def foreign_exports(path: Path) -> list[str]:
    """Names in ``path``'s ``__all__`` that it does not define (it imports them from elsewhere)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined: set[str] = set()
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    defined.add(t.id)
                    if t.id == "__all__" and isinstance(node.value, ast.List | ast.Tuple):
                        exported = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return sorted(n for n in exported if n not in defined)


def test_every_public_name_is_defined_once():
    assert duplicated(PKG) == {}


def test_lm_models_exports_only_what_it_defines():
    assert foreign_exports(PKG / "lm" / "models.py") == []


def test_the_checkers_see_a_broken_tree(tmp_path):
    (tmp_path / "a.py").write_text("def tvd(p, q):\n    return 0\n\ndef write_report():\n    pass\n")
    (tmp_path / "b.py").write_text("def tvd(p, q, classes):\n    return 1\n\ndef write_report():\n    pass\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "x.py").write_text("def run(args):\n    return 0\n")
    (tmp_path / "cli" / "y.py").write_text("def run(args):\n    return 0\n")
    assert duplicated(tmp_path) == {"tvd": ["a.py", "b.py"]}
    (tmp_path / "m.py").write_text("from x import helper\n\n__all__ = ['Own', 'helper']\n\nclass Own:\n    pass\n")
    assert foreign_exports(tmp_path / "m.py") == ["helper"]
