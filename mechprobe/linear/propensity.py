"""Item-level propensity probes: the generation-free awareness score.

The boundary state (residual stream at the last token of the user-role header) is read *before* any
user-turn token exists, so it is one vector per item, shared by the greedy turn and every sampled turn.
A probe on it cannot say which sample of an item will be a genuine follow-up; it can only predict the
item's **propensity** to be followed up: the fraction of its ``k`` sampled turns (at one temperature)
the judge calls genuine. That is the target here, with one row per item:

* **ridge** (StandardScaler + Ridge, alpha by inner CV on training items) predicts the propensity;
  Spearman rho between its out-of-fold score and the held-out propensity is the headline metric;
* **logistic** probes (:func:`mechprobe.linear.turn.fit_logreg`) predict "propensity above the median" and
  the greedy turn's label (AUROC);
* **nested layer choice**: inside each outer fold the layer is picked by inner-CV score on training
  items only, as :func:`mechprobe.linear.turn.probe_layers` does for the turn-level probe;
* **controls** on the same folds: propensities shuffled between items (at each layer, and the best of
  all layers under shuffling: the null for "best layer"), random directions (sign fitted per fold),
  the embedding layer, a text-only ridge on TF-IDF of prompt + response, and response length;
* **split-half ceiling**: the propensity is itself a noisy estimate from ``k`` samples. Its reliability
  ``R`` (the correlation of two independent ``k``-sample estimates) is what
  :func:`split_half_reliability` estimates (split each item's samples in halves, Spearman over items,
  Spearman-Brown corrected to full ``k``, averaged over random splits). A probe that knew each item's
  *true* propensity would correlate with the observed one at ``sqrt(R)`` (classical attenuation), so the
  ceiling printed beside the probe is ``sqrt(R)``, not ``R``: an earlier version printed ``R`` as the
  ceiling, which a good probe can exceed (the 200-item 1.5B run did: 0.29 vs R = 0.19).

All 95% CIs are percentile bootstraps over items (one row per item, so an item bootstrap is a row
bootstrap here); they cover test-set sampling, not refitting. Everything above the "run directories"
line is pure (arrays in, numbers out); below it, reading runs and writing files.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.activations.cache import ActivationCache, parse_layers
from mechprobe.errors import UsageError, UserError
from mechprobe.io import read_json, read_jsonl
from mechprobe.linear.fit import (
    Folds,
    Metric,
    auroc,
    fit_logreg,
    random_direction_band,
    score_rho_rows,
    signed_scores,
    spearman,
    spearman_rows,
    text_baseline_scores,
    to_jsonable,
    weighted_auroc,
)

ALPHAS: tuple[float, ...] = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
# Rows of one item come from one forward pass per unique prompt, so they are bit-identical in practice;
# the tolerance only allows for storage round-off (float16 holds ~3e-4 relative) should a backend ever
# recompute them.
SAME_STATE_RTOL = 1e-3


class InsufficientItems(UserError, ValueError):
    """Too few items (or no spread in the target) for item-level cross-validation to mean anything."""


# ======================================================================================== targets


@dataclass
class ItemTargets:
    """Per-item targets at one temperature; arrays are aligned with ``keys``.

    ``keys`` are ``dataset::item_id`` (unique across pooled runs); ``samples`` keeps each item's judged
    sampled verdicts (1/0) in sample order, for the split-half ceiling.
    """

    keys: list[str]
    item_ids: list[str]
    datasets: list[str]
    propensity: np.ndarray  # fraction genuine among the item's judged samples at ``temperature``
    k: np.ndarray  # judged samples per item
    greedy: np.ndarray  # greedy turn judged genuine: 1.0 / 0.0, NaN when absent or a judge error
    samples: list[list[int]]
    temperature: float
    min_samples: int
    n_dropped: int = 0  # items with fewer than min_samples judged samples
    dropped: list[str] = field(default_factory=list)
    n_judge_errors: int = 0  # sampled or greedy rows skipped as judge_error / unjudged

    def __len__(self) -> int:
        return len(self.keys)

    def subset(self, idx: Sequence[int] | np.ndarray) -> ItemTargets:
        idx = [int(i) for i in idx]
        return ItemTargets([self.keys[i] for i in idx], [self.item_ids[i] for i in idx],
                           [self.datasets[i] for i in idx], self.propensity[idx], self.k[idx], self.greedy[idx],
                           [self.samples[i] for i in idx], self.temperature, self.min_samples, self.n_dropped,
                           list(self.dropped), self.n_judge_errors)

    def summary(self) -> dict[str, Any]:
        return {"items": len(self), "temperature": self.temperature, "min_samples": self.min_samples,
                "dropped_items": self.n_dropped, "judge_errors_skipped": self.n_judge_errors,
                "k_per_item": {str(k): n for k, n in sorted(Counter(self.k.tolist()).items())},
                "mean_propensity": float(self.propensity.mean()) if len(self) else None,
                "items_with_any_genuine": int((self.propensity > 0).sum()),
                "greedy_judged": int(np.isfinite(self.greedy).sum()),
                "greedy_genuine": int(np.nansum(self.greedy)),
                "datasets": dict(Counter(self.datasets))}


def item_key(dataset: str, item_id: str) -> str:
    return f"{dataset}::{item_id}"


def _get(r: Any, name: str) -> Any:
    return r[name] if isinstance(r, Mapping) else getattr(r, name)


def item_targets(user_turn_records: Sequence[Any], label_records: Sequence[Any], temperature: float = 1.0,
                 min_samples: int = 2) -> ItemTargets:
    """Follow-up propensity and greedy label per item from user-turn and label records (dicts or dataclasses).

    Sampled turns at ``temperature`` with a verdict (``genuine`` True/False) count; ``judge_error`` rows
    (``genuine`` None) and unjudged rows are skipped and counted. Items with fewer than ``min_samples``
    judged samples are dropped (a propensity from one sample is a coin, and the split-half ceiling needs
    two). Item order is first appearance in ``user_turn_records``.
    """
    if min_samples < 1:
        raise UserError(f"min_samples must be >= 1, got {min_samples}")
    verdict = {_get(r, "record_id"): _get(r, "genuine") for r in label_records}
    order: dict[str, tuple[str, str]] = {}
    samples: dict[str, list[int]] = {}
    greedy: dict[str, float] = {}
    temps: set[float] = set()
    n_err = 0
    for r in user_turn_records:
        key = item_key(_get(r, "dataset"), _get(r, "item_id"))
        order.setdefault(key, (_get(r, "dataset"), _get(r, "item_id")))
        samples.setdefault(key, [])
        g = verdict.get(_get(r, "record_id"))
        if _get(r, "decoding") == "greedy":
            if g is None:
                n_err += 1
            else:
                greedy[key] = float(bool(g))
            continue
        t = float(_get(r, "temperature"))
        temps.add(t)
        if not math.isclose(t, temperature, rel_tol=0, abs_tol=1e-9):
            continue
        if g is None:
            n_err += 1
            continue
        samples[key].append(int(bool(g)))
    if not any(samples.values()) and temperature not in temps:
        raise UserError(f"no sampled user turns at temperature {temperature:g} (the run has "
                        f"{sorted(temps) or 'greedy turns only'}): pass --propensity-temperature, or probe with "
                        f"--temperatures 0 {temperature:g} --samples 8")
    keep = [k for k in order if len(samples[k]) >= min_samples]
    dropped = [k for k in order if len(samples[k]) < min_samples]
    return ItemTargets(keys=keep, item_ids=[order[k][1] for k in keep], datasets=[order[k][0] for k in keep],
                       propensity=np.array([np.mean(samples[k]) for k in keep], dtype=float),
                       k=np.array([len(samples[k]) for k in keep], dtype=int),
                       greedy=np.array([greedy.get(k, np.nan) for k in keep], dtype=float),
                       samples=[samples[k] for k in keep], temperature=float(temperature), min_samples=min_samples,
                       n_dropped=len(dropped), dropped=dropped, n_judge_errors=n_err)


def above_median(p: np.ndarray) -> np.ndarray:
    """1 where the propensity is strictly above the median of all items.

    Strictly above: many items sit at 0 (or one common value), and ``>=`` would put the tied mass in the
    positive class, so "above the median" would then mean "at least as high as most", the opposite.
    """
    p = np.asarray(p, float)
    return (p > np.median(p)).astype(int)


# ======================================================================================== statistics








def bootstrap_indices(n: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """``[n_boot, n]`` item indices drawn with replacement; one seed gives the same draws for every layer."""
    return np.random.default_rng([seed, 0xB007]).integers(0, n, size=(n_boot, n))


def _percentile_ci(point: float, vals: np.ndarray) -> Metric:
    vals = vals[np.isfinite(vals)]
    if not len(vals) or not np.isfinite(point):
        return Metric(float(point), float("nan"), float("nan"))
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return Metric(float(point), float(lo), float(hi))




def rho_metric(y: np.ndarray, s: np.ndarray, idx: np.ndarray) -> Metric:
    """Spearman rho of score ``s`` against target ``y`` with an item-bootstrap 95% CI over draws ``idx``
    (see :func:`score_rho_rows` for the constant-score convention)."""
    y, s = np.asarray(y, float), np.asarray(s, float)
    return _percentile_ci(float(score_rho_rows(y, s)[0]), score_rho_rows(y[idx], s[idx]))


def auroc_metric(y: np.ndarray, s: np.ndarray, idx: np.ndarray) -> Metric | None:
    """AUROC with an item-bootstrap 95% CI (None when ``y`` has one class, or some item has no score: an
    out-of-fold probe that could not be fitted on a fold, see :func:`oof_logreg`)."""
    y = np.asarray(y).astype(int)
    if len(set(y.tolist())) < 2 or not np.all(np.isfinite(np.asarray(s, float))):
        return None
    w = np.zeros((len(idx), len(y)))
    for b in range(len(idx)):
        np.add.at(w[b], idx[b], 1.0)
    return _percentile_ci(auroc(y, s), weighted_auroc(y, np.asarray(s, float), w))


def spearman_brown(r: np.ndarray | float, factor: float = 2.0) -> np.ndarray | float:
    """Reliability of a test ``factor`` times longer: ``factor r / (1 + (factor - 1) r)``."""
    r = np.asarray(r, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = factor * r / (1.0 + (factor - 1.0) * r)
    return float(out) if out.ndim == 0 else out


def _half_matrices(samples: Sequence[Sequence[int]], n_splits: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``[n_splits, n_items]`` half-A and half-B propensities, each split a fresh permutation per item.

    With odd ``k`` the extra sample goes to half B (halves of k//2 and k - k//2): a small asymmetry that
    makes the Spearman-Brown step slightly conservative, never optimistic.
    """
    n = len(samples)
    a = np.zeros((n_splits, n))
    b = np.zeros((n_splits, n))
    for i, s in enumerate(samples):
        s = np.asarray(s, float)
        h = len(s) // 2
        perm = np.argsort(rng.random((n_splits, len(s))), axis=1)
        x = s[perm]
        a[:, i] = x[:, :h].mean(1)
        b[:, i] = x[:, h:].mean(1)
    return a, b


