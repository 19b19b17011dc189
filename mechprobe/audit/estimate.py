"""Follow-up rates from judge labels: judge-only (Wilson) and corrected by an audit (prediction-powered).

Why both: a judge that calls 15% of non-follow-ups genuine turns a true 5% into a reported ~19%, and its
Wilson interval, however narrow, is an interval around the *judge's* rate. Prediction-powered inference
(PPI; Angelopoulos et al. 2023, PPI++ 2023) uses the audited turns to estimate the judge's bias and the
non-audited turns to keep the variance low, giving a valid interval for the *true* rate. The estimator is
the ``ppi-python`` package's, called as is: this module only arranges the arrays.

Assumptions the corrected numbers rest on (also printed in the report):

- the audited turns of a stratum are a simple random sample of it (the sampler ignores every label);
- the audit labels are the truth (a consensus of labellers; their own disagreement is reported, not modelled);
- the non-audited turns are treated as a sample from the same stratum (PPI's i.i.d. unlabeled set); with a
  finite stratum this makes the interval slightly conservative;
- the interval is a CLT interval: with few audited turns (< ~30) it can be too narrow; with no audited
  positive (or only positives) it is widened to include the exact Clopper-Pearson interval of the audit alone.

Where a stratum holds several turns of one item (k samples, several audited turns per item), every interval
here is item-clustered instead (:mod:`mechprobe.stats.clustered`): pass the turns' items and the functions
switch to a cluster bootstrap over items.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from statsmodels.stats.proportion import proportion_confint

from mechprobe.stats import paired_bootstrap
from mechprobe.stats.clustered import (
    ClusteredEstimate,
    clopper_pearson,
    cluster_bootstrap_ppi,
    cluster_bootstrap_rate,
    has_repeats,
)

__all__ = ["Estimate", "corrected_rate", "judge_only_rate", "corrected_paired_difference", "judge_only_difference",
           "audit_only_rate", "audit_only_difference"]


@dataclass(frozen=True)
class Estimate:
    """A rate (or difference of rates) with a (1 - alpha) interval.

    ``method`` says how it was computed (``"judge-only wilson"``, ``"ppi++ (ppi_py)"``, ...); ``n_audited`` is
    the number of audited turns (or item pairs) behind it, 0 for a judge-only number; ``n_total`` all turns.
    """

    point: float
    lo: float
    hi: float
    n_audited: int
    method: str
    n_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def cell(self) -> str:
        """``12.5% [5.9%, 24.7%]`` for a markdown table; ``n/a`` when undefined."""
        if not math.isfinite(self.point):
            return "n/a"
        return f"{self.point:.1%} [{self.lo:.1%}, {self.hi:.1%}]"


def _from_clustered(c: ClusteredEstimate, n_audited: int, n_total: int, prefix: str = "") -> Estimate:
    return Estimate(c.point, c.lo, c.hi, n_audited, prefix + c.method, n_total)


def _nan(method: str, n_audited: int = 0, n_total: int = 0) -> Estimate:
    return Estimate(float("nan"), float("nan"), float("nan"), n_audited, method, n_total)


def judge_only_rate(judge_all: Any, alpha: float = 0.05, items: Any = None, n_boot: int = 2000,
                    seed: int = 0) -> Estimate:
    """The judge's own rate over all turns, with statsmodels' Wilson interval (item-clustered when items repeat).

    Args:
        judge_all: 0/1 judge verdicts (genuine or not) for every turn of the stratum.
        alpha: 1 - confidence level.
        items: the item of each turn; when an item holds several turns the interval is a cluster bootstrap
            over items (Clopper-Pearson over items when every verdict is equal). n_boot, seed: that bootstrap.
    Returns:
        the rate; ``n_audited`` is 0 because no audit enters it.
    Example:
        >>> judge_only_rate([1, 0, 0, 0]).point
        0.25
    """
    y = np.asarray(judge_all, dtype=float).ravel()
    if y.size == 0:
        return _nan("judge-only wilson")
    if items is not None and has_repeats(list(items)):
        return _from_clustered(cluster_bootstrap_rate(y, list(items), alpha, n_boot, seed), 0, int(y.size),
                               "judge-only ")
    k = int(round(y.sum()))
    lo, hi = proportion_confint(k, y.size, alpha=alpha, method="wilson")
    return Estimate(k / y.size, float(lo), float(hi), 0, "judge-only wilson", int(y.size))


def audit_only_rate(labels_audited: Any, alpha: float = 0.05, items: Any = None, n_boot: int = 2000,
                    seed: int = 0) -> Estimate:
    """The rate of a stratum whose every turn was audited: the audit's mean, with a Wilson interval.

    Why Wilson and not CLT: with no audited follow-up a CLT interval has zero width, yet 0 of 60 is compatible
    with a rate of several percent. Why public: a finding recomputed from committed labels alone (the judge's
    verdicts per turn are not committed) must give the very number the report gives.

    Args:
        labels_audited: the audit's truth per turn, 0/1 or a labellers' consensus in [0, 1].
        alpha: 1 - confidence level.
        items: the item of each turn; when an item holds several turns the interval is the item-cluster bootstrap
            :func:`corrected_rate` uses for such a stratum (n_boot, seed: that bootstrap).
    Example:
        >>> round(audit_only_rate([1, 0, 0, 0]).point, 2)
        0.25
    """
    y = np.asarray(labels_audited, dtype=float).ravel()
    if y.size == 0:
        return _nan("no audited turns")
    if items is not None and has_repeats(list(items)):
        # With nothing left unlabelled the PPI++ estimate is the audit mean and the judge's verdicts drop out of
        # it (any placeholder gives the same draws), so this is corrected_rate's own computation for the stratum.
        c = cluster_bootstrap_ppi(y, np.zeros_like(y), list(items), [], [], alpha, n_boot, seed)
        return _from_clustered(c, int(y.size), int(y.size))
    lo, hi = proportion_confint(float(y.sum()), y.size, alpha=alpha, method="wilson")
    return Estimate(float(y.mean()), max(0.0, float(lo)), min(1.0, float(hi)), int(y.size),
                    "audit only (every turn audited; Wilson)", int(y.size))


def audit_only_difference(audit_a: dict[str, float], audit_b: dict[str, float], alpha: float = 0.05) -> Estimate:
    """``rate(b) - rate(a)`` when every common item was audited in both conditions: nothing to impute.

    A Wilson interval belongs to a proportion, not to a mean of differences in [-1, 1], so the difference gets
    Newcombe's hybrid score interval from the two Wilson intervals (the unpaired form: it ignores the positive
    pairing, so it is conservative).

    Args:
        audit_a, audit_b: ``item_id -> truth`` (0/1 or consensus in [0, 1]); only the items in both count.
        alpha: 1 - confidence level.
    Example:
        >>> audit_only_difference({"i1": 0, "i2": 0}, {"i1": 1, "i2": 0}).point
        0.5
    """
    both = sorted(set(audit_a) & set(audit_b))
    if not both:
        return _nan("no item audited in both conditions")
    ya = np.array([audit_a[i] for i in both], dtype=float)
    yb = np.array([audit_b[i] for i in both], dtype=float)
    pa, pb = float(ya.mean()), float(yb.mean())
    la, ua = proportion_confint(float(ya.sum()), ya.size, alpha=alpha, method="wilson")
    lb, ub = proportion_confint(float(yb.sum()), yb.size, alpha=alpha, method="wilson")
    d = pb - pa
    lo = d - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2)
    hi = d + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2)
    return Estimate(d, max(-1.0, lo), min(1.0, hi), len(both),
                    "audit only (every item audited; Newcombe hybrid score, unpaired: conservative)", len(both))


def _ppi(y: np.ndarray, yhat: np.ndarray, yhat_u: np.ndarray, alpha: float, lo_clip: float,
         hi_clip: float) -> tuple[float, float, float, str]:
    from ppi_py import ppi_mean_ci, ppi_mean_pointestimate  # lazy: slow import, audit only

    if yhat_u.size == 0:
        est = audit_only_rate(y, alpha)
        return est.point, max(lo_clip, est.lo), min(hi_clip, est.hi), est.method
    method, lam = "ppi++ (ppi_py, power-tuned)", None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 0/0 power tuning: handled just below
        point = float(np.asarray(ppi_mean_pointestimate(y, yhat, yhat_u)).ravel()[0])
    if not math.isfinite(point):
        # Power tuning is 0/0 when the audited judge verdicts and the unlabelled ones are all one value
        # (no variance to trade); plain PPI (lam = 1) is still defined.
        method, lam = "ppi (ppi_py, lam=1: power tuning undefined)", 1.0
        point = float(np.asarray(ppi_mean_pointestimate(y, yhat, yhat_u, lam=lam)).ravel()[0])
    lo, hi = ppi_mean_ci(y, yhat, yhat_u, alpha=alpha, lam=lam)
    lo_f, hi_f = float(np.asarray(lo).ravel()[0]), float(np.asarray(hi).ravel()[0])
    if lo_clip == 0.0 and y.size and (bool(np.all(y == 0)) or bool(np.all(y == 1))):
        # No audited follow-up (or only follow-ups): the CLT interval rests on the judge's spread alone and can be
        # nearly zero-width; the audit by itself says at least as much as its exact interval.
        clo, chi = clopper_pearson(float(y.sum()), y.size, alpha)
        lo_f, hi_f = min(lo_f, clo), max(hi_f, chi)
        method += " widened to the audit-only clopper-pearson (all audited values equal)"
    point = min(hi_clip, max(lo_clip, point))  # a rate below 0 (PPI can land there by rounding) reads as 0
    return point, min(point, max(lo_clip, lo_f)), max(point, min(hi_clip, hi_f)), method


def corrected_rate(judge_all: Any, judge_audited: Any, labels_audited: Any, alpha: float = 0.05,
                   items_all: Any = None, items_audited: Any = None, n_boot: int = 2000, seed: int = 0) -> Estimate:
    """The true genuine-follow-up rate of one stratum, corrected by the audit (PPI++ via ``ppi_py``).

    Args:
        judge_all: 0/1 judge verdicts for the stratum's turns that were **not** audited (``Yhat_unlabeled``).
            (The report passes the non-audited turns. Every turn of the stratum, audited ones included, is
            also a valid unlabelled set, because the audited turns are a random subset of the stratum.)
        judge_audited: 0/1 judge verdicts on the audited turns (``Yhat``).
        labels_audited: the audit's truth on the same turns (``Y``): 0/1, or a consensus in [0, 1] (the mean
            of the labellers' genuine calls).
        alpha: 1 - confidence level.
        items_all, items_audited: the item of each turn of ``judge_all`` and of the audited turns; when an item
            holds several turns the interval is an item-cluster bootstrap of the same PPI++ estimate
            (:func:`mechprobe.stats.clustered.cluster_bootstrap_ppi`). n_boot, seed: that bootstrap.
    Returns:
        point, interval (clipped to [0, 1]), ``n_audited`` and the method. NaN with no audited turn. With no
        audited positive (or only positives) the interval includes the audit-only Clopper-Pearson interval.
    Example:
        >>> est = corrected_rate(judge_all=[1, 0, 0, 1, 0, 0], judge_audited=[1, 0], labels_audited=[0, 0])
        >>> est.method
        'ppi++ (ppi_py, power-tuned) widened to the audit-only clopper-pearson (all audited values equal)'
    """
    y = np.asarray(labels_audited, dtype=float).ravel()
    yhat = np.asarray(judge_audited, dtype=float).ravel()
    yhat_u = np.asarray(judge_all, dtype=float).ravel()
    if y.shape != yhat.shape:
        raise ValueError(f"labels_audited ({y.size}) and judge_audited ({yhat.size}) must have one entry per turn")
    n_total = int(y.size + yhat_u.size)
    if y.size == 0:
        return _nan("no audited turns", 0, n_total)
    if items_all is not None and items_audited is not None and has_repeats(list(items_audited) + list(items_all)):
        return _from_clustered(cluster_bootstrap_ppi(y, yhat, list(items_audited), yhat_u, list(items_all), alpha,
                                                     n_boot, seed), int(y.size), n_total)
    point, lo, hi, method = _ppi(y, yhat, yhat_u, alpha, 0.0, 1.0)
    return Estimate(point, lo, hi, int(y.size), method, n_total)


def judge_only_difference(judge_a: dict[str, float], judge_b: dict[str, float], seed: int = 0) -> Estimate:
    """Paired judge-only difference ``rate(b) - rate(a)`` over the items both conditions have.

    Args:
        judge_a, judge_b: ``item_id -> 0/1`` judge verdicts per condition (one turn per item, e.g. greedy).
    Returns:
        the mean per-item difference with a 95% item-bootstrap interval (:func:`mechprobe.stats.paired_bootstrap`).
    """

    common = sorted(set(judge_a) & set(judge_b))
    if not common:
        return _nan("judge-only paired bootstrap")
    ak = [int(judge_a[i]) for i in common]
    bk = [int(judge_b[i]) for i in common]
    ones = [1] * len(common)
    d, lo, hi, _ = paired_bootstrap(ak, ones, bk, ones, seed=seed)
    return Estimate(d, lo, hi, 0, "judge-only paired bootstrap", len(common))


def corrected_paired_difference(judge_a: dict[str, float], judge_b: dict[str, float], audit_a: dict[str, float],
                                audit_b: dict[str, float], alpha: float = 0.05) -> Estimate:
    """Corrected paired difference ``rate(b) - rate(a)`` (e.g. steered minus unsteered) on the same items.

    Choice: PPI on the **per-item difference** ``D_i = Y_b,i - Y_a,i`` (in [-1, 1]), with the judge's
    difference ``Dhat_i`` as the prediction. Items where both conditions were audited are the labelled set;
    items where both conditions have a judge verdict but not both were audited are the unlabelled set. This is
    a mean estimation, so ``ppi_mean_*`` applies unchanged, and pairing cancels item difficulty as in the
    judge-only McNemar test. Assumptions: the items audited in both conditions are a random subset of the
    common items (true for :func:`~mechprobe.audit.sample.draw_sample`, whose item order is shared by all
    strata and ignores labels); one turn per item and condition (greedy steering runs).

    Args:
        judge_a, judge_b: ``item_id -> 0/1`` judge verdicts for conditions a (base) and b.
        audit_a, audit_b: ``item_id -> truth`` (0/1 or consensus in [0, 1]) for the audited turns.
        alpha: 1 - confidence level.
    Returns:
        the difference, its interval (clipped to [-1, 1]) and ``n_audited`` = items audited in both conditions.
    Example:
        >>> corrected_paired_difference({"i1": 0, "i2": 0, "i3": 1}, {"i1": 1, "i2": 1, "i3": 1},
        ...                             {"i1": 0, "i2": 0}, {"i1": 1, "i2": 0}).n_audited
        2
    """
    common = sorted(set(judge_a) & set(judge_b))
    both = [i for i in common if i in audit_a and i in audit_b]
    rest = [i for i in common if not (i in audit_a and i in audit_b)]
    if not both:
        return _nan("no item audited in both conditions", 0, len(common))
    if not rest:
        est = audit_only_difference({i: audit_a[i] for i in both}, {i: audit_b[i] for i in both}, alpha)
        return Estimate(est.point, est.lo, est.hi, est.n_audited, est.method, len(common))
    y = np.array([audit_b[i] - audit_a[i] for i in both], dtype=float)
    yhat = np.array([judge_b[i] - judge_a[i] for i in both], dtype=float)
    yhat_u = np.array([judge_b[i] - judge_a[i] for i in rest], dtype=float)
    point, lo, hi, method = _ppi(y, yhat, yhat_u, alpha, -1.0, 1.0)
    return Estimate(point, lo, hi, len(both), method + " on per-item differences", len(common))
