"""mechprobe.turns."""

from __future__ import annotations

from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ProbeConfig, load_run, run_probe

__all__ = ["ProbeConfig", "load_dataset", "load_run", "run_probe"]
