"""Binomial proportions: the Wilson interval and the ``Rate`` every report prints (one definition, so two
tables never disagree)."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from statsmodels.stats.proportion import proportion_confint

__all__ = ["Rate", "wilson"]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n (sane at k=0, k=n and small n, unlike Wald).

    With ``n == 0`` there is no evidence at all, so the interval is the whole range ``(0.0, 1.0)``:
    a finite value keeps JSON files valid (no bare NaN) and reads correctly in a table.

    At ``k == 0`` the lower bound is exactly 0 and at ``k == n`` the upper bound exactly 1 (the closed form's
    value there): statsmodels' floating point leaves ``1.4e-17`` for 0/13, an interval that excludes its own
    estimate 0/13 = 0 and turns into a negative error bar in a figure.
    """
    if k < 0 or n < 0 or k > n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    alpha = 2 * (1 - NormalDist().cdf(z))  # statsmodels takes the level; callers keep passing z
    lo, hi = proportion_confint(k, n, alpha=alpha, method="wilson")
    p = k / n
    return (0.0 if k == 0 else min(p, max(0.0, float(lo))), 1.0 if k == n else max(p, min(1.0, float(hi))))


@dataclass(frozen=True)
class Rate:
    """k of n, with its Wilson 95% CI: the one rate type the study and post-training reports share."""

    k: int
    n: int

    @property
    def p(self) -> float:
        return self.k / self.n if self.n else float("nan")

    value = p

    @property
    def ci(self) -> tuple[float, float]:
        return wilson(self.k, self.n)

    def fmt(self) -> str:
        """``0.125 [0.055, 0.261] (5/40)``: the post-training report's cell."""
        lo, hi = self.ci
        return f"{self.p:.3f} [{lo:.3f}, {hi:.3f}] ({self.k}/{self.n})" if self.n else "n/a (0 rows)"

    def cell(self, half: bool = False) -> str:
        """``12.5% [5.9%, 24.7%] (n=48)`` (+ ``±`` half-width): the study report's cell."""
        if not self.n:
            return "—"
        lo, hi = self.ci
        s = f"{self.p:.1%} [{lo:.1%}, {hi:.1%}] (n={self.n})"
        return s + f" ±{(hi - lo) / 2:.1%}" if half else s

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "n": self.n, "rate": self.p, "ci": list(self.ci)}