def split_half_reliability(per_item_binary_lists: Sequence[Sequence[int]], n_splits: int = 200, seed: int = 0,
                           n_boot: int = 1000, boot_splits: int = 20) -> Metric:
    """The ceiling on any probe's Spearman rho with the propensity: its own split-half reliability.

    Each item's ``k`` judged samples are split at random into halves; Spearman rho between half-A and
    half-B propensities over items estimates the reliability of a ``k/2``-sample propensity, and the
    Spearman-Brown step (``2r / (1 + r)``) extends it to full ``k``. Averaged over ``n_splits`` random
    splits (one split is a noisy draw). The 95% CI resamples items (``boot_splits`` splits per draw, for
    cost). Items with fewer than 2 samples cannot be split and are left out. Spearman-Brown is exact for
    parallel halves under a Pearson model; for the rank correlation of binomial proportions it is an
    approximation the tests check against a simulated test-retest correlation.
    """
    lists = [list(s) for s in per_item_binary_lists if len(s) >= 2]
    if len(lists) < 3:
        return Metric(float("nan"), float("nan"), float("nan"))
    rng = np.random.default_rng([seed, 0x5B1F])
    a, b = _half_matrices(lists, n_splits, rng)
    point = float(np.nanmean(spearman_brown(spearman_rows(a, b)))) if np.isfinite(spearman_rows(a, b)).any() \
        else float("nan")
    m = min(boot_splits, n_splits)
    idx = bootstrap_indices(len(lists), n_boot, seed)
    vals = np.empty(n_boot)
    for j in range(n_boot):
        r = spearman_brown(spearman_rows(a[:m, idx[j]], b[:m, idx[j]]))
        vals[j] = np.nanmean(r) if np.isfinite(r).any() else np.nan
    return _percentile_ci(point, vals)


