"""mechprobe: mechanistic analysis of interaction awareness in chat language models.

Stages (each reads and writes files in a run directory, so any entry point can resume):
probe (generate assistant + user turns) -> judge (label user turns) -> cache (boundary activations)
-> probes (linear probes per layer) -> steering (vectors that raise genuine follow-ups).

Names are imported lazily so ``import mechprobe`` stays cheap and optional backends (nnsight,
TransformerLens) are only imported when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # models and prompts
    "load_model": "models", "LoadedModel": "models", "get_blocks": "models", "tiny_model": "models",
    "build_probe_prompt": "chat", "user_header": "chat", "ProbePrompt": "chat",
    "generate": "generation",
    # records and runs
    "Item": "records", "AssistantRecord": "records", "UserTurnRecord": "records", "LabelRecord": "records",
    "ProbeConfig": "pipeline", "run_probe": "pipeline", "load_run": "pipeline",
    "load_dataset": "datasets",
    # judging
    "LABELS": "taxonomy", "GENUINE": "taxonomy", "judge_run": "judge", "OfflineJudge": "judge_offline",
    "LLMJudge": "judge_llm",
    # activations, probes, steering
    "ActivationCache": "activations", "cache_run": "activations",
    "SteeringVector": "steering", "steer": "steering",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'mechprobe' has no attribute {name!r}")
