"""Flags, error handling and run-directory arguments shared by every command (each defined once)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from mechprobe.errors import UsageError, UserError


def friendly(fn: Callable[[], int | None]) -> int:
    """Run ``fn``; a :class:`UserError` becomes one line on stderr and exit code 2, anything else propagates."""
    try:
        return int(fn() or 0)
    except UserError as e:
        print(f"mechprobe: error: {e}", file=sys.stderr)
        return 2


def run_positional(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_pos", nargs="?", default=None, metavar="RUN", help="run directory (same as --run)")


def merge_run(a: argparse.Namespace, dest: str = "run") -> None:
    """Positional RUN and ``--run`` name the same thing: accept either, refuse two different ones."""
    pos = getattr(a, "run_pos", None)
    if pos is None:
        return
    given = getattr(a, dest, None)
    if given is not None and Path(given) != Path(pos):
        raise UsageError(f"two run directories given ({pos} and --{dest} {given}): pass one")
    setattr(a, dest, pos)