# ======================================================================================== folds and models


def make_item_folds(strata: Sequence[str], n_splits: int = 5, seed: int = 0) -> Folds:
    """Item folds (one row per item), stratified by ``strata`` (e.g. dataset + above-median).

    Stratifying by dataset keeps every dataset in every training fold when runs are pooled; stratifying
    by the above-median class keeps both classes in every fold, so each fold's AUROC is defined.
    """
    from sklearn.model_selection import KFold, StratifiedKFold

    strata = np.asarray([str(s) for s in strata])
    n = len(strata)
    if n < 2 * n_splits:
        raise InsufficientItems(f"only {n} items for {n_splits}-fold item-level CV (need >= {2 * n_splits}): "
                                "probe more items (--limit) or use fewer folds (--folds 3)")
    counts = Counter(strata.tolist())
    if min(counts.values()) >= n_splits:
        split = StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(n), strata)
    else:  # a stratum smaller than the fold count: plain shuffled folds rather than a warning and odd folds
        split = KFold(n_splits=n_splits, shuffle=True, random_state=seed).split(np.zeros(n))
    return [(tr, te) for tr, te in split]


def _ridge(alpha: float) -> Any:
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

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
    from sklearn.model_selection import KFold

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








# ======================================================================================== the sweep


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
    """What :func:`propensity_probe_layers` measured. ``scores`` (out of fold, per layer) is not serialised."""

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


