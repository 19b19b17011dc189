"""A command the package suggests can be pasted into a shell as it stands, also for paths with spaces.

Why: "run `mechprobe cache my runs/o1`" split the path into two arguments when pasted.
"""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from mechprobe import ActivationCache
from mechprobe.audit import load_sample
from mechprobe.cli.audit import add_args, run
from mechprobe.errors import UserError
from mechprobe.judges.base import inputs_from_run

from .run_fixture import build_run


def _commands(text: str) -> list[list[str]]:
    """Every ``mechprobe ...`` command quoted in backticks, or after "import and report:", split as a shell would."""
    found = re.findall(r"`(mechprobe [^`]*)`", text) + re.findall(r"import and report: (mechprobe .*?) \.\.\.", text)
    assert found, text
    return [shlex.split(c) for c in found]


def test_missing_cache_judge_and_sample_messages_quote_the_run(tmp_path):
    run_dir = tmp_path / "my runs" / "o 1"
    run_dir.mkdir(parents=True)
    for call in (lambda: ActivationCache.load(run_dir), lambda: inputs_from_run(run_dir),
                 lambda: load_sample(run_dir)):
        with pytest.raises(UserError) as ei:
            call()
        for argv in _commands(str(ei.value)):
            assert str(run_dir) in argv, (argv, str(ei.value))


def test_audit_next_steps_quote_the_run(tmp_path, capsys):
    run_dir = tmp_path / "my runs" / "o 1"
    build_run(run_dir, n_steer_items=4, n_probe_items=2)
    p = argparse.ArgumentParser()
    add_args(p)
    assert run(p.parse_args([str(run_dir), "--n", "6"])) == 0
    out = capsys.readouterr().out
    (argv,) = _commands(out)
    assert argv[:3] == ["mechprobe", "audit", str(run_dir)]
