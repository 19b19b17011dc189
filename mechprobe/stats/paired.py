"""The paired-test family: two conditions observed on the same items, compared item by item.

Every paired comparison in the package (a steering condition vs alpha 0, a post-trained arm vs the base
model, a perturbation vs the full conversation, sampled vs greedy turns) goes through the functions here, so
one pairing rule and one test serve every table:

- :func:`paired_outcomes`: one binary outcome per item and condition (was the greedy turn a genuine
  follow-up?). Items present under both conditions are paired; the exact McNemar test on the discordant
  counts (:func:`mcnemar_exact`) gives the p-value.
- :func:`paired_rates`: per item, ``(k, n)`` under each condition (k genuine of n sampled turns). Items with
  turns under both are paired; :func:`paired_bootstrap` resamples items for the difference of pooled rates.

Why pair at all: both conditions see the same items, so item difficulty cancels and the test is far more
sensitive than comparing two independent intervals. Callers keep thin adapters that read their own files
into these per-item mappings.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from statsmodels.stats.contingency_tables import mcnemar

from mechprobe.stats.proportions import Rate

__all__ = ["PairedOutcomes", "PairedRates", "mcnemar_exact", "paired_bootstrap", "paired_outcomes", "paired_rates"]


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


@dataclass(frozen=True)
class PairedOutcomes:
    """Binary outcomes of two conditions A and B on the items both have, with the exact McNemar p-value.

    ``only_a`` = items positive under A only, ``only_b`` = under B only (the discordant counts)."""

    n: int
    both: int
    only_a: int
    only_b: int
    p: float

    @property
    def rate_a(self) -> Rate:
        return Rate(self.both + self.only_a, self.n)

    @property
    def rate_b(self) -> Rate:
        return Rate(self.both + self.only_b, self.n)

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "both": self.both, "only_a": self.only_a, "only_b": self.only_b, "p": self.p}


def paired_outcomes(a: Mapping[Hashable, bool], b: Mapping[Hashable, bool]) -> PairedOutcomes:
    """Pair the items present in both ``a`` and ``b`` (item -> outcome) and test them with exact McNemar.

    Example:
        >>> paired_outcomes({"i1": True, "i2": False}, {"i1": True, "i2": True, "i3": True}).only_b
        1
    """
    common = set(a) & set(b)
    both = sum(bool(a[k]) and bool(b[k]) for k in common)
    only_a = sum(bool(a[k]) and not b[k] for k in common)
    only_b = sum(bool(b[k]) and not a[k] for k in common)
    return PairedOutcomes(len(common), both, only_a, only_b, mcnemar_exact(only_a, only_b))


@dataclass(frozen=True)
class PairedRates:
    """Pooled rates of two conditions over the items with turns under both, and B - A with a bootstrap CI."""

    n_items: int
    rate_a: Rate
    rate_b: Rate
    diff: float
    lo: float
    hi: float
    p: float

    def as_tuple(self) -> tuple[float, float, float, float]:
        """``(diff, lo, hi, p)``: what :func:`paired_bootstrap` returns."""
        return self.diff, self.lo, self.hi, self.p


def paired_rates(a: Mapping[Hashable, tuple[int, int]], b: Mapping[Hashable, tuple[int, int]], n_boot: int = 2000,
                 seed: int = 0) -> PairedRates:
    """Pair the items present in both ``a`` and ``b`` (item -> ``(k, n)``) and bootstrap the difference of
    pooled rates over items (:func:`paired_bootstrap`). Items are taken in sorted order, so the result is a
    function of the mappings alone (deterministic for a given ``seed``)."""
    items = sorted(set(a) & set(b))
    d, lo, hi, p = paired_bootstrap([a[i][0] for i in items], [a[i][1] for i in items],
                                    [b[i][0] for i in items], [b[i][1] for i in items], n_boot, seed)
    return PairedRates(len(items), Rate(sum(a[i][0] for i in items), sum(a[i][1] for i in items)),
                       Rate(sum(b[i][0] for i in items), sum(b[i][1] for i in items)), d, lo, hi, p)
