"""Corrected rates are ppi_py's estimates; under a planted judge bias they cover the truth, the judge's do not."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ppi_py import ppi_mean_ci, ppi_mean_pointestimate

from mechprobe.audit import corrected_paired_difference, corrected_rate, judge_only_rate


def test_corrected_rate_equals_ppi_py():
    rng = np.random.default_rng(7)
    y = (rng.random(60) < 0.1).astype(float)
    yhat = np.where(y == 1, rng.random(60) < 0.9, rng.random(60) < 0.2).astype(float)
    yhat_u = (rng.random(900) < 0.25).astype(float)
    est = corrected_rate(yhat_u, yhat, y, alpha=0.05)
    lo, hi = ppi_mean_ci(y, yhat, yhat_u, alpha=0.05)
    assert math.isclose(est.point, float(np.ravel(ppi_mean_pointestimate(y, yhat, yhat_u))[0]), rel_tol=1e-12)
    assert math.isclose(est.lo, max(0.0, float(np.ravel(lo)[0])), rel_tol=1e-12)
    assert math.isclose(est.hi, float(np.ravel(hi)[0]), rel_tol=1e-12)
    assert est.n_audited == 60 and est.n_total == 960 and "ppi" in est.method
    # plain lists work too (the report passes lists), and no audited turn is NaN, not an error
    assert corrected_rate(list(yhat_u), list(yhat), list(y)).point == est.point
    assert math.isnan(corrected_rate(yhat_u, [], []).point)


def test_paired_difference_is_ppi_on_item_differences():
    rng = np.random.default_rng(1)
    items = [f"i{k}" for k in range(200)]
    ja = {i: float(rng.random() < 0.3) for i in items}
    jb = {i: float(rng.random() < 0.5) for i in items}
    aud = items[:50]
    ya = {i: float(rng.random() < 0.1) for i in aud}
    yb = {i: float(rng.random() < 0.3) for i in aud}
    est = corrected_paired_difference(ja, jb, ya, yb)
    y = np.array([yb[i] - ya[i] for i in aud])
    yhat = np.array([jb[i] - ja[i] for i in aud])
    yhat_u = np.array([jb[i] - ja[i] for i in items[50:]])
    lo, hi = ppi_mean_ci(y, yhat, yhat_u, alpha=0.05)
    assert math.isclose(est.point, float(np.ravel(ppi_mean_pointestimate(y, yhat, yhat_u))[0]), rel_tol=1e-12)
    assert math.isclose(est.lo, max(-1.0, float(np.ravel(lo)[0])), rel_tol=1e-12)
    assert est.n_audited == 50 and est.n_total == 200


def test_planted_judge_bias_coverage():
    """True rate 5%; the judge finds 90% of follow-ups but also calls 15% of the rest genuine (~19%)."""
    truth, n_pop, n_audit, draws = 0.05, 3000, 200, 200
    rng = np.random.default_rng(2024)
    cover_judge = cover_ppi = 0
    for _ in range(draws):
        y = rng.random(n_pop) < truth
        judge = np.where(y, rng.random(n_pop) < 0.9, rng.random(n_pop) < 0.15).astype(float)
        audited = rng.choice(n_pop, n_audit, replace=False)
        rest = np.setdiff1d(np.arange(n_pop), audited)
        j = judge_only_rate(judge)
        c = corrected_rate(judge[rest], judge[audited], y[audited].astype(float))
        cover_judge += j.lo <= truth <= j.hi
        cover_ppi += c.lo <= truth <= c.hi
    assert cover_judge / draws < 0.2
    assert cover_ppi / draws > 0.85


def test_fully_audited_stratum_without_follow_ups_keeps_an_interval():
    """0 of 60 audited and nothing left to impute: the rate is 0, but its interval is Wilson's, not a zero-width one."""
    import numpy as np

    from mechprobe.audit import corrected_rate

    est = corrected_rate(np.array([], float), np.zeros(60), np.zeros(60))
    assert est.point == 0.0 and est.lo == 0.0 and 0.05 < est.hi < 0.07


def test_fully_audited_paired_difference_has_a_difference_interval():
    """Every item audited in both conditions: the interval is for a difference in [-1, 1] (was a Wilson
    interval of a sum of differences: [-100%, 100%] when the sum was negative, too narrow when it was small)."""
    items = [f"i{k}" for k in range(60)]
    judge = dict.fromkeys(items, 0.0)
    none = {i: float(k < 1) for k, i in enumerate(items)}       # 1/60 genuine unsteered
    same = {i: 0.0 for i in items}                               # 0/60 steered: a difference of -1/60
    est = corrected_paired_difference(judge, judge, none, same)
    assert est.point == pytest.approx(-1 / 60) and -0.12 < est.lo < est.point < est.hi < 0.08
    lifted = {i: float(k < 12) for k, i in enumerate(items)}    # 12/60 steered: +11/60
    est = corrected_paired_difference(judge, judge, none, lifted)
    assert est.lo > 0 and est.hi < 0.35 and est.n_audited == 60
    flat = corrected_paired_difference(judge, judge, none, none)
    assert flat.point == 0 and flat.lo < 0 < flat.hi  # no change still has width