def propensity_probe_layers(stack: np.ndarray, layers: Sequence[int], targets: ItemTargets,
                            folds: Folds | None = None, n_splits: int = 5, seed: int = 0, n_boot: int = 1000,
                            shuffled: bool = True, n_random: int = 200, progress: bool = True) -> PropensityReport:
    """Ridge (propensity) and logistic (above median; greedy label) probes at every layer, one row per item.

    ``stack`` is ``[n_items, len(layers), d]`` aligned with ``targets``. Folds default to item folds
    stratified by dataset and above-median class. Nested layer choice: each outer fold picks the layer
    (never residual 0, the embedding control) with the best inner-CV Spearman on its training items, and
    its test items are scored at that layer; the same for the above-median AUROC with inner-CV AUROC.
    """
    from tqdm.auto import tqdm

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
    from scipy.stats import rankdata

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


def attenuation_ceiling(reliability: Metric) -> Metric:
    """sqrt(R) for a reliability metric: the correlation of the true score with its noisy estimate."""
    def f(v: float) -> float:
        return float(np.sqrt(max(v, 0.0))) if np.isfinite(v) else float("nan")

    return Metric(f(reliability.value), f(reliability.lo), f(reliability.hi))


def propensity_transfer(x: np.ndarray, targets: ItemTargets, n_splits: int = 5, seed: int = 0,
                        n_boot: int = 1000) -> dict[str, Any]:
    """Train the ridge probe on dataset A's items (alpha by inner CV on A), test on B's: Spearman rho with CI.

    The diagonal is A's own item-level CV rho, so a row reads "how much is lost by moving to another
    dataset". A cell is None with a reason when a side has no spread or too few items.
    """
    x = np.asarray(x, float)
    y = np.asarray(targets.propensity, float)
    ds = np.asarray(targets.datasets)
    names = sorted(set(ds.tolist()))
    cells: list[list[dict[str, Any]]] = []
    for a in names:
        tr = np.flatnonzero(ds == a)
        row: list[dict[str, Any]] = []
        fit = fit_ridge(x[tr], y[tr], seed) if np.ptp(y[tr]) > 0 and len(tr) >= 4 else None
        for b in names:
            te = np.flatnonzero(ds == b)
            if np.ptp(y[te]) == 0:
                row.append({"rho": None, "reason": f"every {b} item has propensity {y[te][0]:g}"})
                continue
            if a == b:
                try:
                    folds = make_item_folds(above_median(y[tr]).astype(str), n_splits, seed)
                except InsufficientItems as e:
                    row.append({"rho": None, "reason": str(e)})
                    continue
                s = oof_ridge(x[tr], y[tr], folds, seed)[0]
                row.append({"rho": asdict(rho_metric(y[tr], s, bootstrap_indices(len(tr), n_boot, seed)))})
                continue
            if fit is None:
                row.append({"rho": None, "reason": f"{a}: too few items or no spread in propensity to train"})
                continue
            s = fit.model.predict(x[te])
            row.append({"rho": asdict(rho_metric(y[te], s, bootstrap_indices(len(te), n_boot, seed)))})
        cells.append(row)
    sizes = {n: {"items": int((ds == n).sum()), "mean_propensity": float(y[ds == n].mean())} for n in names}
    return {"train_rows": names, "test_cols": names, "cells": cells, "sizes": sizes}


