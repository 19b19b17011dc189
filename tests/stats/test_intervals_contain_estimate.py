"""Every interval the package reports contains its own estimate, at the edges (0/n, n/n) above all.

Why: a figure draws an interval as error-bar extents around its point; a bound on the wrong side of the point
(statsmodels' Wilson lower bound 1.4e-17 for 0/13) made ``steer`` end in a traceback, and a table cell
``0.0% [0.0%, 22.8%]`` whose real lower bound is above 0 is wrong in print too. The exact intervals (Wilson,
Clopper-Pearson) are checked at every x in 0..n for n in 1..200; the bootstrap intervals (item-clustered rate,
PPI, paired differences, two unpaired groups) at x in {0, 1, n/2, n-1, n} for every n in 1..200, with a short
bootstrap. The one percentile interval that may exclude its estimate is the TVD's, and its docstring says so.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mechprobe.stats import Rate, bootstrap_diff, paired_bootstrap, paired_rates, tvd_bootstrap, wilson
from mechprobe.stats.clustered import (
    clopper_pearson,
    cluster_bootstrap_ppi,
    cluster_bootstrap_rate,
    cluster_ppi_paired_difference,
    paired_cluster_bootstrap,
)

NS = range(1, 201)
B = 40  # bootstrap draws: containment is about the construction, not the precision


def _xs(n: int) -> list[int]:
    return sorted({0, 1, n // 2, n - 1, n} & set(range(n + 1)))


@pytest.mark.parametrize("interval", [wilson, clopper_pearson], ids=["wilson", "clopper_pearson"])
def test_exact_intervals_contain_the_estimate_and_are_exact_at_the_edges(interval):
    bad = []
    for n in NS:
        for x in range(n + 1):
            lo, hi = interval(x, n)
            if not (0.0 <= lo <= x / n <= hi <= 1.0) or (x == 0 and lo != 0.0) or (x == n and hi != 1.0):
                bad.append((x, n, lo, hi))
    assert not bad, f"{len(bad)} intervals miss their estimate or the edge, first {bad[:3]}"


def test_wilson_at_the_reported_cases():
    """0/13 and 0/11 gave lower bounds of 1.4e-17 and 2.8e-17 (statsmodels), 13/13 an upper bound 1 - 1e-16."""
    assert wilson(0, 13)[0] == 0.0 and wilson(0, 11)[0] == 0.0 and wilson(13, 13)[1] == 1.0
    assert wilson(0, 13)[1] == pytest.approx(0.2281, abs=1e-4)
    assert Rate(0, 13).ci[0] == 0.0 and Rate(11, 11).ci[1] == 1.0  # every report's rate cell uses wilson


def _values(x: int, n: int) -> np.ndarray:
    """x ones among n turns, spread over items (so clusters are mixed, not all-equal)."""
    v = np.zeros(n)
    v[np.linspace(0, n - 1, x).round().astype(int) if x else []] = 1.0
    if v.sum() < x:  # rounding put two ones on one index: fill from the end
        v[np.flatnonzero(v == 0)[-(x - int(v.sum())):]] = 1.0
    return v


def _items(n: int, size: int = 3) -> list[str]:
    return [f"i{i // size}" for i in range(n)]


def _contains(point: float, lo: float, hi: float) -> bool:
    return any(math.isnan(v) for v in (point, lo, hi)) or lo <= point <= hi


def _check(f):
    bad = []
    for n in NS:
        for x in _xs(n):
            point, lo, hi = f(x, n)
            if not _contains(point, lo, hi):
                bad.append((x, n, point, lo, hi))
    assert not bad, f"{len(bad)} intervals exclude their estimate, first {bad[:3]}"


def test_cluster_bootstrap_rate():
    def f(x, n):
        e = cluster_bootstrap_rate(_values(x, n), _items(n), n_boot=B)
        assert e.point == pytest.approx(x / n)
        return e.point, e.lo, e.hi
    _check(f)


def _per_item(v: np.ndarray, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for val, item in zip(v, _items(n)):
        out.setdefault(item, []).append(float(val))
    return out


def test_paired_cluster_bootstrap():
    def f(x, n):
        a, b = _per_item(_values(x, n), n), _per_item(_values(x, n)[::-1], n)
        e = paired_cluster_bootstrap(a, b, n_boot=B)
        return e.point, e.lo, e.hi
    _check(f)


def _lists(a: dict, b: dict) -> tuple[list[int], ...]:
    keys = sorted(a)
    return [a[k][0] for k in keys], [a[k][1] for k in keys], [b[k][0] for k in keys], [b[k][1] for k in keys]


def test_paired_bootstrap_and_paired_rates():
    def f(x, n):
        a = {k: (int(sum(v)), len(v)) for k, v in _per_item(_values(x, n), n).items()}
        b = {k: (int(sum(v)), len(v)) for k, v in _per_item(_values(n - x, n), n).items()}
        r = paired_rates(a, b, n_boot=B)  # paired_bootstrap on the items in sorted order
        assert r.as_tuple()[:3] == paired_bootstrap(*_lists(a, b), n_boot=B)[:3]
        return r.diff, r.lo, r.hi
    _check(f)


def test_bootstrap_diff():
    def f(x, n):
        a = [(int(sum(v)), len(v)) for v in _per_item(_values(x, n), n).values()]
        b = [(int(sum(v)), len(v)) for v in _per_item(_values(n // 2, n), n).values()]
        return bootstrap_diff(a, b, n_boot=B)
    _check(f)


def _judge(v: np.ndarray) -> np.ndarray:
    """A judge that gets every fourth turn wrong."""
    j = v.copy()
    j[::4] = 1.0 - j[::4]
    return j


def test_cluster_bootstrap_ppi():
    def f(x, n):
        v, items = _values(x, n), _items(n)
        aud = np.arange(n) % 2 == 0  # every other turn audited
        e = cluster_bootstrap_ppi(v[aud], _judge(v)[aud], [i for i, a in zip(items, aud) if a], _judge(v)[~aud],
                                  [i for i, a in zip(items, aud) if not a], n_boot=B)
        assert 0.0 <= e.lo <= e.hi <= 1.0
        return e.point, e.lo, e.hi
    _check(f)


def test_cluster_ppi_paired_difference():
    def f(x, n):
        va, vb = _values(x, n), _values(n - x, n)
        ja, jb, ta, tb = (_per_item(v, n) for v in (_judge(va), _judge(vb), va, vb))
        aa = {k: [(ta[k][0], ja[k][0])] for k in ja}  # each item's first turn audited
        ab = {k: [(tb[k][0], jb[k][0])] for k in jb}
        e = cluster_ppi_paired_difference(ja, jb, aa, ab, n_boot=B)
        assert math.isnan(e.lo) or -1.0 <= e.lo <= e.hi <= 1.0
        return e.point, e.lo, e.hi
    _check(f)


def test_ppi_difference_outside_the_range_is_clipped_with_its_bounds():
    """A PPI difference of 2 (judge says 0 everywhere under a, audit says 1) once came back as point 1.0 with
    the interval [2.0, 1.0]: the point and the outer bounds were clipped, the inner bound was not."""
    e = cluster_ppi_paired_difference({"i": [0.0]}, {"i": [1.0]}, {"i": [(0.0, 1.0)]}, {"i": [(1.0, 0.0)]}, n_boot=B)
    assert (e.point, e.lo, e.hi) == (1.0, 1.0, 1.0)


def test_tvd_bootstrap_is_the_documented_exception():
    """The TVD of resampled distributions is biased upward (a distance is never negative), so at identical
    distributions the percentile interval lies above its estimate 0; the docstring says so and how to read it."""
    classes = list("abcde")
    a = {str(i): [classes[i % 5]] for i in range(200)}
    d, lo, hi = tvd_bootstrap(a, dict(a), classes, n_boot=500)
    assert d == 0.0 and lo > d
    assert "exclude" in (tvd_bootstrap.__doc__ or "")
