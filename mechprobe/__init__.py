"""mechprobe: mechanistic analysis of interaction awareness in chat language models.

Stages (each reads and writes files in a run directory, so any entry point can resume):
probe (generate assistant + user turns) -> judge (label user turns) -> cache (boundary activations)
-> linear probes per layer -> steering (vectors that raise genuine follow-ups).

The layers, lowest first (docs/architecture.md): foundation modules (errors, io, records, taxonomy, stats,
redact, plots) -> ``lm`` (load and run a chat model) -> ``turns`` (the user-turn probe) -> ``judges`` ->
``activations`` -> ``stages`` -> ``linear`` -> ``steering`` -> ``post_train`` -> ``study`` -> ``cli``.

The research loop in a few lines (README "Python API"): a cache, a linear probe, a steering vector,
steered generation. ``alpha`` is in residual-norm units (docs/steering.md): 0.2 adds a vector of 0.2 x the
layer's mean residual norm.

Example:
    >>> from mechprobe import ActivationCache, SteeringVector, fit_probe, generate, load_model
    >>> cache = ActivationCache.load("runs/smol-gsm8k")                    # doctest: +SKIP
    >>> probe = fit_probe(cache, layer=12)           # labels: the run's judge  # doctest: +SKIP
    >>> vec = SteeringVector.from_probe(probe)                             # doctest: +SKIP
    >>> lm = load_model(cache.model_name)                                  # doctest: +SKIP
    >>> with vec.apply(lm, alpha=0.2):                                     # doctest: +SKIP
    ...     turns = generate(lm, prompts, max_new_tokens=48)               # doctest: +SKIP
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
from mechprobe.linear.linear_probe import LinearProbe, fit_probe
from mechprobe.lm.chat import ProbePrompt, build_probe_prompt, stop_token_ids, user_header
from mechprobe.lm.forward import get_blocks, tiny_model
from mechprobe.lm.generation import Generation, generate
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.records import AssistantRecord, Item, LabelRecord, UserTurnRecord
from mechprobe.steering.vector import (
    SteeringVector,
    bake,
    diff_of_means,
    from_direction,
    in_alpha_units,
    steer,
)
from mechprobe.taxonomy import GENUINE, LABELS
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ProbeConfig, load_run, run_probe

__version__ = "0.1.0"

__all__ = [
    "GENUINE", "LABELS", "ActivationCache", "AssistantRecord", "Generation", "HybridJudge", "Item", "Judge",
    "JudgeInput", "LLMJudge", "LabelRecord", "LinearProbe", "LoadedModel", "LocalJudge", "OfflineJudge",
    "ProbeConfig", "ProbePrompt", "SteeringVector", "TrainedJudge", "UserTurnRecord", "bake", "build_probe_prompt",
    "cache_run", "diff_of_means", "fit_probe", "from_direction", "generate", "get_blocks", "in_alpha_units",
    "judge_run", "load_dataset", "load_model", "load_run", "make_judge", "run_probe", "steer", "stop_token_ids",
    "tiny_model", "user_header",
]
