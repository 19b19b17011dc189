"""Per-turn features for a trained judge: the offline rules' verdict, lexical cues, and the scoring model's
grounding PMI and voice margin.

Why these: the hybrid judge combines the same signals with two hand-set thresholds and a fixed decision order,
and its errors (docs/judge_agreement.md) are where one signal alone decides: a turn that reuses the answer's
tokens without reacting to them (high PMI), a short reaction with few shared tokens (low PMI). A classifier fit
on labelled turns weighs them jointly. Lexical cues are cheap and name what the codebook's boundaries turn on
(a question, a challenge, an acknowledgement, an assistant-voice opener, code or LaTeX, overlap with the
answer's own items vs the query's).

The model features need :class:`~mechprobe.judges.hybrid.HybridJudge`'s store (its KV prefix pool and cache),
so they cost what the hybrid judge's candidates cost, for every non-empty turn.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from mechprobe.judges.base import JudgeInput
from mechprobe.judges.offline import Features, features, lexical_cosine
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import LABELS

__all__ = ["TEXT_FEATURES", "MODEL_FEATURES", "FEATURE_NAMES", "text_features"]

_ACK = re.compile(r"^\s*(thanks?|thank you|i see|ok(ay)?|great|got it|that makes sense|perfect|cool|nice|wow|"
                  r"interesting|so|hmm|oh|ah|yes|no)\b", re.I)
_CHALLENGE = re.compile(r"\b(why|how come|are you sure|but|wrong|mistake|isn'?t|shouldn'?t|doesn'?t|didn'?t|"
                        r"instead|actually|correct|incorrect)\b", re.I)
_ASSISTANT = re.compile(r"\b(let'?s|let us|we need|we can|to solve|step \d|here is|here'?s|solution|"
                        r"therefore|the answer is|i will|i'll)\b", re.I)
_SECOND = re.compile(r"\b(you|your|you'?re)\b", re.I)
_CODE = re.compile(r"```|\\\(|\\\[|\$\$|\\frac|\bdef \w+\(|print\(")

TEXT_FEATURES: tuple[str, ...] = tuple(f"offline_{lab}" for lab in LABELS) + (
    "question", "log_words", "ack_opening", "challenge_word", "assistant_phrase", "second_person", "code_or_latex",
    "trailing_header", "opens_non_user", "resp_only_items", "resp_only_share", "novel_items", "sim_prompt",
    "sim_response")
MODEL_FEATURES: tuple[str, ...] = ("pmi", "voice", "no_text")
FEATURE_NAMES: tuple[str, ...] = TEXT_FEATURES + MODEL_FEATURES


def text_features(inp: JudgeInput, offline: LabelRecord, f: Features | None = None) -> dict[str, float]:
    """The text-only features of one turn (no model needed).

    Args:
        inp: the turn and its conversation.
        offline: the offline judge's verdict on it (one-hot label).
        f: the offline judge's :class:`Features` of ``inp`` when already computed.
    Returns:
        ``{name: value}`` over :data:`TEXT_FEATURES`.
    Example:
        >>> from mechprobe.judges.offline import OfflineJudge
        >>> inp = JudgeInput("r", "What is 12 * 7?", "12 * 7 = 84.", "Why is it 84 and not 74?<|im_end|>")
        >>> text_features(inp, OfflineJudge(embed=False).label(inp))["challenge_word"]
        1.0
    """
    f = f or features(inp)
    t = f.user_text
    sal = f.sal_text.all()
    out = {f"offline_{lab}": float(offline.label == lab) for lab in LABELS}
    out |= {
        "question": float("?" in t),
        "log_words": math.log1p(len(f.words)),
        "ack_opening": float(bool(_ACK.search(t))),
        "challenge_word": float(bool(_CHALLENGE.search(t))),
        "assistant_phrase": float(bool(_ASSISTANT.search(t))),
        "second_person": float(bool(_SECOND.search(t))),
        "code_or_latex": float(bool(_CODE.search(t))),
        "trailing_header": float(bool(f.trailing_headers)),
        "opens_non_user": float(f.first_role != "user"),
        "resp_only_items": math.log1p(len(f.resp_only)),
        "resp_only_share": len(f.resp_only) / (len(sal) + 1),
        "novel_items": math.log1p(len(f.novel)),
        "sim_prompt": lexical_cosine(f.content, f.prompt_content),
        "sim_response": lexical_cosine(f.content, f.response_content),
    }
    return out


def model_feature_row(pmi: float | None, voice: float | None) -> dict[str, float]:
    """The model features of one turn; a turn with no text gets zeros and ``no_text`` = 1."""
    if pmi is None or voice is None:
        return {"pmi": 0.0, "voice": 0.0, "no_text": 1.0}
    return {"pmi": float(pmi), "voice": float(voice), "no_text": 0.0}


def vector(row: dict[str, float], names: Sequence[str] = FEATURE_NAMES) -> list[float]:
    """Feature dict -> list in ``names`` order (a missing name is an error: weights and features must match)."""
    return [float(row[n]) for n in names]
