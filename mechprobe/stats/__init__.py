"""Small statistics shared by every report (one definition, so two tables never disagree)."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

from . import clustered  # noqa: F401  item-clustered intervals: mechprobe.stats.clustered


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n (sane at k=0, k=n and small n, unlike Wald).

    With ``n == 0`` there is no evidence at all, so the interval is the whole range ``(0.0, 1.0)``:
    a finite value keeps JSON files valid (no bare NaN) and reads correctly in a table.
    """
    if k < 0 or n < 0 or k > n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    alpha = 2 * (1 - NormalDist().cdf(z))  # statsmodels takes the level; callers keep passing z
    lo, hi = proportion_confint(k, n, alpha=alpha, method="wilson")
    return (max(0.0, float(lo)), min(1.0, float(hi)))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the two discordant counts of a paired 2x2 table.

    ``b`` = pairs positive only under condition A, ``c`` = positive only under B. Under H0 each discordant
    pair is a fair coin, so p = P(Binomial(b+c, 1/2) as or more extreme than min(b, c)), doubled and capped
    at 1. Exact rather than the chi-square approximation: the study's per-model tables have a handful of
    discordant items, where the approximation is badly off. No discordant pairs: p = 1 (no evidence).
    """
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact needs counts >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return float(min(1.0, mcnemar([[0, b], [c, 0]], exact=True).pvalue))


def paired_bootstrap(a_k: list[int], a_n: list[int], b_k: list[int], b_n: list[int], n_boot: int = 2000,
                     seed: int = 0) -> tuple[float, float, float, float]:
    """Difference of pooled rates ``sum(b_k)/sum(b_n) - sum(a_k)/sum(a_n)`` with a 95% percentile CI and a
    two-sided bootstrap p-value, resampling *items* (index i of every list is one item under A and B).

    Why items: the k samples of one item share its prompt and answer, so they are not independent; an item
    and its perturbed variant are a pair. Resampling items keeps both. Deterministic for a given ``seed``.
    Returns (diff, ci_low, ci_high, p); NaNs when there is no item with turns under both conditions.
    """
    import random

    m = len(a_k)
    if not (len(a_n) == len(b_k) == len(b_n) == m):
        raise ValueError("paired_bootstrap: the four lists must have one entry per item")
    idx = [i for i in range(m) if a_n[i] > 0 and b_n[i] > 0]
    nan = float("nan")
    if not idx:
        return nan, nan, nan, nan

    def diff(sel: list[int]) -> float:
        return sum(b_k[i] for i in sel) / sum(b_n[i] for i in sel) - sum(a_k[i] for i in sel) / sum(a_n[i] for i in sel)

    d = diff(idx)
    rng = random.Random(seed)
    boots = sorted(diff([idx[rng.randrange(len(idx))] for _ in idx]) for _ in range(n_boot))
    lo = boots[int(0.025 * (n_boot - 1))]
    hi = boots[int(round(0.975 * (n_boot - 1)))]
    le = sum(x <= 0 for x in boots) / n_boot
    ge = sum(x >= 0 for x in boots) / n_boot
    p = min(1.0, 2.0 * min(le, ge))
    return d, lo, hi, p


def bootstrap_diff(a: list[tuple[int, int]], b: list[tuple[int, int]], n_boot: int = 2000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Pooled rate of group ``b`` minus group ``a`` (each a list of per-item ``(k, n)``), 95% percentile CI,
    resampling items within each group independently (two unpaired groups of items, e.g. items the model
    answered correctly vs wrongly). NaNs when a group has no turns. Deterministic for a given ``seed``."""
    import random

    a = [x for x in a if x[1] > 0]
    b = [x for x in b if x[1] > 0]
    nan = float("nan")
    if not a or not b:
        return nan, nan, nan

    def rate(xs: list[tuple[int, int]]) -> float:
        return sum(k for k, _ in xs) / sum(n for _, n in xs)

    rng = random.Random(seed)
    boots = sorted(rate([b[rng.randrange(len(b))] for _ in b]) - rate([a[rng.randrange(len(a))] for _ in a])
                   for _ in range(n_boot))
    return rate(b) - rate(a), boots[int(0.025 * (n_boot - 1))], boots[int(round(0.975 * (n_boot - 1)))]


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
