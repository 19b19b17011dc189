"""``openai:MODEL``: an LLM judge on an OpenAI-compatible endpoint (:class:`~mechprobe.judges.llm.LLMJudge`)."""

from __future__ import annotations

from typing import Any

from mechprobe.judges.llm import LLMJudge
from mechprobe.judges.registry import JudgeSpec, register_judge


@register_judge("openai", options=("base_url", "api_key", "concurrency", "timeout", "max_retries", "cache_dir",
                                   "backoff", "max_backoff", "structured", "max_tokens"),
                help="LLM judge on an OpenAI-compatible endpoint", example="gpt-4o-mini", order=50)
def openai(spec: JudgeSpec, **opts: Any) -> LLMJudge:
    """The LLM judge (needs OPENAI_API_KEY or a base_url)."""
    return LLMJudge(spec.model, **opts)
