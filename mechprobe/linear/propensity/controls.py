"""Headline controls of the propensity probe on the same folds: shuffled, random directions, embedding layer,
text-only, response length (pooled and per dataset) and the probe beyond length; and the split-half ceiling."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import rankdata

from mechprobe.linear.fit import Folds, Metric, signed_scores, text_baseline_scores
from mechprobe.linear.propensity.reliability import attenuation_ceiling, split_half_reliability
from mechprobe.linear.propensity.statistics import _percentile_ci, bootstrap_indices, rho_metric
from mechprobe.linear.propensity.sweep import PropensityReport
from mechprobe.linear.propensity.targets import ItemTargets


def propensity_controls(report: PropensityReport, stack: np.ndarray, targets: ItemTargets,
                        texts: Sequence[str] | None = None, response_lengths: Sequence[float] | None = None,
                        seed: int = 0, n_boot: int = 1000, n_splits_ceiling: int = 200) -> dict[str, Metric]:
    """Headline controls on the report's folds, and the split-half ceiling.

    ``shuffled``/``random_direction`` are read at the best layer; ``shuffled_max`` is the best layer under
    shuffled targets (the null for "best of L layers"); ``embedding_layer`` is residual 0 (one fixed token
    at the boundary, so ~0 by construction: a leak check); ``text_ridge`` and ``response_length`` use no
    model internals; ``split_half_reliability`` is R, the propensity's test-retest reliability, and
    ``split_half_ceiling`` = sqrt(R) (point and CI bounds; negative R counts as 0) is the most a probe of
    the true propensity could reach against the observed one.
    """
    y = np.asarray(targets.propensity, float)
    idx = bootstrap_indices(len(y), n_boot, seed)
    best = report.layer(report.best_layer)
    out: dict[str, Metric] = {}
    if best.shuffled_rho is not None:
        out["shuffled"] = best.shuffled_rho
        out["shuffled_max"] = max((r.shuffled_rho for r in report.per_layer if r.shuffled_rho is not None),
                                  key=lambda m: m.value if np.isfinite(m.value) else -2)
    if best.random_dir_rho is not None:
        out["random_direction"] = best.random_dir_rho
    if 0 in report.layers:
        out["embedding_layer"] = report.layer(0).rho
    if texts is not None:
        out["text_ridge"] = rho_metric(y, text_baseline_scores(texts, y, report.folds, seed, model="ridge"), idx)
    if response_lengths is not None:
        f = np.log1p(np.asarray(response_lengths, float))
        out["response_length"] = rho_metric(y, signed_scores(f, y, report.folds), idx)
        z = length_design(np.asarray(response_lengths, float), targets.datasets)
        out["length_by_dataset"] = rho_metric(y, oof_ols(z, y, report.folds), idx)
        if report.nested_scores is not None:
            out["probe_beyond_length"] = partial_rho_metric(y, report.nested_scores, response_lengths,
                                                            targets.datasets, idx)
    rel = split_half_reliability(targets.samples, n_splits_ceiling, seed, n_boot)
    out["split_half_reliability"] = rel
    out["split_half_ceiling"] = attenuation_ceiling(rel)
    return out


def _ranks_within(v: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Ranks of ``v`` within each dataset, scaled to (0, 1]."""
    out = np.zeros(len(v))
    for d in set(ds.tolist()):
        m = ds == d
        out[m] = rankdata(v[m]) / m.sum()
    return out


def length_design(lengths: np.ndarray, datasets: Sequence[str]) -> np.ndarray:
    """Covariates of the length control: an intercept, dataset offsets and a length slope per dataset.

    Why: pooled over datasets, length separates them (MT-Bench answers end early, GSM8K ones hit the cap),
    so a pooled length score mixes "long answers" with "which dataset"; a slope per dataset is the length
    signal a probe could be riding on within each dataset. Length enters as its rank within its dataset
    (lengths only, never targets, so it leaks nothing out of fold).
    """
    ds = np.asarray(datasets)
    names = sorted(set(ds.tolist()))
    r = _ranks_within(np.asarray(lengths, float), ds)
    cols = [np.ones(len(ds))] + [(ds == d).astype(float) for d in names[1:]]
    cols += [r * (ds == d) for d in names]
    return np.stack(cols, 1)


def oof_ols(z: np.ndarray, y: np.ndarray, folds: Folds) -> np.ndarray:
    """Out-of-fold least-squares predictions of ``y`` from covariates ``z`` (minimum-norm where rank-deficient)."""
    out = np.zeros(len(y))
    for tr, te in folds:
        beta = np.linalg.lstsq(z[tr], y[tr], rcond=None)[0]
        out[te] = z[te] @ beta
    return out


def _partial_rank_corr(y: np.ndarray, s: np.ndarray, lengths: np.ndarray, ds: np.ndarray) -> float:
    """Within each dataset: ranks of ``y`` and ``s`` regressed on the rank of length; residuals pooled and correlated.

    A stratified partial Spearman: ranks make any monotone length effect linear, strata remove dataset effects.
    """
    res = []
    for d in set(ds.tolist()):
        m = ds == d
        if m.sum() < 4:
            continue
        z = np.c_[np.ones(m.sum()), _ranks_within(lengths[m], ds[m])]
        r = np.stack([_ranks_within(y[m], ds[m]), _ranks_within(s[m], ds[m])], 1)
        res.append(r - z @ np.linalg.lstsq(z, r, rcond=None)[0])
    if not res:
        return float("nan")
    e = np.concatenate(res)
    if e.std(0).min() <= 1e-12:
        return float("nan")
    return float(np.corrcoef(e[:, 0], e[:, 1])[0, 1])


def partial_rho_metric(y: np.ndarray, s: np.ndarray, lengths: np.ndarray, datasets: Sequence[str],
                       idx: np.ndarray) -> Metric:
    """Partial Spearman of probe score ``s`` and target ``y`` given length, within datasets; item-bootstrap 95% CI.

    Why: "does the probe know more than the answer's length?" A probe that only read length (or which
    dataset an item is from) scores ~0 here however high its plain rho; ``s`` is out of fold.
    """
    y, s, ln, ds = (np.asarray(y, float), np.asarray(s, float), np.asarray(lengths, float),
                    np.asarray(datasets))
    boots = np.array([_partial_rank_corr(y[b], s[b], ln[b], ds[b]) for b in idx])
    return _percentile_ci(_partial_rank_corr(y, s, ln, ds), boots)
