"""The offline rule judges: ``offline`` (embedding variant when installed), ``offline-lexical``, ``offline-embed``."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.offline import OfflineJudge
from mechprobe.judges.registry import JudgeSpec, register_judge

OPTIONS = ("embed", "batch_size")


def _spec_of_name(name: str) -> str | None:
    """``offline-v3+lexical`` -> ``offline-lexical``; ``offline-v3+minilm`` -> ``offline``."""
    if name.startswith("offline"):
        return "offline-lexical" if "lexical" in name else "offline"
    return None


@register_judge("offline", model="none", options=OPTIONS, help="rules (+ embeddings when installed)",
                spec_of_name=_spec_of_name, order=10)
def offline(spec: JudgeSpec, **opts: Any) -> OfflineJudge:
    """The rules, with the embedding variant when its model is installed."""
    return OfflineJudge(**opts)


@register_judge("offline-lexical", model="none", options=OPTIONS, help="rules, no embedding model", order=11)
def offline_lexical(spec: JudgeSpec, **opts: Any) -> OfflineJudge:
    """The rules without the embedding model."""
    return OfflineJudge(**{**opts, "embed": False})


@register_judge("offline-embed", model="none", options=OPTIONS, help="rules + embeddings (required)", order=12)
def offline_embed(spec: JudgeSpec, **opts: Any) -> OfflineJudge:
    """The rules with the embedding model (an error when it is not installed)."""
    return OfflineJudge(**{**opts, "embed": True})
