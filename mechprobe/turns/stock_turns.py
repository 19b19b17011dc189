"""Stock user turns that a steering vector tends to produce, detected by form.

Why this exists: read blind, many turns a difference-of-means vector makes "genuine" share one shape, an
acknowledgement followed by a plan that only restates the task ("I see, I can now calculate the total cost.")
or a request for the final answer ("Please give the final answer."). The codebook
(``mechprobe/audit/labeling_guide.md``, section 3) files the first kind under ``genuine_followup`` only when
the plan builds on something the answer said, and asks labellers to tick *borderline*; a stricter reading
counts none of them. A steering result that rises mostly through such turns is a template, not a reaction,
so the steering report gives the share of turns in this form beside every rate, and the rate under both
readings. The patterns are deliberately narrow (an opener *and* a plan, no question mark): a turn that asks
something about the answer is not a template however it opens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["TEMPLATE_KINDS", "template_kind", "template_share"]

_SPECIAL = re.compile(r"<\|[^|>]*\|>|<end_of_turn>|</s>")
_ACK = re.compile(r"^\s*(?:i see|i understand|i got it|got it|ok(?:ay)?|great|thanks?(?: you)?|alright|understood)\b",
                  re.IGNORECASE)
_PLAN = re.compile(r"\b(?:i can now|now i can|i(?:'ll| will) (?:now )?(?:calculate|compute|find|add|use|do)|"
                   r"let me (?:calculate|compute|find|do)|let's (?:calculate|compute|do)|i can (?:calculate|compute|"
                   r"find|use))\b", re.IGNORECASE)
_FINAL = re.compile(r"\b(?:give|provide|tell|show)(?: me)? (?:the|your) final answer\b", re.IGNORECASE)

TEMPLATE_KINDS: tuple[str, ...] = ("ack_plan", "final_answer_request")


def template_kind(text: str) -> str | None:
    """The stock form a user turn takes, if any.

    Args:
        text: the user turn (raw text; special tokens are ignored).
    Returns:
        ``"ack_plan"`` (an acknowledgement opener followed by a plan, with no question),
        ``"final_answer_request"`` (asks for the final answer), or None.
    Example:
        >>> template_kind("I see, I can now calculate the total cost for the year.<|im_end|>")
        'ack_plan'
        >>> template_kind("Please give the final answer.")
        'final_answer_request'
        >>> template_kind("I see. Why did you divide by 4 in the second step?") is None
        True
    """
    t = _SPECIAL.sub(" ", text).strip()
    if _FINAL.search(t):
        return "final_answer_request"
    if "?" in t or not _ACK.match(t):
        return None
    head = " ".join(re.split(r"(?<=[.!])\s+", t)[:3])  # the plan comes right after the opener
    return "ack_plan" if _PLAN.search(head) else None


def template_share(texts: Iterable[str]) -> tuple[int, int]:
    """How many of ``texts`` take a stock form (:func:`template_kind`), out of how many.

    Args:
        texts: user turns.
    Returns:
        ``(k, n)``.
    Example:
        >>> template_share(["I see. I can now calculate it.", "What if it rains?"])
        (1, 2)
    """
    n = k = 0
    for t in texts:
        n += 1
        k += template_kind(t) is not None
    return k, n
