"""Is a generated turn degenerate (empty or a repetition loop)? A steering alpha is chosen on this rate.

The rule text of the committed intervention plans names it as ``mechprobe.steering.evaluate.is_degenerate``;
that import path keeps working (``steering.evaluate`` imports it from here).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

__all__ = ["is_degenerate", "degenerate_rate", "largest_safe_alpha"]

_CHAR_LOOP = re.compile(r"(.{1,8}?)\1{7,}", re.DOTALL)  # a unit of <= 8 characters repeated >= 8 times


def is_degenerate(text: str) -> bool:
    """Empty, or a repetition loop: few distinct words, one 3-gram covering much of the turn, or a short run of
    characters repeated over at least half of the turn's non-space characters.

    Why the character check: a loop of one token with no spaces (``"2222…"``, ``"0.0000…"``) is a single *word*,
    so the word checks alone pass it as fluent; a steering alpha chosen on the degenerate rate then looks safe.
    """
    words = text.split()
    if not words:
        return True
    chars = "".join(words)
    loop = sum(len(m.group(0)) for m in _CHAR_LOOP.finditer(chars))
    if len(chars) >= 16 and loop * 2 >= len(chars):
        return True
    if len(words) >= 8 and len(set(words)) / len(words) < 0.35:
        return True
    grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
    return bool(grams) and len(words) >= 12 and grams.most_common(1)[0][1] * 3 / len(words) > 0.5


def degenerate_rate(turns: Iterable[str]) -> float:
    """The share of ``turns`` that are empty or degenerate (:func:`is_degenerate`); NaN for no turns."""
    flags = [is_degenerate(t) or not t.strip() for t in turns]
    return sum(flags) / len(flags) if flags else float("nan")


def largest_safe_alpha(alphas: Iterable[float], rate_at: Callable[[float], float], max_increase: float
                       ) -> tuple[float | None, float, dict[str, float]]:
    """The largest alpha whose degenerate rate is at most ``max_increase`` above the unsteered rate.

    Every alpha of the ladder is measured (the table goes into the selection file), in increasing order, after
    ``rate_at(0.0)``. Returns ``(alpha or None when none qualifies, the unsteered rate, {str(alpha): rate})``.

    Example:
        >>> largest_safe_alpha([1.0, 0.5, 2.0], {0.0: 0.0, 0.5: 0.05, 1.0: 0.5, 2.0: 0.05}.get, 0.1)
        (2.0, 0.0, {'0.5': 0.05, '1.0': 0.5, '2.0': 0.05})
    """
    base = rate_at(0.0)
    tried: dict[str, float] = {}
    chosen = None
    for a in sorted(float(x) for x in alphas):
        tried[str(a)] = rate_at(a)
        if tried[str(a)] <= base + max_increase:
            chosen = a
    return chosen, base, tried
