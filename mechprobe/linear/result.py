"""What a ``probes`` run returns to the command line: its status, what to print, and the exit code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class LinearProbeResult:
    """The outcome of :func:`mechprobe.linear.experiment.run_linear_probe` (either target).

    ``summary`` is printed on stdout, ``message`` (why nothing is reported) on stderr. ``exit_code`` 3 means
    the run is too small to fit: the label counts, the reason and a figure saying why were written anyway.
    """

    status: str  # "ok", "insufficient_positives" (turn target) or "insufficient_items" (propensity target)
    out_dir: Path
    figure: Path | None = None
    summary: str = ""
    message: str = ""
    exit_code: int = 0
