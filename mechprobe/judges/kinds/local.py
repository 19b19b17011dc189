"""``local:MODEL``: a local language model asked for the label (:class:`~mechprobe.judges.local.LocalJudge`)."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.local import LocalJudge
from mechprobe.judges.registry import JudgeSpec, register_judge


@register_judge("local", options=("dtype", "device", "few_shot", "bias", "cache_dir", "loaded"), loads_model=True,
                help="a local model's constrained choice", example="qwen2.5-coder-1.5b-instruct", order=40)
def local(spec: JudgeSpec, **opts: Any) -> LocalJudge:
    """The local-model judge."""
    return LocalJudge(spec.model, **opts)