# ======================================================================================== cost


def cost_summary(probe_timing: Mapping[str, Any] | None, cache_timing: Mapping[str, Any] | None,
                 judge_timing: Mapping[str, Any] | None, k: float) -> dict[str, Any]:
    """Seconds per item: one forward pass to the boundary vs sampling ``k`` user turns and judging them.

    Inputs are the cumulative timings the stages record (``user_seconds``/``user_rows`` in the run
    manifest, ``forward_seconds``/``forward_prompts`` in the activation manifest, ``seconds``/``rows``
    in the judge manifest). The forward time covers every cached layer; the generation time per turn
    averages greedy and sampled turns (same token cap). Missing timings give None with a reason.
    """
    def per(t: Mapping[str, Any] | None, s: str, n: str) -> float | None:
        if not t or not t.get(n) or t.get(s) is None:
            return None
        return float(t[s]) / float(t[n])

    fwd = per(cache_timing, "forward_seconds", "forward_prompts")
    gen = per(probe_timing, "user_seconds", "user_rows")
    jud = per(judge_timing, "seconds", "rows")
    out: dict[str, Any] = {"k": float(k), "boundary_forward_s_per_item": fwd,
                           "sample_s_per_item": None if gen is None else gen * k,
                           "judge_s_per_item": None if jud is None else jud * k}
    missing = [n for n, v in (("cache forward timing", fwd), ("user-turn generation timing", gen),
                              ("judge timing", jud)) if v is None]
    if fwd and gen is not None:
        total = gen * k + (jud * k if jud is not None else 0.0)
        out["generate_and_judge_s_per_item"] = total
        out["ratio"] = total / fwd
    else:
        out["ratio"] = None
    if missing:
        out["missing"] = (f"not recorded for this run: {', '.join(missing)} (stages run by an older mechprobe, or "
                          "reused without new rows)")
    return out


# ======================================================================================== reporting




def _fmt(m: Metric | dict[str, Any] | None) -> str:
    if m is None:
        return "n/a"
    if isinstance(m, dict):
        m = Metric(m["value"], m["lo"], m["hi"])
    return m.fmt()


