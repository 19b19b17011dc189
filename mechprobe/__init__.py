"""mechprobe: mechanistic analysis of interaction awareness in chat language models.

Stages (each reads and writes files in a run directory, so any entry point can resume):
probe (generate assistant + user turns) -> judge (label user turns) -> cache (boundary activations)
-> linear probes per layer -> steering (vectors that raise genuine follow-ups).

The layers, lowest first (docs/architecture.md): foundation modules (errors, io, records, taxonomy, stats,
redact, plots) -> ``lm`` (load and run a chat model) -> ``turns`` (the user-turn probe) -> ``judges`` ->
``activations`` -> ``stages`` -> ``linear`` -> ``steering`` -> ``post_train`` -> ``study`` -> ``cli``.

Example:
    >>> from mechprobe import ActivationCache, SteeringVector, diff_of_means, steer
    >>> cache = ActivationCache.load("runs/smol-gsm8k/activations")      # doctest: +SKIP
    >>> X, y, groups, ids = cache.dataset(layer=12)                       # doctest: +SKIP
"""

from __future__ import annotations

from mechprobe.activations.cache import ActivationCache, cache_run
from mechprobe.judges.base import Judge, JudgeInput
from mechprobe.judges.factory import make_judge
from mechprobe.judges.hybrid import HybridJudge
from mechprobe.judges.llm import LLMJudge
from mechprobe.judges.local import LocalJudge
from mechprobe.judges.offline import OfflineJudge
from mechprobe.judges.run import judge_run
from mechprobe.judges.trained import TrainedJudge
from mechprobe.lm.chat import ProbePrompt, build_probe_prompt, user_header
from mechprobe.lm.generation import generate
from mechprobe.lm.models import LoadedModel, get_blocks, load_model, tiny_model
from mechprobe.records import AssistantRecord, Item, LabelRecord, UserTurnRecord
from mechprobe.steering.vector import SteeringVector, bake, diff_of_means, from_direction, steer
from mechprobe.taxonomy import GENUINE, LABELS
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ProbeConfig, load_run, run_probe

__version__ = "0.1.0"

__all__ = [
    "GENUINE", "LABELS", "ActivationCache", "AssistantRecord", "HybridJudge", "Item", "Judge", "JudgeInput",
    "LLMJudge", "LabelRecord", "LoadedModel", "LocalJudge", "OfflineJudge", "ProbeConfig", "ProbePrompt",
    "SteeringVector", "TrainedJudge", "UserTurnRecord", "bake", "build_probe_prompt", "cache_run", "diff_of_means",
    "from_direction", "generate", "get_blocks", "judge_run", "load_dataset", "load_model", "load_run",
    "make_judge", "run_probe", "steer", "tiny_model", "user_header",
]
