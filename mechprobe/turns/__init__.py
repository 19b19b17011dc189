"""The user-turn probe: the assistant answers, then the model writes the next *user* turn.

:mod:`.pipeline` (answers, then user turns after the model's own user-role header, resumable JSONL) ·
:mod:`.config` (``ProbeConfig``) · :mod:`.engines` (HF, vLLM, llama.cpp) · :mod:`.run_files` (a run's files,
``load_run``, ``summarize_run``) ·
:mod:`.datasets` (GSM8K, MT-Bench, IFEval, ... from ``shared/data`` or HF ``datasets``) · :mod:`.perturb`
(answer perturbations) · :mod:`.scoring` (task accuracy) · :mod:`.stock_turns` (fixed user turns for steering
checks).
"""

from __future__ import annotations

from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ProbeConfig, load_run, run_probe

__all__ = ["ProbeConfig", "load_dataset", "load_run", "run_probe"]