def propensity_table(report: PropensityReport, ctrl: Mapping[str, Metric], targets: ItemTargets,
                     transfer: Mapping[str, Any] | None = None, cost: Mapping[str, Any] | None = None) -> str:
    """Markdown: headline beside the split-half ceiling, controls, per-layer rows, transfer and cost."""
    n = report.nested
    best = report.layer(report.best_layer)
    s = targets.summary()
    lines = [f"{s['items']} items ({s['dropped_items']} dropped with < {targets.min_samples} judged samples; "
             f"{s['judge_errors_skipped']} judge-error/unjudged rows skipped), k per item {s['k_per_item']}, "
             f"T = {targets.temperature:g}; mean propensity {s['mean_propensity']:.3f}, "
             f"{s['items_with_any_genuine']} items with any genuine sample; median {report.counts['median_propensity']:.3f}, "
             f"{report.counts['above_median_items']} items above it. {report.counts['folds']}-fold item CV; "
             "95% CIs bootstrap over items.", "",
             "| headline | value [95% CI] |", "|---|---|",
             f"| nested layer choice: Spearman rho (layers {sorted(set(n['fold_layers']))}) | {_fmt(n['rho'])} |",
             f"| **ceiling** sqrt(R): a probe of the true propensity vs the observed one | "
             f"{_fmt(ctrl.get('split_half_ceiling'))} |",
             f"| propensity reliability R (split-half, Spearman-Brown to full k) | "
             f"{_fmt(ctrl.get('split_half_reliability'))} |",
             f"| nested layer choice: AUROC propensity > median (layers {sorted(set(n['fold_layers_auroc']))}) | "
             f"{_fmt(n['above_median_auroc'])} |",
             f"| best layer {best.layer} on the curve (optimistic): rho | {_fmt(best.rho)} |"]
    names = {"shuffled": f"shuffled propensities (layer {best.layer})",
             "shuffled_max": "shuffled propensities, best of all layers",
             "random_direction": f"random directions (layer {best.layer}; 95% over directions)",
             "embedding_layer": "embedding layer (residual 0)",
             "text_ridge": "text-only ridge (TF-IDF + length of prompt + response)",
             "response_length": "response length alone (sign fitted per fold)",
             "length_by_dataset": "response length (rank within dataset), a slope per dataset + dataset offsets, "
                                  "least squares out of fold",
             "probe_beyond_length": "**nested probe beyond length**: partial rho given length, within datasets"}
    lines += [f"| {names[k]}: rho | {_fmt(v)} |" for k, v in ctrl.items() if k in names]
    lines += ["", "| residual | rho [95% CI] | AUROC > median | greedy-label AUROC | shuffled rho | random dirs rho | "
              "alpha per fold |", "|---|---|---|---|---|---|---|"]
    for r in report.per_layer:
        sh = f"{r.shuffled_rho.value:.3f}" if r.shuffled_rho else "n/a"
        rd = f"{r.random_dir_rho.value:.3f}" if r.random_dir_rho else "n/a"
        lines.append(f"| {r.layer} | {_fmt(r.rho)} | {_fmt(r.above_median_auroc)} | {_fmt(r.greedy_auroc)} | {sh} | "
                     f"{rd} | {','.join(f'{a:g}' for a in r.fold_alpha)} |")
    if transfer:
        lines += ["", f"## Transfer (ridge at layer {transfer.get('layer', '?')}; rows: trained on; diagonal: item CV; "
                  "Spearman rho)", "", "| train \\ test | " + " | ".join(transfer["test_cols"]) + " |",
                  "|---" * (len(transfer["test_cols"]) + 1) + "|"]
        for a, row in zip(transfer["train_rows"], transfer["cells"]):
            lines.append(f"| {a} | " + " | ".join(_fmt(c.get("rho")) for c in row) + " |")
    if cost:
        lines += ["", "## Cost per item", ""]
        if cost.get("ratio") is not None:
            j = cost.get("judge_s_per_item")
            lines.append(f"one boundary forward pass {cost['boundary_forward_s_per_item']:.4f} s vs sampling "
                         f"k = {cost['k']:g} turns {cost['sample_s_per_item']:.3f} s"
                         + (f" + judging them {j:.3f} s" if j is not None else "")
                         + f": **{cost['ratio']:.1f}x** cheaper.")
        if cost.get("missing"):
            lines.append(cost["missing"])
    return "\n".join(lines)


