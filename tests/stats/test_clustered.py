"""Item-clustered intervals: wider than naive ones when turns of an item agree, never zero-width at 0/n."""

from __future__ import annotations

import numpy as np
import pytest

from mechprobe.stats import wilson
from mechprobe.stats.clustered import (
    clopper_pearson,
    cluster_bootstrap_ppi,
    cluster_bootstrap_rate,
    cluster_ppi_paired_difference,
    paired_cluster_bootstrap,
    ppi_lambda,
)


def _correlated(n_items: int = 40, per_item: int = 5, p: float = 0.3, seed: int = 0):
    """Every turn of an item shares the item's outcome: the extreme of within-item correlation."""
    rng = np.random.default_rng(seed)
    item_y = (rng.random(n_items) < p).astype(float)
    values = np.repeat(item_y, per_item)
    clusters = np.repeat([f"i{k}" for k in range(n_items)], per_item)
    return values, list(clusters)


def test_cluster_bootstrap_rate_is_wider_than_the_naive_interval_when_turns_of_an_item_agree():
    y, items = _correlated()
    lo_n, hi_n = wilson(int(y.sum()), y.size)  # treats the 200 turns as independent
    est = cluster_bootstrap_rate(y, items, n_boot=2000, seed=1)
    assert est.point == pytest.approx(y.mean())
    assert est.n_clusters == 40 and est.n == 200
    assert (est.hi - est.lo) > 1.7 * (hi_n - lo_n)  # ~sqrt(5) wider in theory
    # with one turn per item the clustered interval is about the naive one
    one = cluster_bootstrap_rate(y[::5], items[::5], n_boot=2000, seed=1)
    lo1, hi1 = wilson(int(y[::5].sum()), 40)
    assert (one.hi - one.lo) == pytest.approx(hi1 - lo1, rel=0.3)


def test_cluster_ppi_matches_ppi_py_point_and_is_wider_under_correlation():
    from ppi_py import ppi_mean_ci, ppi_mean_pointestimate

    rng = np.random.default_rng(3)
    n_items, per = 60, 5
    truth_item = (rng.random(n_items) < 0.3).astype(float)
    items = np.repeat([f"i{k}" for k in range(n_items)], per)
    truth = np.repeat(truth_item, per)
    judge = np.where(rng.random(truth.size) < 0.85, truth, 1 - truth)  # a noisy judge
    audited = np.zeros(truth.size, bool)
    audited[::per] = True  # one audited turn per item
    y, yh, yu = truth[audited], judge[audited], judge[~audited]
    est = cluster_bootstrap_ppi(y, yh, list(items[audited]), yu, list(items[~audited]), n_boot=2000, seed=0)
    ref = float(np.asarray(ppi_mean_pointestimate(y, yh, yu)).ravel()[0])
    assert est.point == pytest.approx(ref, abs=1e-9)
    lam = ppi_lambda(y, yh, yu)
    assert 0.0 <= lam <= 1.0
    lo, hi = (float(np.asarray(v).ravel()[0]) for v in ppi_mean_ci(y, yh, yu, alpha=0.05))
    assert est.lo <= est.point <= est.hi
    assert (est.hi - est.lo) > 1.05 * (hi - lo)  # unlabelled turns of an item are not independent


@pytest.mark.parametrize("k", [0, 25])
def test_clopper_pearson_is_never_degenerate_at_the_edges(k):
    lo, hi = clopper_pearson(k, 25)
    assert 0.0 <= lo < hi <= 1.0
    assert hi - lo > 0.1  # 0/25 is compatible with a rate of ~14%
    assert (lo == 0.0) == (k == 0) and (hi == 1.0) == (k == 25)


def test_all_zero_rates_get_an_exact_interval_not_a_point():
    est = cluster_bootstrap_rate([0] * 30, [f"i{k // 3}" for k in range(30)])
    assert est.lo == 0.0 and est.hi == pytest.approx(clopper_pearson(0, 10)[1])  # over the 10 items
    ppi = cluster_bootstrap_ppi([0] * 20, [0] * 20, [f"i{k}" for k in range(20)], [0] * 40,
                                [f"i{k % 20}" for k in range(40)])
    assert ppi.point == 0.0 and ppi.hi >= clopper_pearson(0, 20)[1] > 0.1
    ones = cluster_bootstrap_ppi([1] * 20, [1] * 20, [f"i{k}" for k in range(20)], [1] * 5, ["x"] * 5)
    assert ones.lo <= clopper_pearson(20, 20)[0] < 0.9 and ones.hi == 1.0


def test_paired_cluster_bootstrap_respects_items():
    a_y, items = _correlated(p=0.2, seed=5)
    b_y, _ = _correlated(p=0.6, seed=6)
    a, b = {}, {}
    for i, va, vb in zip(items, a_y, b_y):
        a.setdefault(i, []).append(va)
        b.setdefault(i, []).append(vb)
    est = paired_cluster_bootstrap(a, b, n_boot=2000, seed=0)
    assert est.point == pytest.approx(b_y.mean() - a_y.mean())
    assert est.lo < est.point < est.hi and est.p < 0.05
    # the same turns, each treated as its own item: a narrower (wrong) interval
    flat_a = {f"t{k}": [v] for k, v in enumerate(a_y)}
    flat_b = {f"t{k}": [v] for k, v in enumerate(b_y)}
    naive = paired_cluster_bootstrap(flat_a, flat_b, n_boot=2000, seed=0)
    assert (est.hi - est.lo) > 1.7 * (naive.hi - naive.lo)
    zeros = paired_cluster_bootstrap({"i": [0, 0], "j": [0]}, {"i": [0], "j": [0, 0]})
    assert zeros.point == 0.0 and zeros.lo < 0 < zeros.hi


def test_corrected_paired_difference_removes_a_judge_bias():
    rng = np.random.default_rng(7)
    items = [f"i{k}" for k in range(200)]
    ja, jb, aa, ab = {}, {}, {}, {}
    for i in items:
        ta, tb = (rng.random(3) < 0.1).astype(float), (rng.random(3) < 0.4).astype(float)
        ha = np.maximum(ta, (rng.random(3) < 0.3).astype(float))  # the judge over-calls under a only
        ja[i], jb[i] = list(ha), list(tb)
        aa[i], ab[i] = [(ta[0], ha[0])], [(tb[0], tb[0])]
    est = cluster_ppi_paired_difference(ja, jb, aa, ab, n_boot=1000, seed=0)
    judge_only = np.mean([v for i in items for v in jb[i]]) - np.mean([v for i in items for v in ja[i]])
    assert judge_only < 0.2  # the judge's bias hides most of the true 0.3 difference
    assert est.lo < 0.3 < est.hi and est.point > judge_only + 0.05
