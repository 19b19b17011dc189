"""Small statistics shared by every report (one definition, so two tables never disagree)."""

from __future__ import annotations

import math


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n (sane at k=0, k=n and small n, unlike Wald).

    With ``n == 0`` there is no evidence at all, so the interval is the whole range ``(0.0, 1.0)``:
    a finite value keeps JSON files valid (no bare NaN) and reads correctly in a table.
    """
    if k < 0 or n < 0 or k > n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, centre - half), min(1.0, centre + half))
