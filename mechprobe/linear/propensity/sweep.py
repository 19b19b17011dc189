"""The layer sweep: ridge and logistic probes at every residual index, with the nested layer choice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from mechprobe.linear.fit import Folds, Metric, random_direction_band, to_jsonable
from mechprobe.linear.propensity.fit import (
    InsufficientItems,
    _logreg_ok,
    make_item_folds,
    oof_logreg,
    oof_ridge,
)
from mechprobe.linear.propensity.statistics import auroc_metric, bootstrap_indices, rho_metric
from mechprobe.linear.propensity.targets import ItemTargets, above_median


@dataclass
class PropensityLayer:
    """One residual index: ridge rho, logistic AUROCs, controls at this layer, and what each fold chose."""

    layer: int
    rho: Metric
    above_median_auroc: Metric | None
    greedy_auroc: Metric | None = None
    shuffled_rho: Metric | None = None
    random_dir_rho: Metric | None = None  # mean and 2.5/97.5% over directions, not a bootstrap
    fold_alpha: list[float] = field(default_factory=list)
    fold_inner_rho: list[float] = field(default_factory=list)


@dataclass
class PropensityReport:
    """What :func:`propensity_sweep_layers` measured. ``scores`` (out of fold, per layer) is not serialised."""

    layers: list[int]
    per_layer: list[PropensityLayer]
    best_layer: int  # argmax of the curve: optimistic; ``nested`` is the headline
    nested: dict[str, Any]
    counts: dict[str, Any]
    folds: Folds = field(repr=False, default_factory=list)
    scores: dict[int, np.ndarray] = field(repr=False, default_factory=dict)
    nested_scores: np.ndarray | None = field(repr=False, default=None)  # out of fold, the nested layer's

    def layer(self, layer: int) -> PropensityLayer:
        return self.per_layer[self.layers.index(layer)]

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "best_layer": self.best_layer, "nested": to_jsonable(self.nested),
                "per_layer": to_jsonable(self.per_layer), "counts": self.counts}


def propensity_sweep_layers(stack: np.ndarray, layers: Sequence[int], targets: ItemTargets,
                            folds: Folds | None = None, n_splits: int = 5, seed: int = 0, n_boot: int = 1000,
                            shuffled: bool = True, n_random: int = 200, progress: bool = True) -> PropensityReport:
    """Ridge (propensity) and logistic (above median; greedy label) probes at every layer, one row per item.

    ``stack`` is ``[n_items, len(layers), d]`` aligned with ``targets``. Folds default to item folds
    stratified by dataset and above-median class. Nested layer choice: each outer fold picks the layer
    (never residual 0, the embedding control) with the best inner-CV Spearman on its training items, and
    its test items are scored at that layer; the same for the above-median AUROC with inner-CV AUROC.
    """
    y = np.asarray(targets.propensity, float)
    n = len(y)
    if stack.ndim != 3 or stack.shape[0] != n or stack.shape[1] != len(layers):
        raise ValueError(f"stack has shape {stack.shape}; expected [n_items={n}, n_layers={len(layers)}, d]")
    if np.ptp(y) == 0:
        raise InsufficientItems(f"every one of the {n} items has propensity {y[0]:g}: nothing to rank. Probe "
                                "more items or samples, or another temperature")
    ybin = above_median(y)
    if folds is None:
        strata = [f"{d}|{b}" for d, b in zip(targets.datasets, ybin)]
        folds = make_item_folds(strata, n_splits, seed)
    idx = bootstrap_indices(n, n_boot, seed)
    gmask = np.isfinite(targets.greedy)
    yg = np.nan_to_num(targets.greedy).astype(int)
    can_greedy = _logreg_ok(yg[gmask])
    g_idx = bootstrap_indices(int(gmask.sum()), n_boot, seed) if can_greedy else None
    # A permutation of whole items (one row each): keeps the distribution, destroys the state-target link.
    y_sh = y[np.random.default_rng([seed, 0x5A1F]).permutation(n)] if shuffled else None
    per: list[PropensityLayer] = []
    scores: dict[int, np.ndarray] = {}
    bin_scores: dict[int, np.ndarray] = {}
    inner_rho = np.zeros((len(layers), len(folds)))
    inner_auc = np.zeros((len(layers), len(folds)))
    for li, layer in enumerate(tqdm(layers, desc="propensity probes", disable=not progress, unit="layer")):
        x = stack[:, li].astype(np.float64)
        s, alphas, inner = oof_ridge(x, y, folds, seed)
        sb, inner_b = oof_logreg(x, ybin, folds, seed)
        inner_rho[li], inner_auc[li] = inner, inner_b
        scores[layer], bin_scores[layer] = s, sb
        res = PropensityLayer(layer, rho_metric(y, s, idx), auroc_metric(ybin, sb, idx),
                              fold_alpha=alphas, fold_inner_rho=[round(v, 4) for v in inner])
        if can_greedy and g_idx is not None:
            gi = np.flatnonzero(gmask)
            gfolds = _restrict_folds(folds, gi)
            sg, _ = oof_logreg(x[gi], yg[gi], gfolds, seed)
            res.greedy_auroc = auroc_metric(yg[gi], sg, g_idx)
        if y_sh is not None:
            res.shuffled_rho = rho_metric(y_sh, oof_ridge(x, y_sh, folds, seed)[0], idx)
        if n_random:
            res.random_dir_rho = random_direction_band(x, y, folds, n_random, seed, score="spearman")
        per.append(res)
    cand = [i for i, la in enumerate(layers) if la != 0] or list(range(len(layers)))
    pick = [cand[j] for j in inner_rho[cand].argmax(0)]
    pick_b = [cand[j] for j in inner_auc[cand].argmax(0)]
    s_n, sb_n = np.zeros(n), np.zeros(n)
    for k, (_, te) in enumerate(folds):
        s_n[te] = scores[layers[pick[k]]][te]
        sb_n[te] = bin_scores[layers[pick_b[k]]][te]
    nested = {"rho": rho_metric(y, s_n, idx), "above_median_auroc": auroc_metric(ybin, sb_n, idx),
              "fold_layers": [int(layers[p]) for p in pick], "fold_layers_auroc": [int(layers[p]) for p in pick_b],
              "candidates": [int(layers[i]) for i in cand]}
    best = max(per, key=lambda r: r.rho.value if np.isfinite(r.rho.value) else -2).layer
    counts = {"items": n, "folds": len(folds), "above_median_items": int(ybin.sum()),
              "median_propensity": float(np.median(y)), "greedy_items": int(gmask.sum()),
              "greedy_genuine_items": int(yg[gmask].sum()), "greedy_probe": bool(can_greedy),
              "fold_test_items": [len(te) for _, te in folds]}
    return PropensityReport(list(layers), per, best, nested, counts, folds, scores, s_n)


def _restrict_folds(folds: Folds, keep: np.ndarray) -> Folds:
    """The same item folds, restricted to rows ``keep`` and re-indexed into them."""
    pos = {int(i): j for j, i in enumerate(keep)}
    return [(np.array([pos[i] for i in tr if i in pos], int), np.array([pos[i] for i in te if i in pos], int))
            for tr, te in folds]
