"""Running an experiment never writes into the committed ``figures/`` unless asked (git stays clean)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mechprobe.cli.common import command_parser
from mechprobe.linear.turn import figures_dir


def _parser(name: str):
    mod = importlib.import_module(f"mechprobe.cli.{name}")
    return command_parser(mod.add_args, mod.__doc__)


def test_figures_default_to_the_run_directory(tmp_path):
    run = tmp_path / "runs" / "smol-gsm8k"
    assert figures_dir(None, run) == run / "figures"
    assert figures_dir("figures", run) == Path("figures")
    for name in ("linear_probe", "steer"):
        a = _parser(name).parse_args(["--run", str(run)])
        assert a.figures is None, name  # -> <run>/figures, ignored by git with runs/
        assert figures_dir(a.figures, run) == run / "figures"