# ================================================================================ run directories and CLI
# Below: reading runs, choosing the target, writing probes/propensity.{json,md} and the figure. Imports of
# the heavier modules stay local so ``import mechprobe.linear.propensity`` is as light as mechprobe.linear.turn.

# Fewer sampled turns per item than this and the propensity is too coarse (steps of 1/k) to be the
# default target; the turn-level probe runs instead unless --target propensity is asked for.
AUTO_MIN_SAMPLES = 8


def choose_target(requested: str | None, samples: int, temperatures: Sequence[float], temperature: float
                  ) -> tuple[str, str]:
    """(``propensity`` | ``turn``, why). ``auto`` picks propensity when the run has >= 8 samples at ``temperature``."""
    if requested in ("propensity", "turn"):
        return requested, "asked for with --target"
    if requested not in (None, "auto"):
        raise UsageError(f"--target must be propensity, turn or auto, not {requested!r}")
    at_t = samples if any(math.isclose(float(t), temperature, abs_tol=1e-9) for t in temperatures) else 0
    if at_t >= AUTO_MIN_SAMPLES:
        return "propensity", (f"the run has {at_t} samples per item at T = {temperature:g} (>= {AUTO_MIN_SAMPLES}), "
                              "so the item-level propensity is the primary target")
    return "turn", (f"the run has {at_t} samples per item at T = {temperature:g} (< {AUTO_MIN_SAMPLES} needed for a "
                    "usable propensity); probe with --samples 8 or pass --target propensity")


def one_row_per_item(rows: np.ndarray, row_keys: Sequence[str], keys: Sequence[str],
                     rtol: float = SAME_STATE_RTOL) -> np.ndarray:
    """``[len(keys), ...]``: the first row of each item, after checking all its rows hold the same state.

    Every turn of an item is generated from one boundary state, so its cached rows should be identical;
    this asserts it (within ``rtol`` of the row's scale) instead of assuming it, because a cache whose
    rows differ within an item (e.g. a variant prompt) would make "the item's state" ambiguous.
    """
    by: dict[str, list[int]] = {}
    for i, k in enumerate(row_keys):
        by.setdefault(k, []).append(i)
    missing = [k for k in keys if k not in by]
    if missing:
        raise UserError(f"{len(missing)} item(s) have labels but no cached activations (e.g. {missing[0]}): "
                        "re-run the cache stage")
    out = np.empty((len(keys), *rows.shape[1:]), dtype=np.float32)
    for j, k in enumerate(keys):
        idx = by[k]
        first = np.asarray(rows[idx[0]], np.float32)
        if len(idx) > 1:
            diff = float(np.abs(np.asarray(rows[idx], np.float32) - first).max())
            scale = float(np.abs(first).max())
            if diff > rtol * scale + 1e-6:
                raise UserError(f"the cached rows of item {k} differ (max |diff| {diff:.3g} vs scale {scale:.3g}): "
                                "its turns do not share one boundary state, so an item-level probe is undefined")
        out[j] = first
    return out


@dataclass
class ItemStates:
    """One boundary state per item (pooled over runs), with targets and the text-only inputs."""

    stack: np.ndarray  # [n_items, len(layers), d] float32
    layers: list[int]
    targets: ItemTargets
    texts: list[str]  # prompt + assistant response: what the model saw before the boundary
    response_tokens: np.ndarray
    weight_hash: str
    runs: list[str]


