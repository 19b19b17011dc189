"""What a hidden-state judge's feature rows are: the kinds a weights file may name, and the answer-hidden reading
that the ``answer-contrast`` kind (``hidden-v7`` on) subtracts. Kept apart from :mod:`mechprobe.judges.hidden` so the
kinds are one small concept that the fit, the verdicts and the judge all read."""

from __future__ import annotations

import dataclasses
from typing import Any

from mechprobe.judges.base import JudgeInput

__all__ = ["HIDDEN_ANSWER", "FEATURE_KINDS", "answer_hidden", "feature_kind"]

HIDDEN_ANSWER = "(the answer is not shown)"  # the answer-hidden prompt's answer (answer-contrast features)
FEATURE_KINDS = ("turn", "answer-contrast")  # what a weights file's rows are (its "features"; absent = "turn")


def answer_hidden(inp: JudgeInput) -> JudgeInput:
    """``inp`` with its answer replaced by :data:`HIDDEN_ANSWER`: the reader prompt a turn gets when no answer is shown.

    Example:
        >>> answer_hidden(JudgeInput("r", "q", "the answer", "Why?")).response
        '(the answer is not shown)'
    """
    return dataclasses.replace(inp, response=HIDDEN_ANSWER)


def feature_kind(w: dict[str, Any]) -> str:
    """What the rows of weights ``w`` are: ``"turn"`` (hidden-v1..v6, no ``features`` key) or ``"answer-contrast"``."""
    return str(w.get("features", "turn"))
