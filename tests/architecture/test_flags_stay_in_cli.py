"""Command-line flags are named only in :mod:`mechprobe.cli`; below it, a message names the config field.

Why: a Python caller of ``steer_experiment(SteerConfig(...))`` or ``judge_run(...)`` never typed ``--steer-dir``;
an error that tells them to pass it sends them to a command line they are not using. So every message below
cli/ (an exception raised, a ``print``, a log or warning call) names the setting as ``field=VALUE``, and
:func:`mechprobe.cli.common.friendly` shows a command-line user the flag (``--steer-dir NEW_DIR``), from the
command's own parser. Docstrings and comments may name flags; messages may not.

Report text is held to the same rule: a markdown report, a summary line or a note written below cli/ (any string
that is not a docstring) names the setting by its field (``include_truncated=True``), never ``--include-truncated``;
the few strings that hold another program's flags (pip's) or a recorded provenance text are listed in
:data:`NOT_OURS` with the reason.

The checker runs on a small file that breaks the rule once, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mechprobe.cli import common
from mechprobe.cli.main import build_parser
from mechprobe.linear.fit import thin_data_hint
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


# (path below mechprobe/, flag): strings that are not mechprobe's own flags, or must not change.
NOT_OURS = {
    ("lm/llamacpp.py", "--force-reinstall"), ("lm/llamacpp.py", "--no-deps"), ("lm/llamacpp.py", "--no-cache-dir"),
    ("lm/registry.py", "--no-deps"), ("lm/registry.py", "--force-reinstall"),  # pip's flags in install commands
    ("plots/study.py", "--x"),  # a matplotlib line format (dashed, x markers)
    ("splits.py", "--limit"),  # the recorded rule of the committed split file: regenerating must give the same file
}


def flags_in_strings(path: Path) -> list[str]:
    """``line: --flag`` for every flag named in a string of ``path`` that is not a docstring (module, class,
    function or attribute docstring: a bare string statement)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [f"{c.lineno}: {m.group(0)}" for c in ast.walk(tree)
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and id(c) not in docs
            for m in FLAG.finditer(c.value)]


def test_no_report_text_below_the_cli_names_a_flag():
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG)
        if rel.parts[0] == "cli":
            continue
        bad += [f"{rel.as_posix()}:{hit}" for hit in flags_in_strings(p)
                if (rel.as_posix(), hit.split(": ", 1)[1]) not in NOT_OURS]
    assert not bad, ("strings below mechprobe/cli/ that name a flag (name the field as field=VALUE):\n"
                     + "\n".join(bad))


def test_the_report_text_checker_skips_docstrings_only(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Docstrings may say --layer."""\n'
                   'X = 1\n'
                   '"""An attribute docstring may say --alpha."""\n'
                   'def f(n):\n'
                   '    """So may --this."""\n'
                   '    return ["## Report", f"rerun with --limit {n}"]\n', encoding="utf-8")
    assert flags_in_strings(bad) == ["6: --limit"]


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


def test_the_probes_command_shows_its_flags_in_the_thin_data_hint():
    """The hint names fields (limit=, samples=, folds=); a `mechprobe probes` user reads the same flags as before."""
    flags = common.flag_names(common.command_of(build_parser(), "probes"))
    hint = thin_data_hint(12, 5, 3)
    assert "--" not in hint
    assert common.as_flags(hint, flags) == ("Add items to the run (--limit 24) or probe more samples per item (a new "
                                            "run with --samples, --temperatures 0 1.0), or use fewer folds "
                                            "(--folds 3).")
