"""Command-line flags are named only in :mod:`mechprobe.cli`; below it, a message names the config field.

Why: a Python caller of ``steer_experiment(SteerConfig(...))`` or ``judge_run(...)`` never typed ``--steer-dir``;
an error that tells them to pass it sends them to a command line they are not using. So every message below
cli/ (an exception raised, a ``print``, a log or warning call) names the setting as ``field=VALUE``, and
:func:`mechprobe.cli.common.friendly` shows a command-line user the flag (``--steer-dir NEW_DIR``), from the
command's own parser. Docstrings and comments may name flags; messages may not.

The checker runs on a small file that breaks the rule once, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mechprobe.cli import common
from mechprobe.cli.main import build_parser
from tests.architecture.test_layers import PKG

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
MESSAGE_CALLS = {"print", "UserError", "UsageError", "MissingInput"}
LOG_CALLS = {"warn", "warning", "info", "error", "debug", "exception"}


def flags_in_messages(path: Path) -> list[str]:
    """``line: --flag`` for every flag named in a string of a raise, print, log/warn call or error constructor."""
    found = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Raise) and n.exc is not None:
            target: ast.AST | None = n.exc
        elif isinstance(n, ast.Call) and ((isinstance(n.func, ast.Name) and n.func.id in MESSAGE_CALLS)
                                          or (isinstance(n.func, ast.Attribute) and n.func.attr in LOG_CALLS)):
            target = n
        else:
            continue
        for c in ast.walk(target):
            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                found += [f"{c.lineno}: {m.group(0)}" for m in FLAG.finditer(c.value)]
    return found


def test_no_message_below_the_cli_names_a_flag():
    bad = [f"{p.relative_to(PKG.parent)}:{hit}" for p in sorted(PKG.rglob("*.py"))
           if p.relative_to(PKG).parts[0] != "cli" for hit in flags_in_messages(p)]
    assert not bad, ("messages below mechprobe/cli/ that name a flag (name the config field as field=VALUE; the "
                     "CLI shows the flag):\n" + "\n".join(bad))


def test_the_checker_catches_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Docstrings may say --layer."""\n'
                   'def f(x):\n'
                   '    # comments too: --layer\n'
                   '    if x:\n'
                   '        raise ValueError(f"pass --steer-dir {x}")\n'
                   '    print("see --alpha")\n'
                   '    log.warning("use %s", "--judge")\n'
                   '    return "--not-a-message"\n', encoding="utf-8")
    assert flags_in_messages(bad) == ["5: --steer-dir", "6: --alpha", "7: --judge"]


def test_the_command_line_shows_its_flag_for_a_field_named_below_it():
    flags = common.flag_names(common.command_of(build_parser(), "steer"))
    msg = "frozen: pass steer_dir=NEW_DIR; drop positions=all or new=True, or select_on_train=False; judge=offline"
    assert common.as_flags(msg, flags) == ("frozen: pass --steer-dir NEW_DIR; drop --steer-positions all or --new, "
                                           "or --no-select-on-train; --judge offline")
    assert common.as_flags("k=3 and unit='raw'", flags) == "k=3 and unit='raw'"  # not a field of this command
