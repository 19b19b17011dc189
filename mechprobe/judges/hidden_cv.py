"""Fit the hidden-state judge's heads by item-grouped cross-validation over every blind-labelled item outside the
test sets (the ``pool`` protocol: ``hidden-v2``; from ``hidden-v3`` on with a threshold per subject model).

Why a second protocol: the ``split`` protocol (:mod:`mechprobe.judges.hidden_fit`) fits on the train items and
chooses on the dev items, and on the Qwen models those hold few strict positives (the 1.5B model's train items:
8; its dev items: 4), so a head is fit on a handful of positives and chosen on one or two. The older test items
have served as the test of the fits made before them (each fit's round in ``reports/judge/test_rounds.json``);
what tests a new fit is a set no fit reads: the sources marked ``fit=False`` in
:data:`mechprobe.audit.blind_sets.SOURCES` (a fresh test set pre-registered before its turns existed). So here
every other labelled turn is the pool: it is cut into ``folds`` folds by item (a label-blind hash), every
candidate (layer, training target, C) gets out-of-fold probabilities for every pool turn, each threshold is
scored by the mean over subject models of the out-of-fold kappa, and the winner is refit on the whole pool.

Threshold per subject model (from ``hidden-v3`` on): for each head's chosen (layer, target, C), each subject model
gets the threshold with its best out-of-fold kappa (:func:`per_subject_thresholds`); they are kept only if their mean beats
the single threshold's by :data:`PER_SUBJECT_MARGIN` (the maximum over thresholds per model is more optimistic than
one shared maximum). Why: the rate of genuine turns differs by subject model (2% of one model's turns, 12% of
another's) and so does the probability at which a head's verdicts best match the labels.

What the out-of-fold kappa is: an estimate made on the items that also chose the candidate, so it is optimistic
by the selection over candidates; the once-scored test is the fresh set's (``judges evaluate``'s table).

A fit under this protocol sees test-split items, so its verdicts are written only for turns outside its pool
(:func:`pool_turns`): its cells in the table are the fresh set's turns and nothing it was fit on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression
from tqdm.auto import tqdm

from mechprobe.audit.blind_sets import SOURCES, BlindSets, Source, consensus
from mechprobe.audit.readings import READINGS, STRICT
from mechprobe.errors import UsageError
from mechprobe.judges.hidden import HEADS, WEIGHTS_FORMAT, weights_digest
from mechprobe.judges.hidden_fit import C_GRID, THRESHOLDS

__all__ = ["VERSION", "FOLDS", "PER_SUBJECT_MARGIN", "per_subject_thresholds", "fold_of_item", "pool_turns", "held_out_sources", "fit_hidden_heads_cv"]

VERSION = "hidden-v8"  # the next fit's name: each pool fit has its plan, studies/judge/hidden_v<N>_fit.json
# (a name is never reused: hidden-v6 was fit and archived, hidden-v5 stayed; hidden-v7 replaced hidden-v5)
FOLDS = 5
PER_SUBJECT_MARGIN = 0.05  # per-model thresholds are kept only if they beat one threshold by this much out of fold


def fold_of_item(item: str, folds: int = FOLDS) -> int:
    """The cross-validation fold of an item key: a hash, label-blind and the same for every subject model.

    Example:
        >>> fold_of_item("0123456789abcdef") == fold_of_item("0123456789abcdef") < FOLDS
        True
    """
    return int(hashlib.sha256(f"hidden-cv|{item}".encode()).hexdigest()[:8], 16) % folds


def held_out_sources(sources: Sequence[Source] = SOURCES) -> frozenset[str]:
    """The names of the sources no fit may read (``fit=False``: the pre-registered fresh test sets)."""
    return frozenset(s.name for s in sources if not s.fit)


def pool_turns(blind: BlindSets, held_out: frozenset[str]) -> list[str]:
    """Turn ids a pool fit may read: every turn whose item no held-out source holds.

    Why by item, not by source: a query labelled in a held-out set and, under another id, in a pool set would
    otherwise reach the fit through the pool (the fresh plans exclude such items by query hash; this enforces it).
    """
    held_items = {t.item for t in blind.turns.values() if t.source in held_out}
    return sorted(t for t, x in blind.turns.items() if x.source not in held_out and x.item not in held_items)


def per_subject_thresholds(scored: dict[str, list[tuple[bool, float]]], thresholds: Sequence[float],
                           default: float) -> tuple[dict[str, float], dict[str, float]]:
    """Each subject model's best threshold by its own kappa, and that kappa.

    Args:
        scored: subject model -> (label, out-of-fold probability) per turn.
        thresholds: the candidates.
        default: the head's global threshold; a tie goes to the candidate nearest it.
    Returns:
        ``({model: threshold}, {model: kappa})`` for the models with a positive and a finite kappa.

    Example:
        >>> per_subject_thresholds({"m": [(True, 0.9), (False, 0.6), (False, 0.2)]}, [0.5, 0.7], 0.5)
        ({'m': 0.7}, {'m': 1.0})
    """
    out: dict[str, float] = {}
    kap: dict[str, float] = {}
    for m, rows in sorted(scored.items()):
        y = np.array([a for a, _ in rows], dtype=bool)
        p = np.array([b for _, b in rows], dtype=float)
        if not y.any():
            continue
        cands = [(_kappa(y, p >= thr), -abs(thr - default), thr) for thr in thresholds]
        cands = [c for c in cands if math.isfinite(c[0])]
        if cands:
            k, _, thr = max(cands)
            out[m], kap[m] = float(thr), float(k)
    return out, kap


def _scored_by_model(pool: list[str], blind: BlindSets, truth: dict[str, bool | None], oof: dict[str, float],
                     models: list[str]) -> dict[str, list[str]]:
    """Per subject model, the pool turns a head is scored on: a consensus under its reading and an out-of-fold
    probability (one rule for choosing the shared threshold and the per-model ones)."""
    return {m: [t for t in pool if blind.turns[t].model == m and truth[t] is not None and t in oof] for m in models}


def _kappa(y: np.ndarray, p: np.ndarray) -> float:
    if len(y) == 0 or (y.all() and p.all()) or (not y.any() and not p.any()):
        return math.nan
    po = float((y == p).mean())
    pe = float(y.mean() * p.mean() + (1 - y.mean()) * (1 - p.mean()))
    return (po - pe) / (1 - pe) if pe < 1 else math.nan


def _standardise(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = X.mean(0)
    sd = X.std(0)
    return mean, np.where(sd > 1e-9, sd, 1.0)


def _fit(X: np.ndarray, y: np.ndarray, C: float) -> tuple[LogisticRegression, np.ndarray, np.ndarray]:
    mean, scale = _standardise(X)
    clf = LogisticRegression(C=C, class_weight="balanced", max_iter=5000).fit((X - mean) / scale, y)
    return clf, mean, scale


def fit_hidden_heads_cv(blind: BlindSets, feats: dict[int, dict[str, np.ndarray]], reader: str, *,
                        held_out: frozenset[str] | None = None, folds: int = FOLDS,
                        c_grid: Sequence[float] = C_GRID, thresholds: Sequence[float] = THRESHOLDS,
                        hard_negative_arms: frozenset[str] = frozenset({"answer_removed"}), progress: bool = True
                        ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Choose and fit both heads on the pool by item-grouped cross-validation (see the module docstring).

    Args:
        blind: every blind-labelled set (:func:`~mechprobe.audit.blind_sets.load_blind_sets`).
        feats: ``{layer: {turn id: feature row}}`` for at least the pool's turns.
        reader: the reader's model name (written into the weights).
        held_out: source names never read (default: :func:`held_out_sources`).
        folds: cross-validation folds (by item).
        c_grid, thresholds: the candidates' L2 strengths and decision thresholds.
        hard_negative_arms: arms whose labelled turns are targets ``False`` under both readings (written without
            the answer, they fit any answer); they are scored under their labels as any other turn.
        progress: a progress bar over candidates.
    Returns:
        the weights (:data:`~mechprobe.judges.hidden.WEIGHTS_FORMAT`, version :data:`VERSION`, with the pool's
        size and the held-out sources) and one row per candidate and threshold: its out-of-fold kappa per subject
        model and their mean.
    Raises:
        UsageError: a layer without features for a pool turn, or no candidate with positives to score.

    Example:
        >>> w, rows = fit_hidden_heads_cv(blind, feats, "qwen2.5-coder-0.5b-instruct")   # doctest: +SKIP
    """
    held_out = held_out_sources() if held_out is None else held_out
    pool = pool_turns(blind, held_out)
    truth = {r: {t: consensus(blind.labels_of(t), r) for t in pool} for r in READINGS}
    target = {r: {t: (False if blind.turns[t].arm in hard_negative_arms and blind.labels_of(t) else truth[r][t])
                  for t in pool} for r in READINGS}
    fold = {t: fold_of_item(blind.turns[t].item, folds) for t in pool}
    models = sorted({blind.turns[t].model for t in pool})
    for layer, f in feats.items():
        missing = [t for t in pool if t not in f]
        if missing:
            raise UsageError(f"layer {layer}: no reader features for {len(missing)} pool turns (e.g. {missing[0]}); "
                             "compute them first (cached_hidden_features)")
    selection: list[dict[str, Any]] = []
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    oofs: dict[tuple[int, str, float], dict[str, float]] = {}
    grid = [(layer, tgt, C) for layer in sorted(feats) for tgt in READINGS for C in c_grid]
    for layer, tgt, C in tqdm(grid, desc=f"cv candidates ({reader})", disable=not progress):
        X = np.stack([feats[layer][t] for t in pool]).astype(np.float64)
        y = np.array([target[tgt][t] for t in pool], dtype=object)
        has = np.array([v is not None for v in y])
        fr = np.array([fold[t] for t in pool])
        oof: dict[str, float] = {}
        for k in range(folds):
            tr, te = has & (fr != k), fr == k
            yk = y[tr].astype(bool)
            if not te.any() or len(set(yk)) < 2:
                continue
            clf, mean, scale = _fit(X[tr], yk, C)
            # every pool turn of fold k is predicted by the model that did not see its item, also a turn without a
            # target under tgt (its labellers split there) that has one under the head's reading
            for t, p in zip(np.array(pool)[te], clf.predict_proba((X[te] - mean) / scale)[:, 1]):
                oof[str(t)] = float(p)
        oofs[(layer, tgt, C)] = oof
        for head in HEADS:
            scored = _scored_by_model(pool, blind, truth[head], oof, models)
            for thr in thresholds:
                per: dict[str, float] = {}
                for m, ts in scored.items():
                    yy = np.array([bool(truth[head][t]) for t in ts])
                    if yy.any():
                        per[m] = _kappa(yy, np.array([oof[t] >= thr for t in ts]))
                ks = [k for k in per.values() if math.isfinite(k)]
                if not ks:
                    continue
                score = float(np.mean(ks))
                row = {"head": head, "layer": layer, "target": tgt, "C": C, "threshold": thr,
                       "cv_mean_kappa": score, "cv_min_kappa": float(min(ks)), "cv_kappa": per}
                selection.append(row)
                if head not in best or score > best[head][0] + 1e-12:  # ties keep the earlier
                    best[head] = (score, row)
    missing_heads = [h for h in HEADS if h not in best]
    if missing_heads:
        raise UsageError(f"no pool turn with a genuine consensus under {', '.join(missing_heads)}: nothing to choose "
                         "a head on; add labelled turns")
    layer = int(best[STRICT][1]["layer"])  # one forward serves both heads: the strict head's layer
    heads: dict[str, Any] = {}
    mean = scale = None
    for h in HEADS:
        b = best[h][1]
        if int(b["layer"]) != layer:
            b = max((r for r in selection if r["head"] == h and r["layer"] == layer),
                    key=lambda r: r["cv_mean_kappa"])
        rows = [t for t in pool if target[b["target"]][t] is not None]
        X = np.stack([feats[layer][t] for t in rows]).astype(np.float64)
        if mean is None:  # both heads share the layer's standardisation, fit on the whole pool
            mean, scale = _standardise(np.stack([feats[layer][t] for t in pool]).astype(np.float64))
        clf = LogisticRegression(C=b["C"], class_weight="balanced", max_iter=5000).fit(
            (X - mean) / scale, [bool(target[b["target"]][t]) for t in rows])
        oof = oofs[(int(b["layer"]), b["target"], b["C"])]
        scored_ids = _scored_by_model(pool, blind, truth[h], oof, models)
        per, per_kappa = per_subject_thresholds({m: [(bool(truth[h][t]), oof[t]) for t in ts]
                                                 for m, ts in scored_ids.items()}, thresholds, float(b["threshold"]))
        gain = float(np.mean(list(per_kappa.values()))) - b["cv_mean_kappa"] if per_kappa else 0.0
        heads[h] = {"coef": [float(c) for c in clf.coef_[0]], "intercept": float(clf.intercept_[0]),
                    "threshold": b["threshold"],
                    "chosen": {k: b[k] for k in ("layer", "target", "C", "cv_mean_kappa", "cv_min_kappa", "cv_kappa")}}
        heads[h]["chosen"]["per_subject"] = {"thresholds": per, "cv_kappa": per_kappa, "gain": gain,
                                             "kept": gain >= PER_SUBJECT_MARGIN}
        if gain >= PER_SUBJECT_MARGIN:
            heads[h]["thresholds"] = per
    assert mean is not None and scale is not None
    w: dict[str, Any] = {"format": WEIGHTS_FORMAT, "version": VERSION, "reader": reader, "layer": layer,
                         "mean": [float(x) for x in mean], "scale": [float(x) for x in scale], "heads": heads,
                         "fit": {"protocol": "pool", "pool_turns": len(pool), "folds": folds,
                                 "layers_tried": sorted(feats), "held_out_sources": sorted(held_out),
                                 "rule": "every labelled item outside the held-out sources; item-grouped "
                                         f"{folds}-fold CV chooses (mean out-of-fold kappa over subject models); "
                                         "the winner refit on the whole pool; per-subject-model thresholds kept "
                                         f"if they beat one threshold by >= {PER_SUBJECT_MARGIN} out of fold",
                                 "hard_negative_arms": sorted(hard_negative_arms)}}
    w["weights_sha256"] = weights_digest(w)
    return w, selection
