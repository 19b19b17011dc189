"""Intervals that respect items: cluster bootstrap for rates, PPI-corrected rates and paired differences.

Why: a run holds several user turns per item (k samples at T1, several steering conditions, perturbed variants).
Turns of one item share its query and answer, so they are positively correlated, and an interval that treats
them as independent turns is too narrow. Every function here resamples *items* (clusters), carrying all of an
item's turns (audited or not, under every condition) together, so the interval reflects the number of items
rather than the number of turns.

Why an exact interval at the edges: when every observed value is 0 (or every one is 1) a bootstrap, and a CLT
interval, collapse to a single point, yet 0 positives in 30 turns is compatible with a rate of several percent.
Those cases get a Clopper-Pearson interval instead (on the number of items, the conservative choice when turns
within an item are correlated), never a zero-width one.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import beta

__all__ = ["ClusteredEstimate", "clopper_pearson", "ppi_lambda", "cluster_bootstrap_rate", "cluster_bootstrap_ppi",
           "paired_cluster_bootstrap", "cluster_ppi_paired_difference", "has_repeats"]


@dataclass(frozen=True)
class ClusteredEstimate:
    """A rate or difference with a (1 - alpha) interval; ``p`` is a two-sided bootstrap p-value for differences
    (NaN for rates); ``n`` counts turns (or item pairs), ``n_clusters`` the items behind them."""

    point: float
    lo: float
    hi: float
    n: int
    n_clusters: int
    method: str
    p: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nan(method: str, n: int = 0, n_clusters: int = 0) -> ClusteredEstimate:
    nan = float("nan")
    return ClusteredEstimate(nan, nan, nan, n, n_clusters, method)


def clopper_pearson(k: float, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval for k successes in n trials; ``(0, 1)`` with no trials.

    Why exact: at k = 0 or k = n it is the interval that keeps its coverage with few trials; its width at
    0/n is about 3.7/n for 95% ("rule of three" and a little more), never zero.
    Example:
        >>> lo, hi = clopper_pearson(0, 30)
        >>> lo == 0.0 and 0.11 < hi < 0.12
        True
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"clopper_pearson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    lo = 0.0 if k <= 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k >= n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def has_repeats(clusters: Sequence[Hashable]) -> bool:
    """True when some cluster (item) holds more than one observation: then the clustered methods apply."""
    return len(set(clusters)) < len(clusters)


def _groups(clusters: Sequence[Hashable]) -> tuple[list[Hashable], dict[Hashable, list[int]]]:
    groups: dict[Hashable, list[int]] = {}
    for i, c in enumerate(clusters):
        groups.setdefault(c, []).append(i)
    return sorted(groups, key=repr), groups


def _percentile(boots: np.ndarray, alpha: float) -> tuple[float, float]:
    vals = boots[np.isfinite(boots)]
    if vals.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(vals, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def _clip(v: float, lo: float, hi: float) -> float:
    """``v`` clipped into ``[lo, hi]``, NaN kept.

    Why every bound and the point alike: a PPI estimate (and its bootstrap draws) can leave the range of a rate
    or a difference; clipping the point and only the outer side of each bound once left an interval
    ``[2.0, 1.0]`` around a point 1.0. Clipping all three with one monotone map keeps ``lo <= point <= hi``
    wherever it held before."""
    return float(min(hi, max(lo, v))) if math.isfinite(v) else v


def _edge(values: np.ndarray) -> bool:
    """All values 0, or all 1: the case where resampling cannot show any spread."""
    return values.size > 0 and (bool(np.all(values == 0)) or bool(np.all(values == 1)))


def cluster_bootstrap_rate(values: Sequence[float], clusters: Sequence[Hashable], alpha: float = 0.05,
                           n_boot: int = 2000, seed: int = 0) -> ClusteredEstimate:
    """Pooled rate ``mean(values)`` with a percentile interval that resamples clusters (items).

    Args:
        values: one 0/1 (or [0, 1]) value per turn.
        clusters: the item of each turn.
        alpha: 1 - confidence level; n_boot, seed: the bootstrap.
    Returns:
        the rate; all values 0 (or all 1) gives a Clopper-Pearson interval on the number of items instead.
    Example:
        >>> cluster_bootstrap_rate([1, 1, 0, 0], ["a", "a", "b", "b"]).point
        0.5
    """
    y = np.asarray(values, dtype=float).ravel()
    if y.size != len(clusters):
        raise ValueError("cluster_bootstrap_rate: values and clusters need one entry per turn")
    keys, groups = _groups(clusters)
    if y.size == 0:
        return _nan("no turns")
    point = float(y.mean())
    if _edge(y):
        lo, hi = clopper_pearson(len(keys) * point, len(keys), alpha)
        return ClusteredEstimate(point, lo, hi, int(y.size), len(keys), "clopper-pearson over items (all values equal)")
    sums = np.array([y[groups[k]].sum() for k in keys])
    counts = np.array([len(groups[k]) for k in keys], dtype=float)
    rng = np.random.default_rng(seed)
    draw = rng.integers(0, len(keys), size=(n_boot, len(keys)))
    boots = sums[draw].sum(1) / counts[draw].sum(1)
    lo, hi = _percentile(boots, alpha)
    return ClusteredEstimate(point, lo, hi, int(y.size), len(keys), "cluster bootstrap over items")


def ppi_lambda(y: np.ndarray, yhat: np.ndarray, yhat_u: np.ndarray) -> float:
    """The PPI++ power-tuning weight for a mean, as ``ppi_py`` computes it, clipped to [0, 1].

    ``lam = cov(Y, Yhat) / ((1 + n/N) var(Yhat, Yhat_unlabeled))``; 1 (plain PPI) where it is 0/0 (no spread
    in the judge's verdicts), the same fallback the audit uses with ``ppi_py``.
    """
    t = _totals(np.asarray(y, float), np.asarray(yhat, float), np.asarray(yhat_u, float))
    return float(_lam(*t))


def _totals(y: np.ndarray, yhat: np.ndarray, yhat_u: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(v, dtype=float) for v in (y.size, y.sum(), yhat.sum(), (y * yhat).sum(),
                                                       (yhat ** 2).sum(), yhat_u.size, yhat_u.sum(),
                                                       (yhat_u ** 2).sum()))


def _lam(nl: Any, sy: Any, sh: Any, syh: Any, sh2: Any, nu: Any, su: Any, su2: Any) -> np.ndarray:
    """Vectorised :func:`ppi_lambda` from sufficient sums (one entry per bootstrap draw)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cov = syh / nl - (sy / nl) * (sh / nl)
        tot, s, s2 = nl + nu, sh + su, sh2 + su2
        var = (s2 - s * s / tot) / (tot - 1)
        lam = cov / ((1 + nl / nu) * var)
    ok = np.isfinite(lam) & (var > 1e-12) & (nu > 0)
    return np.where(ok, np.clip(lam, 0.0, 1.0), 1.0)


def _ppi_from_totals(nl: Any, sy: Any, sh: Any, syh: Any, sh2: Any, nu: Any, su: Any, su2: Any) -> np.ndarray:
    """The PPI++ point estimate from sufficient sums; the audit mean where nothing is unlabelled; NaN where
    nothing is audited."""
    lam = _lam(nl, sy, sh, syh, sh2, nu, su, su2)
    with np.errstate(divide="ignore", invalid="ignore"):
        est = np.where(nu > 0, lam * su / np.where(nu > 0, nu, 1) + (sy - lam * sh) / nl, sy / nl)
    return np.where(nl > 0, est, np.nan)


def cluster_bootstrap_ppi(y: Sequence[float], yhat: Sequence[float], clusters: Sequence[Hashable],
                          yhat_u: Sequence[float], clusters_u: Sequence[Hashable], alpha: float = 0.05,
                          n_boot: int = 2000, seed: int = 0) -> ClusteredEstimate:
    """Prediction-powered (PPI++) rate with an item-cluster bootstrap interval.

    The estimator is ``ppi_py``'s mean estimate, ``lam * mean(Yhat_u) + mean(Y - lam * Yhat)`` with the power-tuned
    ``lam`` (:func:`ppi_lambda`); the interval resamples items, each carrying its audited turns (``y``, ``yhat``)
    and its other turns (``yhat_u``) together, and recomputes ``lam`` in every draw.

    Args:
        y, yhat, clusters: the audited turns' truth (0/1 or a consensus in [0, 1]), the judge's 0/1 verdict and item.
        yhat_u, clusters_u: the judge's verdicts on the turns that were not audited, and their items.
        alpha, n_boot, seed: level and bootstrap.
    Returns:
        the corrected rate clipped to [0, 1]. With no audited positive (or only positives) the interval is widened to
        include the audit-only Clopper-Pearson interval over the audited items, so it is never degenerate.
    Example:
        >>> est = cluster_bootstrap_ppi([1, 0], [1, 1], ["a", "b"], [1, 0, 0, 1], ["a", "b", "c", "c"])
        >>> est.n_clusters
        3
    """
    ya, yh, yu = (np.asarray(v, dtype=float).ravel() for v in (y, yhat, yhat_u))
    if not (ya.size == yh.size == len(clusters)) or yu.size != len(clusters_u):
        raise ValueError("cluster_bootstrap_ppi: y, yhat, clusters (and yhat_u, clusters_u) need one entry per turn")
    if ya.size == 0:
        return _nan("no audited turns", 0, len(set(clusters_u)))
    keys = sorted(set(clusters) | set(clusters_u), key=repr)
    pos = {k: j for j, k in enumerate(keys)}
    per = np.zeros((len(keys), 8))
    for v, h, c in zip(ya, yh, clusters):
        per[pos[c], :5] += (1.0, v, h, v * h, h * h)
    for h, c in zip(yu, clusters_u):
        per[pos[c], 5:] += (1.0, h, h * h)
    point = float(_ppi_from_totals(*per.sum(0)))
    rng = np.random.default_rng(seed)
    draws = per[rng.integers(0, len(keys), size=(n_boot, len(keys)))].sum(1)
    boots = _ppi_from_totals(*draws.T)
    lo, hi = _percentile(boots, alpha)
    method = "ppi++ with cluster bootstrap over items"
    if _edge(ya):
        n_items_aud = len(set(clusters))
        clo, chi = clopper_pearson(n_items_aud * float(ya.mean()), n_items_aud, alpha)
        lo = min(lo, clo) if math.isfinite(lo) else clo
        hi = max(hi, chi) if math.isfinite(hi) else chi
        method += " widened to the audit-only clopper-pearson (all audited values equal)"
    return ClusteredEstimate(_clip(point, 0.0, 1.0), _clip(lo, 0.0, 1.0), _clip(hi, 0.0, 1.0), int(ya.size), len(keys),
                             method)


def _paired_p(boots: np.ndarray) -> float:
    vals = boots[np.isfinite(boots)]
    if vals.size == 0:
        return float("nan")
    return float(min(1.0, 2.0 * min(np.mean(vals <= 0), np.mean(vals >= 0))))


def paired_cluster_bootstrap(a: Mapping[Hashable, Sequence[float]], b: Mapping[Hashable, Sequence[float]],
                             alpha: float = 0.05, n_boot: int = 2000, seed: int = 0) -> ClusteredEstimate:
    """Paired difference of pooled rates ``rate(b) - rate(a)`` over the items both have, resampling items.

    Args:
        a, b: ``item -> values`` (0/1 per turn) under conditions a and b; an item may hold several turns in each.
    Returns:
        the difference, its percentile interval and a two-sided bootstrap p-value. When every value in both
        conditions is 0 (or every one is 1) the interval is the Newcombe hybrid of the two Clopper-Pearson
        intervals over items (unpaired, so conservative), never zero-width; NaN without common items.
    Example:
        >>> paired_cluster_bootstrap({"i": [0, 0], "j": [0, 1]}, {"i": [1, 1], "j": [1, 0]}).point
        0.5
    """
    common = sorted(set(a) & set(b), key=repr)
    common = [i for i in common if len(a[i]) and len(b[i])]
    if not common:
        return _nan("paired cluster bootstrap: no common items")
    sa = np.array([float(np.sum(a[i])) for i in common])
    na = np.array([float(len(a[i])) for i in common])
    sb = np.array([float(np.sum(b[i])) for i in common])
    nb = np.array([float(len(b[i])) for i in common])
    pa, pb = sa.sum() / na.sum(), sb.sum() / nb.sum()
    d = float(pb - pa)
    n_turns = int(na.sum() + nb.sum())
    allv = np.concatenate([np.concatenate([np.asarray(a[i], dtype=float) for i in common]),
                           np.concatenate([np.asarray(b[i], dtype=float) for i in common])])
    if _edge(allv):
        m = len(common)
        la, ua = clopper_pearson(m * pa, m, alpha)
        lb, ub = clopper_pearson(m * pb, m, alpha)
        lo = d - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2)
        hi = d + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2)
        return ClusteredEstimate(d, max(-1.0, lo), min(1.0, hi), n_turns, m,
                                 "newcombe hybrid of clopper-pearson over items (all values equal)", 1.0)
    rng = np.random.default_rng(seed)
    draw = rng.integers(0, len(common), size=(n_boot, len(common)))
    boots = sb[draw].sum(1) / nb[draw].sum(1) - sa[draw].sum(1) / na[draw].sum(1)
    lo, hi = _percentile(boots, alpha)
    return ClusteredEstimate(d, lo, hi, n_turns, len(common), "paired cluster bootstrap over items", _paired_p(boots))


