"""``hybrid:MODEL`` (choice scores plus the offline rules) and ``hybrid-voice:MODEL`` (the same with the voice
check; ``hybrid2:MODEL`` is an accepted alias). Recorded names (``hybrid:M@hybrid-v2+voice...``) are the judge's
own and unchanged by the spec's spelling."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.hybrid import DEFAULT_VOICE, HybridJudge
from mechprobe.judges.registry import JudgeSpec, register_judge

OPTIONS = ("dtype", "device", "threshold", "veto", "cache_dir", "loaded", "embed", "voice")
HYBRID_VOICE = "hybrid-voice"


def _spec_of_name(name: str) -> str | None:
    """``hybrid:M@hybrid-v2+voice0.1+...`` -> ``hybrid-voice:M``; without ``+voice`` -> ``hybrid:M``."""
    if name.startswith("hybrid:") and "@" in name:
        judge_model = name.split(":", 1)[1].split("@", 1)[0]
        return f"{HYBRID_VOICE if '+voice' in name else 'hybrid'}:{judge_model}"
    return None


@register_judge("hybrid", options=OPTIONS, loads_model=True, help="choice scores + the offline rules",
                example="qwen2.5-coder-1.5b-instruct", spec_of_name=_spec_of_name, order=20)
def hybrid(spec: JudgeSpec, **opts: Any) -> HybridJudge:
    """The hybrid judge without the voice check."""
    return HybridJudge(spec.model, **opts)


@register_judge(HYBRID_VOICE, options=OPTIONS, loads_model=True, help="the hybrid judge + the voice check",
                example="qwen2.5-coder-1.5b-instruct", aliases=("hybrid2",), order=21)
def hybrid_voice(spec: JudgeSpec, **opts: Any) -> HybridJudge:
    """The hybrid judge with the voice check at the margin chosen on the dev splits."""
    opts.setdefault("voice", DEFAULT_VOICE)
    return HybridJudge(spec.model, **opts)
