"""The audit's rates: exact intervals with no audited follow-up, item-clustered ones when items repeat."""

from __future__ import annotations

import numpy as np

from mechprobe.audit import corrected_rate, judge_only_rate
from mechprobe.stats.clustered import clopper_pearson


def test_no_audited_follow_up_gives_an_exact_not_a_zero_width_interval():
    # the judge never says genuine and no audited turn is genuine: the CLT interval alone would be [0, 0]
    est = corrected_rate(np.zeros(300), np.zeros(40), np.zeros(40))
    assert est.point == 0.0 and est.lo == 0.0
    assert est.hi >= clopper_pearson(0, 40)[1] > 0.08
    ones = corrected_rate(np.ones(300), np.ones(40), np.ones(40))
    assert ones.hi == 1.0 and ones.lo <= clopper_pearson(40, 40)[0] < 0.92
    assert judge_only_rate(np.zeros(30), items=[f"i{k // 3}" for k in range(30)]).hi > 0.2  # CP over 10 items


def test_repeated_items_switch_to_the_cluster_bootstrap_and_widen_the_interval():
    rng = np.random.default_rng(11)
    items = np.repeat([f"i{k}" for k in range(80)], 4)
    truth = np.repeat((rng.random(80) < 0.3).astype(float), 4)
    judge = np.where(rng.random(truth.size) < 0.9, truth, 1 - truth)
    aud = np.zeros(truth.size, bool)
    aud[::4] = True
    flat = corrected_rate(judge[~aud], judge[aud], truth[aud])
    clus = corrected_rate(judge[~aud], judge[aud], truth[aud], items_all=list(items[~aud]),
                          items_audited=list(items[aud]))
    assert "cluster" in clus.method and "cluster" not in flat.method
    assert abs(clus.point - flat.point) < 1e-9
    assert clus.hi - clus.lo > flat.hi - flat.lo
    j_flat, j_clus = judge_only_rate(judge), judge_only_rate(judge, items=list(items))
    assert (j_clus.hi - j_clus.lo) > 1.5 * (j_flat.hi - j_flat.lo)
