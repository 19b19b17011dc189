"""The propensity's own reliability (split-half, Spearman-Brown) and the ceiling sqrt(R) it puts on any probe."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mechprobe.linear.fit import Metric, spearman_rows
from mechprobe.linear.propensity.statistics import _percentile_ci, bootstrap_indices


def spearman_brown(r: np.ndarray | float, factor: float = 2.0) -> np.ndarray | float:
    """Reliability of a test ``factor`` times longer: ``factor r / (1 + (factor - 1) r)``."""
    r = np.asarray(r, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = factor * r / (1.0 + (factor - 1.0) * r)
    return float(out) if out.ndim == 0 else out


def _half_matrices(samples: Sequence[Sequence[int]], n_splits: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``[n_splits, n_items]`` half-A and half-B propensities, each split a fresh permutation per item.

    With odd ``k`` the extra sample goes to half B (halves of k//2 and k - k//2): a small asymmetry that
    makes the Spearman-Brown step slightly conservative, never optimistic.
    """
    n = len(samples)
    a = np.zeros((n_splits, n))
    b = np.zeros((n_splits, n))
    for i, s in enumerate(samples):
        s = np.asarray(s, float)
        h = len(s) // 2
        perm = np.argsort(rng.random((n_splits, len(s))), axis=1)
        x = s[perm]
        a[:, i] = x[:, :h].mean(1)
        b[:, i] = x[:, h:].mean(1)
    return a, b


def split_half_reliability(per_item_binary_lists: Sequence[Sequence[int]], n_splits: int = 200, seed: int = 0,
                           n_boot: int = 1000, boot_splits: int = 20) -> Metric:
    """The ceiling on any probe's Spearman rho with the propensity: its own split-half reliability.

    Each item's ``k`` judged samples are split at random into halves; Spearman rho between half-A and
    half-B propensities over items estimates the reliability of a ``k/2``-sample propensity, and the
    Spearman-Brown step (``2r / (1 + r)``) extends it to full ``k``. Averaged over ``n_splits`` random
    splits (one split is a noisy draw). The 95% CI resamples items (``boot_splits`` splits per draw, for
    cost). Items with fewer than 2 samples cannot be split and are left out. Spearman-Brown is exact for
    parallel halves under a Pearson model; for the rank correlation of binomial proportions it is an
    approximation the tests check against a simulated test-retest correlation.
    """
    lists = [list(s) for s in per_item_binary_lists if len(s) >= 2]
    if len(lists) < 3:
        return Metric(float("nan"), float("nan"), float("nan"))
    rng = np.random.default_rng([seed, 0x5B1F])
    a, b = _half_matrices(lists, n_splits, rng)
    point = float(np.nanmean(spearman_brown(spearman_rows(a, b)))) if np.isfinite(spearman_rows(a, b)).any() \
        else float("nan")
    m = min(boot_splits, n_splits)
    idx = bootstrap_indices(len(lists), n_boot, seed)
    vals = np.empty(n_boot)
    for j in range(n_boot):
        r = spearman_brown(spearman_rows(a[:m, idx[j]], b[:m, idx[j]]))
        vals[j] = np.nanmean(r) if np.isfinite(r).any() else np.nan
    return _percentile_ci(point, vals)


def attenuation_ceiling(reliability: Metric) -> Metric:
    """sqrt(R) for a reliability metric: the correlation of the true score with its noisy estimate."""
    def f(v: float) -> float:
        return float(np.sqrt(max(v, 0.0))) if np.isfinite(v) else float("nan")

    return Metric(f(reliability.value), f(reliability.lo), f(reliability.hi))
