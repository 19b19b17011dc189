"""``textfit``: a logistic head per reading over the rules, lexical cues and MiniLM similarities
(:class:`~mechprobe.judges.textfit.TextFitJudge`); no scoring language model."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.registry import JudgeSpec, register_judge
from mechprobe.judges.textfit import TextFitJudge


def _spec_of_name(name: str) -> str | None:
    """``textfit-strict@textfit-v1+offline-v3+minilm`` -> ``textfit``."""
    return "textfit" if name.startswith("textfit-") else None


@register_judge("textfit", model="none", options=("reading", "weights", "batch_size"),
                help="fitted heads over rules + MiniLM (no LM; fast)", spec_of_name=_spec_of_name, order=20)
def textfit(spec: JudgeSpec, **opts: Any) -> TextFitJudge:
    """The text-fit judge (its strict head unless reading='lenient')."""
    return TextFitJudge(**opts)