def _cond_sums(judge: Mapping[Hashable, Sequence[float]], audit: Mapping[Hashable, Sequence[tuple[float, float]]],
               items: Sequence[Hashable]) -> np.ndarray:
    """Per item: judge verdict count and sum, audited count and rectifier ``Y - Yhat`` sum (columns)."""
    out = np.zeros((len(items), 4))
    for j, i in enumerate(items):
        out[j, 0], out[j, 1] = len(judge[i]), float(np.sum(judge[i]))
        rect = [y - yh for y, yh in audit.get(i, ())]
        out[j, 2], out[j, 3] = len(rect), float(np.sum(rect))
    return out


def _cond_ppi(t: np.ndarray) -> np.ndarray:
    """One condition's PPI (lam = 1) rate from summed columns of :func:`_cond_sums`: the judge's pooled rate
    over every turn plus the mean audited rectifier; NaN without an audited turn."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(t[..., 2] > 0, t[..., 1] / t[..., 0] + t[..., 3] / t[..., 2], np.nan)


def cluster_ppi_paired_difference(judge_a: Mapping[Hashable, Sequence[float]],
                                  judge_b: Mapping[Hashable, Sequence[float]],
                                  audit_a: Mapping[Hashable, Sequence[tuple[float, float]]],
                                  audit_b: Mapping[Hashable, Sequence[tuple[float, float]]],
                                  alpha: float = 0.05, n_boot: int = 2000, seed: int = 0) -> ClusteredEstimate:
    """Corrected paired difference ``rate(b) - rate(a)`` on the same items, with a paired item bootstrap.

    Each condition's rate is plain PPI (lam = 1): the judge's pooled rate over all its turns of the common items,
    plus the mean of ``Y - Yhat`` over its audited turns. Both conditions are computed on one resample of items
    (the pairing), so item difficulty cancels and turns of one item stay together.

    Args:
        judge_a, judge_b: ``item -> judge verdicts`` (0/1, every turn of the item under that condition).
        audit_a, audit_b: ``item -> [(truth, judge verdict), ...]`` for the item's audited turns.
    Returns:
        the difference, its percentile interval and a two-sided bootstrap p-value; the interval is widened to
        the Newcombe hybrid of the audit-only Clopper-Pearson intervals when every audited truth is 0 (or 1);
        NaN without an audited turn in each condition.
    Example:
        >>> est = cluster_ppi_paired_difference({"i": [0, 0], "j": [0]}, {"i": [1, 1], "j": [1]},
        ...                                     {"i": [(0.0, 0.0)]}, {"i": [(1.0, 1.0)], "j": [(0.0, 1.0)]})
        >>> est.n_clusters
        2
    """
    common = [i for i in sorted(set(judge_a) & set(judge_b), key=repr) if len(judge_a[i]) and len(judge_b[i])]
    if not any(audit_a.get(i) for i in common) or not any(audit_b.get(i) for i in common):
        return _nan("no audited turn in both conditions", 0, len(common))
    sa, sb = _cond_sums(judge_a, audit_a, common), _cond_sums(judge_b, audit_b, common)
    d = float(_cond_ppi(sb.sum(0)) - _cond_ppi(sa.sum(0)))
    draw = np.random.default_rng(seed).integers(0, len(common), size=(n_boot, len(common)))
    boots = _cond_ppi(sb[draw].sum(1)) - _cond_ppi(sa[draw].sum(1))
    lo, hi = _percentile(boots, alpha)
    method = "ppi (lam=1) with paired cluster bootstrap over items"
    ya = np.array([y for i in common for y, _ in audit_a.get(i, ())])
    yb = np.array([y for i in common for y, _ in audit_b.get(i, ())])
    if _edge(np.concatenate([ya, yb])):
        ma, mb = len([i for i in common if audit_a.get(i)]), len([i for i in common if audit_b.get(i)])
        pa, pb = float(ya.mean()), float(yb.mean())
        la, ua = clopper_pearson(ma * pa, ma, alpha)
        lb, ub = clopper_pearson(mb * pb, mb, alpha)
        nlo = (pb - pa) - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2)
        nhi = (pb - pa) + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2)
        lo = min(lo, nlo) if math.isfinite(lo) else nlo
        hi = max(hi, nhi) if math.isfinite(hi) else nhi
        method += " widened to the audit-only newcombe/clopper-pearson (all audited values equal)"
    n_aud = int(ya.size + yb.size)
    return ClusteredEstimate(_clip(d, -1.0, 1.0), _clip(lo, -1.0, 1.0), _clip(hi, -1.0, 1.0), n_aud, len(common),
                             method, _paired_p(boots))
