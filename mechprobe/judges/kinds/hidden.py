"""``hidden:MODEL``: a logistic head per reading over the reader MODEL's residual stream after it read the
conversation and the turn (:class:`~mechprobe.judges.hidden.HiddenStateJudge`)."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.hidden import HiddenStateJudge
from mechprobe.judges.registry import JudgeSpec, register_judge


def _spec_of_name(name: str) -> str | None:
    """``hidden:M@hidden-v1-strict+offline-v3+lexical`` -> ``hidden:M``."""
    if name.startswith("hidden:") and "@" in name:
        return "hidden:" + name.split(":", 1)[1].split("@", 1)[0]
    return None


@register_judge("hidden", options=("reading", "weights", "dtype", "device", "loaded", "batch_size"), loads_model=True,
                help="fitted heads on a reader model's hidden states", example="qwen2.5-coder-0.5b-instruct",
                spec_of_name=_spec_of_name, order=25)
def hidden(spec: JudgeSpec, **opts: Any) -> HiddenStateJudge:
    """The hidden-state judge whose weights were fit with reader MODEL (its strict head unless reading='lenient')."""
    return HiddenStateJudge(str(spec.model), **opts)
