"""Fit and choose the hidden-state judge's heads (:mod:`mechprobe.judges.hidden`) on the blind-labelled sets, and
keep the reader's features of every labelled turn on disk.

Selection mirrors the text-fit judge's (:func:`mechprobe.judges.judge_eval.fit_heads`): for each head (one per
reading) every candidate is a layer, a training target (lenient or strict consensus), an L2 strength C and a
threshold; the logistic model is fit on the train items (class-balanced; answer-removed turns are hard
negatives), and the candidate with the highest mean dev kappa over the subject models whose dev turns hold a
positive wins. Test items are never read here.

Features are computed once per turn and reader and kept in ``<cache>/hidden-<reader>/batch-*.npz`` (turn ids and
one array per layer), written batch by batch, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from mechprobe.audit.blind_sets import BlindSets, consensus, split_of_item
from mechprobe.audit.readings import READINGS
from mechprobe.errors import UsageError
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.hidden import (
    FEATURE_KINDS,
    HEADS,
    WEIGHTS_FORMAT,
    answer_hidden,
    hidden_features,
    weights_digest,
)

__all__ = ["cached_hidden_features", "fit_hidden_heads", "C_GRID", "THRESHOLDS", "VERSION"]

C_GRID = (0.001, 0.003, 0.01, 0.03)
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(2, 19))
VERSION = "hidden-v1"


def _load_cache(d: Path, layers: Sequence[int]) -> dict[str, dict[int, np.ndarray]]:
    have: dict[str, dict[int, np.ndarray]] = {}
    for f in sorted(d.glob("batch-*.npz")) if d.is_dir() else []:
        z = np.load(f)
        if not all(f"layer_{r}" in z for r in layers):
            continue  # a batch of other layers: recomputed for these
        for j, tid in enumerate(z["ids"]):
            have[str(tid)] = {r: z[f"layer_{r}"][j] for r in layers}
    return have


def cached_hidden_features(lm: Any, inputs: dict[str, JudgeInput], layers: Sequence[int], cache: Path,
                           batch_size: int = 8, progress: bool = True, kind: str = "turn"
                           ) -> dict[int, dict[str, np.ndarray]]:
    """``{layer: {turn id: row}}`` for every input, computed where ``cache/hidden-<reader>/`` lacks them.

    Args:
        lm: the reader.
        inputs: turn id -> what the judge sees.
        layers: residual indices to keep.
        cache: the features folder (``runs/judge_eval``).
        batch_size: turns per forward.
        progress: a progress bar over the turns still to compute.
        kind: the rows' kind (:data:`~mechprobe.judges.hidden.FEATURE_KINDS`). ``"answer-contrast"`` also reads
            every turn with its answer hidden, cached in ``cache/hidden-<reader>-answer-hidden/``, and returns
            [rows, rows minus answer-hidden rows] (:func:`~mechprobe.judges.hidden.judge_features`).
    Raises:
        UsageError: an unknown kind.
    """
    if kind not in FEATURE_KINDS:
        raise UsageError(f"hidden-judge features {kind!r}: use one of {', '.join(FEATURE_KINDS)}")
    a = _cached(lm, inputs, layers, Path(cache) / f"hidden-{lm.name}", batch_size, progress)
    if kind == "turn":
        return a
    n = _cached(lm, {t: answer_hidden(x) for t, x in inputs.items()}, layers,
                Path(cache) / f"hidden-{lm.name}-answer-hidden", batch_size, progress)
    return {r: {t: np.concatenate([a[r][t], a[r][t] - n[r][t]]) for t in inputs} for r in layers}


def _cached(lm: Any, inputs: dict[str, JudgeInput], layers: Sequence[int], d: Path, batch_size: int,
            progress: bool) -> dict[int, dict[str, np.ndarray]]:
    """The reader's rows of ``inputs`` kept in folder ``d`` (written batch by batch: an interruption loses at most
    one batch), computing the missing ones."""
    have = _load_cache(d, layers)
    todo = [inputs[t] for t in sorted(inputs) if t not in have]
    if todo:
        d.mkdir(parents=True, exist_ok=True)
        # after the highest existing index, never over an existing file (a deleted batch leaves a gap)
        count = [1 + max((int(f.stem.split("-")[1]) for f in d.glob("batch-*.npz")), default=-1)]

        def keep(ids: list[str], rows: dict[int, np.ndarray]) -> None:
            np.savez(d / f"batch-{count[0]:06d}.npz", ids=np.array(ids), **{f"layer_{r}": rows[r] for r in layers})
            count[0] += 1
            for j, tid in enumerate(ids):
                have[tid] = {r: rows[r][j] for r in layers}

        hidden_features(lm, todo, layers, batch_size=batch_size, progress=progress, on_batch=keep)
    return {r: {t: have[t][r] for t in inputs} for r in layers}


def _kappa(y: Sequence[bool], p: Sequence[bool]) -> float:
    y, p = np.asarray(y, bool), np.asarray(p, bool)
    n = len(y)
    if n == 0 or (y.all() and p.all()) or (not y.any() and not p.any()):
        return math.nan
    po = float((y == p).mean())
    pe = float(y.mean() * p.mean() + (1 - y.mean()) * (1 - p.mean()))
    return (po - pe) / (1 - pe) if pe < 1 else math.nan


def fit_hidden_heads(blind: BlindSets, feats: dict[int, dict[str, np.ndarray]], reader: str,
                     hard_negative_arms: frozenset[str] = frozenset({"answer_removed"})
                     ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fit every candidate on the train items, choose each head's on dev (see the module docstring).

    Returns:
        the weights (:data:`~mechprobe.judges.hidden.WEIGHTS_FORMAT`) and one row per candidate (its dev kappa per
        subject model and their mean).
    Raises:
        UsageError: no train turn of both classes, or no dev turn with a positive.
    """
    tids = sorted(blind.turns)
    split = {t: split_of_item(blind.turns[t].item) for t in tids}
    model_of = {t: blind.turns[t].model for t in tids}
    truth = {r: {t: consensus(blind.labels_of(t), r) for t in tids} for r in READINGS}
    target = {r: {t: (False if blind.turns[t].arm in hard_negative_arms and blind.labels_of(t) else truth[r][t])
                  for t in tids} for r in READINGS}
    train = [t for t in tids if split[t] == "train"]
    models = sorted(set(model_of.values()))
    dev = {(r, m): [t for t in tids if split[t] == "dev" and model_of[t] == m and truth[r][t] is not None]
           for r in READINGS for m in models}
    selection: list[dict[str, Any]] = []
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for layer in sorted(feats):
        X = feats[layer]
        tr_all = np.stack([X[t] for t in train]).astype(np.float64)
        mean, scale = tr_all.mean(0), tr_all.std(0)
        scale = np.where(scale > 1e-9, scale, 1.0)
        for tgt in READINGS:
            tr = [t for t in train if target[tgt][t] is not None]
            y = [bool(target[tgt][t]) for t in tr]
            if len(set(y)) < 2:
                continue
            Z = (np.stack([X[t] for t in tr]) - mean) / scale
            for C in C_GRID:
                clf = LogisticRegression(C=C, class_weight="balanced", max_iter=5000).fit(Z, y)
                prob = {t: float(p) for t, p in zip(
                    [t for k in dev.values() for t in k],
                    clf.predict_proba((np.stack([X[t] for k in dev.values() for t in k]) - mean) / scale)[:, 1]
                    if any(dev.values()) else [])}
                for head in HEADS:
                    for thr in THRESHOLDS:
                        per = {}
                        for m in models:
                            yy = [bool(truth[head][t]) for t in dev[(head, m)]]
                            if any(yy):
                                per[m] = _kappa(yy, [prob[t] >= thr for t in dev[(head, m)]])
                        ks = [k for k in per.values() if math.isfinite(k)]
                        if not ks:
                            continue
                        score = float(np.mean(ks))
                        row = {"head": head, "layer": layer, "target": tgt, "C": C, "threshold": thr,
                               "dev_mean_kappa": score, "dev_kappa": per}
                        selection.append(row)
                        if head not in best or score > best[head][0] + 1e-12:  # ties keep the earlier
                            best[head] = (score, {**row, "coef": [float(c) for c in clf.coef_[0]],
                                                  "intercept": float(clf.intercept_[0]), "mean": mean, "scale": scale})
    missing = [h for h in HEADS if h not in best]
    if missing:
        raise UsageError(f"no dev turn with a genuine consensus under {', '.join(missing)} (or no train turn of both "
                         "classes): nothing to choose a head on; add labelled turns")
    # One layer for both heads (one forward serves both readings): the strict head's layer, the reading that matters
    layer = int(best["strict"][1]["layer"])
    heads: dict[str, Any] = {}
    for h in HEADS:
        b = best[h][1]
        if int(b["layer"]) != layer:  # refit this head on the strict head's layer, choosing its target, C, threshold
            rows = [r for r in selection if r["head"] == h and r["layer"] == layer]
            if not rows:
                raise UsageError(f"head {h}: no candidate at layer {layer}")
            top = max(rows, key=lambda r: r["dev_mean_kappa"])
            X = feats[layer]
            tr = [t for t in train if target[top["target"]][t] is not None]
            tr_all = np.stack([X[t] for t in train]).astype(np.float64)
            mean, scale = tr_all.mean(0), np.where(tr_all.std(0) > 1e-9, tr_all.std(0), 1.0)
            clf = LogisticRegression(C=top["C"], class_weight="balanced", max_iter=5000).fit(
                (np.stack([X[t] for t in tr]) - mean) / scale, [bool(target[top["target"]][t]) for t in tr])
            b = {**top, "coef": [float(c) for c in clf.coef_[0]], "intercept": float(clf.intercept_[0]),
                 "mean": mean, "scale": scale}
        heads[h] = {"coef": b["coef"], "intercept": b["intercept"], "threshold": b["threshold"],
                    "chosen": {k: b[k] for k in ("layer", "target", "C", "dev_mean_kappa", "dev_kappa")}}
        mean, scale = b["mean"], b["scale"]
    w: dict[str, Any] = {"format": WEIGHTS_FORMAT, "version": VERSION, "reader": reader, "layer": layer,
                         "mean": [float(x) for x in mean], "scale": [float(x) for x in scale], "heads": heads,
                         "fit": {"train_turns": len(train), "layers_tried": sorted(feats),
                                 "rule": "train items fit, dev items choose (mean dev kappa over subject models), "
                                         "test items never read", "hard_negative_arms": sorted(hard_negative_arms)}}
    w["weights_sha256"] = weights_digest(w)
    return w, selection
