"""Unpaired bootstrap comparisons: two independent groups of items."""

from __future__ import annotations

import random

__all__ = ["bootstrap_diff"]


def bootstrap_diff(a: list[tuple[int, int]], b: list[tuple[int, int]], n_boot: int = 2000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Pooled rate of group ``b`` minus group ``a`` (each a list of per-item ``(k, n)``), 95% percentile CI,
    resampling items within each group independently (two unpaired groups of items, e.g. items the model
    answered correctly vs wrongly). NaNs when a group has no turns. Deterministic for a given ``seed``."""
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
