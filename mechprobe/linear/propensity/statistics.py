"""Item-bootstrap 95% CIs of the item-level metrics (Spearman rho, AUROC); one row per item, so an item
 bootstrap is a row bootstrap."""

from __future__ import annotations

import numpy as np

from mechprobe.linear.fit import Metric, auroc, score_rho_rows, weighted_auroc


def bootstrap_indices(n: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """``[n_boot, n]`` item indices drawn with replacement; one seed gives the same draws for every layer."""
    return np.random.default_rng([seed, 0xB007]).integers(0, n, size=(n_boot, n))


def _percentile_ci(point: float, vals: np.ndarray) -> Metric:
    vals = vals[np.isfinite(vals)]
    if not len(vals) or not np.isfinite(point):
        return Metric(float(point), float("nan"), float("nan"))
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return Metric(float(point), float(lo), float(hi))




def rho_metric(y: np.ndarray, s: np.ndarray, idx: np.ndarray) -> Metric:
    """Spearman rho of score ``s`` against target ``y`` with an item-bootstrap 95% CI over draws ``idx``
    (see :func:`score_rho_rows` for the constant-score convention)."""
    y, s = np.asarray(y, float), np.asarray(s, float)
    return _percentile_ci(float(score_rho_rows(y, s)[0]), score_rho_rows(y[idx], s[idx]))


def auroc_metric(y: np.ndarray, s: np.ndarray, idx: np.ndarray) -> Metric | None:
    """AUROC with an item-bootstrap 95% CI (None when ``y`` has one class, or some item has no score: an
    out-of-fold probe that could not be fitted on a fold, see :func:`oof_logreg`)."""
    y = np.asarray(y).astype(int)
    if len(set(y.tolist())) < 2 or not np.all(np.isfinite(np.asarray(s, float))):
        return None
    w = np.zeros((len(idx), len(y)))
    for b in range(len(idx)):
        np.add.at(w[b], idx[b], 1.0)
    return _percentile_ci(auroc(y, s), weighted_auroc(y, np.asarray(s, float), w))
