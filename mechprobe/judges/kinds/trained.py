"""``trained:MODEL``: logistic weights over a scoring model's features (:class:`~mechprobe.judges.trained.TrainedJudge`)."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.registry import JudgeSpec, register_judge
from mechprobe.judges.trained import TrainedJudge


def _spec_of_name(name: str) -> str | None:
    """``trained:M@trained-v1+...`` -> ``trained:M``."""
    if name.startswith("trained:") and "@" in name:
        return "trained:" + name.split(":", 1)[1].split("@", 1)[0]
    return None


@register_judge("trained", options=("dtype", "device", "cache_dir", "loaded", "embed", "weights"), loads_model=True,
                help="fitted weights over a scoring model", example="qwen2.5-coder-0.5b-instruct",
                spec_of_name=_spec_of_name, order=30)
def trained(spec: JudgeSpec, **opts: Any) -> TrainedJudge:
    """The trained judge (its weights were fit with the scoring model MODEL)."""
    return TrainedJudge(spec.model, **opts)
