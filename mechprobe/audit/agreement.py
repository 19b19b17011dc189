"""Cohen's kappa between two labellings of the same turns, with an item-bootstrap interval.

Why bootstrap over *items*: in a steering audit one item is labelled under several conditions, and its
turns are not independent (same query, same answer); resampling items keeps them together. Why both
binary and 8-label: the study's statistic is genuine vs not, but a judge that confuses
``assistant_continuation`` with ``meta_planning`` shows only in the 8-label kappa.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mechprobe.stats import cohen_kappa
from mechprobe.taxonomy import GENUINE, LABELS

__all__ = ["Kappa", "kappa_with_ci"]


@dataclass(frozen=True)
class Kappa:
    """Cohen's kappa (sklearn) with a percentile bootstrap interval; NaN when undefined (one class only)."""

    kappa: float
    lo: float
    hi: float
    n: int
    agree: int
    binary: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def cell(self) -> str:
        if self.n == 0:
            return "—"
        if not math.isfinite(self.kappa):
            return f"n/a ({self.agree}/{self.n} agree)"
        ci = f" [{self.lo:.2f}, {self.hi:.2f}]" if math.isfinite(self.lo) else ""
        return f"{self.kappa:.2f}{ci} ({self.agree}/{self.n} agree)"


def _kappa(a: Sequence[str], b: Sequence[str], binary: bool) -> float:
    """Kappa of two labellings, binary (genuine vs not) or over the 8 labels (:func:`mechprobe.stats.cohen_kappa`)."""
    if binary:
        return cohen_kappa([x == GENUINE for x in a], [x == GENUINE for x in b], [False, True])
    return cohen_kappa(a, b, list(LABELS))


def _binary_kappa(c: np.ndarray) -> float:
    """Cohen's kappa from the counts (neither, b only, a only, both genuine); NaN where one class is all there is
    in both labellings (as :func:`mechprobe.stats.cohen_kappa`)."""
    n = float(c.sum())
    if n == 0:
        return float("nan")
    pa, pb = (c[2] + c[3]) / n, (c[1] + c[3]) / n
    pe = pa * pb + (1 - pa) * (1 - pb)
    if (pa in (0.0, 1.0)) and pa == pb:
        return float("nan")
    return float(((c[0] + c[3]) / n - pe) / (1 - pe))


def kappa_with_ci(a: Sequence[str], b: Sequence[str], items: Sequence[str], binary: bool, n_boot: int = 500,
                  seed: int = 0, alpha: float = 0.05) -> Kappa:
    """Kappa of two labellings (taxonomy labels) of the same turns, bootstrap CI resampling items.

    Args:
        a, b: the two labellings, one entry per turn.
        items: the item id of each turn (turns of one item are resampled together).
        binary: genuine vs not (True) or all 8 labels (False).
        n_boot: bootstrap draws; seed: their seed; alpha: 1 - confidence level.
    Returns:
        the kappa; ``lo``/``hi`` are NaN when fewer than half of the draws define a kappa.
    Example:
        >>> kappa_with_ci(["genuine_followup", "new_query"], ["genuine_followup", "new_query"], ["i1", "i2"], True).kappa
        1.0
    """
    if not (len(a) == len(b) == len(items)):
        raise ValueError("kappa_with_ci: a, b and items need one entry per turn")
    n = len(a)
    agree = sum((x == GENUINE) == (y == GENUINE) if binary else x == y for x, y in zip(a, b))
    if n == 0:
        return Kappa(float("nan"), float("nan"), float("nan"), 0, 0, binary)
    k = _kappa(a, b, binary)
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(it, []).append(i)
    keys = sorted(groups)
    rng = np.random.default_rng(seed)
    boots = []
    if binary:
        # Binary kappa is a function of the four cell counts, so a draw is the sum of its items' counts: the same
        # draws and the same kappa as relabelling each resample, without building and scoring n_boot label lists.
        cells = np.zeros((len(keys), 4))
        for j, key in enumerate(keys):
            for i in groups[key]:
                cells[j, 2 * (a[i] == GENUINE) + (b[i] == GENUINE)] += 1
        for _ in range(n_boot):
            boots.append(_binary_kappa(np.bincount(rng.integers(0, len(keys), len(keys)), minlength=len(keys)) @ cells))
    else:
        for _ in range(n_boot):
            idx = [i for g in rng.integers(0, len(keys), len(keys)) for i in groups[keys[g]]]
            boots.append(_kappa([a[i] for i in idx], [b[i] for i in idx], binary))
    vals = np.array([x for x in boots if math.isfinite(x)])
    if len(vals) < max(1, n_boot // 2):
        lo = hi = float("nan")
    else:
        lo, hi = (float(v) for v in np.quantile(vals, [alpha / 2, 1 - alpha / 2]))
    return Kappa(k, lo, hi, n, int(agree), binary)