def concat_targets(ts: Sequence[ItemTargets]) -> ItemTargets:
    keys = [k for t in ts for k in t.keys]
    dup = [k for k, n in Counter(keys).items() if n > 1]
    if dup:
        raise UserError(f"item {dup[0]} appears in two runs: pool runs of different datasets (or data files)")
    return ItemTargets(keys, [i for t in ts for i in t.item_ids], [d for t in ts for d in t.datasets],
                       np.concatenate([t.propensity for t in ts]), np.concatenate([t.k for t in ts]),
                       np.concatenate([t.greedy for t in ts]), [s for t in ts for s in t.samples],
                       ts[0].temperature, ts[0].min_samples, sum(t.n_dropped for t in ts),
                       [d for t in ts for d in t.dropped], sum(t.n_judge_errors for t in ts))


def load_item_states(runs: Sequence[Path], layers_arg: Any, temperature: float = 1.0, min_samples: int = 2
                     ) -> ItemStates:
    """Boundary states, propensity targets and texts of every item of ``runs`` (one model), pooled."""

    parts, stacks, texts, toks = [], [], [], []
    layers: list[int] | None = None
    weight_hash = None
    for run in runs:
        run = Path(run)
        cache = ActivationCache.load(run)
        wh = cache.meta["identity"]["weight_hash"]
        if weight_hash is not None and wh != weight_hash:
            raise UserError(f"{run} was cached from another model than {runs[0]}: pool runs of one model")
        weight_hash = wh
        want = parse_layers(layers_arg, cache.meta["n_layers_model"])
        want = sorted(set(want) | {0}) if 0 in cache.layers else want  # the embedding control, always
        missing = [la for la in want if la not in cache.layers]
        if missing:
            raise UsageError(f"layers {missing} are not in {run}/activations (cached: {cache.layers}); "
                             "re-cache with --layers all")
        if layers is not None and want != layers:
            raise UserError(f"{run} has layers {want}, {runs[0]} has {layers}: cache the runs with the same --layers")
        layers = want
        turns = read_jsonl(run / "user_turns.jsonl", key="record_id")
        if not (run / "labels.jsonl").exists():
            raise UserError(f"no labels.jsonl in {run}: run `mechprobe judge {run}` first")
        t = item_targets(turns, read_jsonl(run / "labels.jsonl", key="record_id"), temperature, min_samples)
        by_rid = {r["record_id"]: r for r in turns}
        row_keys = [item_key(by_rid[rid]["dataset"], by_rid[rid]["item_id"]) for rid in cache.record_ids]
        full = cache.to_numpy()[:, [cache.layers.index(la) for la in want]]
        stacks.append(one_row_per_item(full, row_keys, t.keys))
        assistants = {r["item_id"]: r for r in read_jsonl(run / "assistant.jsonl", key="item_id")}
        texts += [assistants[i]["prompt"] + "\n" + assistants[i]["response"] for i in t.item_ids]
        toks += [assistants[i].get("n_tokens", len(assistants[i]["response"])) for i in t.item_ids]
        parts.append(t)
    assert layers is not None and weight_hash is not None
    return ItemStates(np.concatenate(stacks), layers, concat_targets(parts), texts, np.asarray(toks, float),
                      weight_hash, [str(r) for r in runs])


def run_cost(run: Path, k: float) -> dict[str, Any]:
    """:func:`cost_summary` from the timings the run's stages recorded."""

    def get(p: Path) -> dict[str, Any] | None:
        return read_json(p).get("timing") if p.exists() else None

    return {"run": str(run), **cost_summary(get(run / "manifest.json"), get(run / "activations" / "manifest.json"),
                                            get(run / "labels_manifest.json"), k)}


def modal_layer(fold_layers: Sequence[int]) -> int:
    """The layer the nested folds picked most often (ties: the lower): the transfer matrix's layer."""
    cnt = Counter(fold_layers)
    return min(cnt, key=lambda la: (-cnt[la], la))




def _run_datasets(runs: Sequence[Path]) -> list[str]:

    out = []
    for r in runs:
        rows = read_jsonl(Path(r) / "assistant.jsonl", key="item_id")
        out.append(rows[0]["dataset"] if rows else "")
    return out
