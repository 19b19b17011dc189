"""Item folds and the item-level fits: ridge on the propensity (alpha by inner Spearman CV), logistic out of fold."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold, StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mechprobe.errors import UserError
from mechprobe.linear.fit import Folds, fit_logreg, spearman, thin_data_hint

ALPHAS: tuple[float, ...] = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)



class InsufficientItems(UserError, ValueError):
    """Too few items (or no spread in the target) for item-level cross-validation to mean anything."""


def make_item_folds(strata: Sequence[str], n_splits: int = 5, seed: int = 0) -> Folds:
    """Item folds (one row per item), stratified by ``strata`` (e.g. dataset + above-median).

    Stratifying by dataset keeps every dataset in every training fold when runs are pooled; stratifying
    by the above-median class keeps both classes in every fold, so each fold's AUROC is defined.
    """
    strata = np.asarray([str(s) for s in strata])
    n = len(strata)
    if n < 2 * n_splits:
        raise InsufficientItems(f"only {n} items for {n_splits}-fold item-level CV (need >= {2 * n_splits}). "
                                f"{thin_data_hint(n, n_splits, n // 2)}")
    counts = Counter(strata.tolist())
    if min(counts.values()) >= n_splits:
        split = StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(n), strata)
    else:  # a stratum smaller than the fold count: plain shuffled folds rather than a warning and odd folds
        split = KFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(n))
    return [(tr, te) for tr, te in split]


def _ridge(alpha: float) -> Any:
    return make_pipeline(StandardScaler(), Ridge(alpha=alpha))


@dataclass
class RidgeFit:
    model: Any
    alpha: float
    inner_rho: float  # mean inner-CV Spearman at the chosen alpha (0 when no inner CV was possible)


def fit_ridge(x: np.ndarray, y: np.ndarray, seed: int = 0, alphas: Sequence[float] = ALPHAS,
              n_inner: int = 3) -> RidgeFit:
    """StandardScaler + Ridge, alpha chosen by inner K-fold Spearman on these items only, then refit.

    Scored by Spearman, not MSE: the headline metric is a rank correlation, and a propensity is bounded
    and lumpy (multiples of 1/k), so the alpha that ranks items best is the one wanted.
    """
    y = np.asarray(y, float)
    best_a, best = alphas[len(alphas) // 2], 0.0
    if len(y) >= 2 * n_inner and np.ptp(y) > 0:
        best = -2.0
        splits = list(KFold(n_splits=n_inner, shuffle=True, random_state=seed).split(x))
        for a in alphas:
            s = np.zeros(len(y))
            for tr, va in splits:
                s[va] = _ridge(a).fit(x[tr], y[tr]).predict(x[va])
            rho = spearman(y, s)
            rho = -1.0 if not np.isfinite(rho) else rho
            if rho > best + 1e-12:
                best, best_a = rho, a
    return RidgeFit(_ridge(best_a).fit(x, y), float(best_a), float(best))


def _logreg_ok(y: np.ndarray) -> bool:
    return int(y.sum()) >= 2 and int((1 - y).sum()) >= 2


def oof_ridge(x: np.ndarray, y: np.ndarray, folds: Folds, seed: int = 0, alphas: Sequence[float] = ALPHAS
              ) -> tuple[np.ndarray, list[float], list[float]]:
    """Out-of-fold ridge scores, each fold's alpha and its inner-CV Spearman."""
    s = np.zeros(len(y))
    alphas_used, inner = [], []
    for tr, te in folds:
        fit = fit_ridge(x[tr], y[tr], seed, alphas)
        s[te] = fit.model.predict(x[te])
        alphas_used.append(fit.alpha)
        inner.append(fit.inner_rho)
    return s, alphas_used, inner


def oof_logreg(x: np.ndarray, y: np.ndarray, folds: Folds, seed: int = 0) -> tuple[np.ndarray, list[float]]:
    """Out-of-fold logistic scores (C by inner CV, :func:`mechprobe.linear.turn.fit_logreg`) and inner AUROCs.

    A training fold with fewer than two items of a class cannot be fitted: its test items score NaN (and inner
    AUROC 0.5), so :func:`auroc_metric` reports nothing. Why not 0: a constant 0 for the rare class's fold sits
    above the other folds' mostly negative decision values and manufactured AUROC ~0.8 at every layer from 2
    positives out of 200 (the 0.5B model's greedy labels).
    """
    y = np.asarray(y).astype(int)
    s = np.zeros(len(y))
    inner = []
    keys = np.arange(len(y)).astype(str)  # one row per item: each row is its own group
    for tr, te in folds:
        if not _logreg_ok(y[tr]):
            inner.append(0.5)
            s[te] = np.nan
            continue
        fit = fit_logreg(x[tr], y[tr], keys[tr], seed)
        s[te] = fit.model.decision_function(x[te])
        inner.append(fit.inner_auroc)
    return s, inner
