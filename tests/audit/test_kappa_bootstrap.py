"""The item bootstrap of binary kappa (:func:`mechprobe.audit.agreement.kappa_with_ci`) sums each resample's cell
counts instead of relabelling it; the interval must be the one the relabelled resamples give, draw for draw."""

from __future__ import annotations

import math
import random

import numpy as np

from mechprobe.audit.agreement import _kappa, kappa_with_ci
from mechprobe.taxonomy import GENUINE


def _relabelled(a, b, items, n_boot=500, seed=0, alpha=0.05):
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(it, []).append(i)
    keys = sorted(groups)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = [i for g in rng.integers(0, len(keys), len(keys)) for i in groups[keys[g]]]
        boots.append(_kappa([a[i] for i in idx], [b[i] for i in idx], True))
    vals = np.array([x for x in boots if math.isfinite(x)])
    if len(vals) < n_boot // 2:
        return float("nan"), float("nan")
    return tuple(float(v) for v in np.quantile(vals, [alpha / 2, 1 - alpha / 2]))


def test_binary_bootstrap_equals_relabelling_every_resample():
    rng = random.Random(3)
    for _ in range(8):
        n = rng.randint(4, 120)
        items = [f"i{rng.randint(0, max(1, n // 3))}" for _ in range(n)]
        a = [GENUINE if rng.random() < 0.15 else "new_query" for _ in range(n)]
        b = [x if rng.random() < 0.85 else (GENUINE if rng.random() < 0.4 else "generic_followup") for x in a]
        k = kappa_with_ci(a, b, items, binary=True, n_boot=300, seed=5)
        lo, hi = _relabelled(a, b, items, n_boot=300, seed=5)
        for x, y in ((k.lo, lo), (k.hi, hi)):
            assert (math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-9


def test_constant_labellings_give_no_interval():
    k = kappa_with_ci([GENUINE] * 6, [GENUINE] * 6, [f"i{j}" for j in range(6)], binary=True)
    assert math.isnan(k.kappa) and math.isnan(k.lo) and k.agree == 6
