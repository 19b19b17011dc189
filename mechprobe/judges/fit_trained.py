"""Fit the trained judge's weights on a labelled-turn set (``mechprobe judges features``, then ``judges fit``).

A labelled-turn set is a directory (the package's is ``reports/labelled_turns``) holding ``turns.jsonl`` (one
generated user turn a row, with its query, answer, subject model, condition and dev/test split) and
``labels/`` (``labeller-a.json``, ``labeller-b.json``, ``adjudicated.json``: blind labels by row). The steps:

* :func:`compute_features` writes ``features.jsonl``: every turn's judge features and offline verdict under the
  scoring model (the 0.5B model: a third of the 1.5B hybrid judge's forward cost); cached, resumable.
* :func:`fit_trained_judge` fits on the **dev split only**: item-grouped cross-validation picks the
  regularisation C and the decision threshold, a leave-one-subject-model-out table shows transfer to a model the
  fit never saw, and the weights (with their digest, :func:`~mechprobe.judges.trained.weights_digest`) and
  ``fit.md`` are written.

Reference label of a turn: the two blind labellers' label where they agree, else the adjudicator's; a turn with
neither is left out (counted). Why item-grouped folds: turns of one item share the query and answer, so random
folds would score the classifier on near-copies of its training rows. The test split is scored elsewhere, once
(``scripts/fit_trained_judge.py test``).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import cohen_kappa_score
from sklearn.model_selection import GroupKFold
from tqdm.auto import tqdm

from mechprobe.audit.agreement import kappa_with_ci
from mechprobe.errors import MissingInput
from mechprobe.io import write_text_atomic
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.factory import canonical_spec
from mechprobe.judges.hybrid import HybridJudge
from mechprobe.judges.trained import (
    DEFAULT_WEIGHTS,
    WEIGHTS_FORMAT,
    feature_rows,
    predict_proba,
    weights_digest,
)
from mechprobe.judges.turn_features import FEATURE_NAMES, vector
from mechprobe.taxonomy import GENUINE

__all__ = ["C_GRID", "FIT_COMMAND", "N_FOLDS", "SCORING_MODEL", "VERSION", "LabelledTurns", "TrainedFit",
           "compute_features", "fit_trained_judge", "kappa_cell", "package_weights_path", "to_input"]

SCORING_MODEL = "qwen2.5-coder-0.5b-instruct"  # 3x cheaper forwards than the 1.5B hybrid-voice judge
VERSION = "trained-v2"
C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
N_FOLDS = 5
FIT_COMMAND = "mechprobe judges fit"  # recorded in the weights as the fit's provenance


def package_weights_path() -> Path:
    """The package's own weights file (what ``--judge trained:MODEL`` loads without ``weights=``)."""
    return Path(str(resources.files("mechprobe") / "data" / DEFAULT_WEIGHTS))


@dataclass(frozen=True)
class LabelledTurns:
    """A labelled-turn set on disk, and what each step reads from or writes into it."""

    directory: Path

    @property
    def label_dir(self) -> Path:
        return self.directory / "labels"

    @property
    def features_file(self) -> Path:
        return self.directory / "features.jsonl"

    @property
    def judges_file(self) -> Path:
        """The compared judges' verdicts (``scripts/fit_trained_judge.py judges``)."""
        return self.directory / "judges.jsonl"

    def check(self) -> LabelledTurns:
        """Refuse a directory without ``turns.jsonl`` in one line, before any model loads."""
        if not (self.directory / "turns.jsonl").is_file():
            raise MissingInput(f"{self.directory}: no turns.jsonl; pass a labelled-turn set directory "
                               "(reports/labelled_turns)")
        return self

    def load_turns(self) -> dict[str, dict]:
        return {r["turn_id"]: r for r in _jsonl(self.directory / "turns.jsonl")}

    def load_label_file(self, name: str) -> dict[str, dict]:
        p = self.label_dir / f"{name}.json"
        if not p.exists():
            return {}
        return {r["row"]: r for r in json.loads(p.read_text(encoding="utf-8"))["rows"]}

    def reference(self) -> tuple[dict[str, str], dict[str, int]]:
        """turn_id -> reference label (agreed, else adjudicated), and counts of how each was reached."""
        a, b = self.load_label_file("labeller-a"), self.load_label_file("labeller-b")
        adj = self.load_label_file("adjudicated")
        ref, how = {}, Counter()
        for tid in a.keys() & b.keys():
            if a[tid]["label"] == b[tid]["label"]:
                ref[tid] = a[tid]["label"]
                how["agreed"] += 1
            elif tid in adj:
                ref[tid] = adj[tid]["label"]
                how["adjudicated"] += 1
            else:
                how["disagreed, not adjudicated"] += 1
        return ref, dict(how)

    def judge_labels(self) -> dict[str, dict[str, str]]:
        """spec -> {turn_id: label} from judges.jsonl (specs recorded as ``hybrid2:`` read as ``hybrid-voice:``)."""
        out: dict[str, dict[str, str]] = {}
        if self.judges_file.exists():
            for r in _jsonl(self.judges_file):
                out.setdefault(canonical_spec(r["spec"]), {})[r["turn_id"]] = r["label"]
        return out

    def rows_with_ref(self, split: str) -> tuple[list[dict], list[str], dict]:
        """The turns of ``split`` that have features and a reference label (feature row + ``turn`` + ``ref``),
        their item keys, and how the reference labels were reached."""
        turns = self.load_turns()
        ref, how = self.reference()
        if not self.features_file.is_file():
            raise MissingInput(f"{self.features_file}: no features yet; run `mechprobe judges features "
                               f"{self.directory}` first")
        feats = {r["turn_id"]: r for r in _jsonl(self.features_file)}
        rows = [feats[t] | {"turn": turns[t], "ref": ref[t]} for t in sorted(ref) if t in feats
                and turns[t]["split"] == split]
        return rows, [r["turn"]["item_key"] for r in rows], how

    def log_speed(self, what: str, turns: int, seconds: float) -> None:
        """Append one timing row to speed.jsonl: turns/s of a judge on these turns, with the CPU that ran it."""
        if not turns:
            return
        cpuinfo = Path("/proc/cpuinfo")
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                    if ln.startswith("model name")), platform.processor()) if cpuinfo.exists() \
            else platform.processor()
        row = {"judge": what, "turns": turns, "seconds": round(seconds, 1), "turns_per_s": round(turns / seconds, 4),
               "cpu": cpu, "threads": torch.get_num_threads()}
        with (self.directory / "speed.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines()]


def to_input(r: dict) -> JudgeInput:
    """A labelled turn as a judge's input."""
    return JudgeInput(record_id=r["turn_id"], prompt=r["query"], response=r["answer"], raw_text=r["turn"],
                      dataset=r["dataset"], item_id=r["item_key"], subject=r.get("model", ""))


def _by_conversation(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by conversation (item and answer), so one judge call scores turns that share a prefix."""
    by_item: dict[str, list[dict]] = {}
    for r in rows:
        by_item.setdefault(r["item_key"] + r["answer"][:64], []).append(r)
    return list(by_item.values())


def compute_features(turns: LabelledTurns, progress: bool = True) -> int:
    """Append to ``features.jsonl`` the features and offline verdict of every turn that has none yet (under
    :data:`SCORING_MODEL`); returns how many were computed. Resumable: a killed run loses at most one
    conversation's rows."""
    have = {r["turn_id"] for r in _jsonl(turns.features_file)} if turns.features_file.exists() else set()
    todo = [r for tid, r in sorted(turns.load_turns().items()) if tid not in have]
    print(f"{len(have)} turns have features, {len(todo)} to do", file=sys.stderr)
    if not todo:
        return 0
    hybrid = HybridJudge(SCORING_MODEL)  # its store, cache and offline rules compute the features
    t0, n = time.perf_counter(), 0
    with turns.features_file.open("a", encoding="utf-8") as f:
        for group in tqdm(_by_conversation(todo), desc="features (conversations)", disable=not progress):
            n += len(group)
            inputs = [to_input(r) for r in group]
            rows, offline = feature_rows(hybrid, inputs)
            for inp in inputs:
                rec = {"turn_id": inp.record_id, "features": rows[inp.record_id], "scoring_model": SCORING_MODEL,
                       "offline": offline[inp.record_id].label, "offline_name": hybrid.offline.name}
                f.write(json.dumps(rec) + "\n")
            f.flush()
    turns.log_speed(f"trained:{SCORING_MODEL} (features)", n, time.perf_counter() - t0)
    return n


# ------------------------------------------------------------------------------------------------ the fit


def _matrix(rows: list[dict]) -> np.ndarray:
    return np.array([vector(r["features"], FEATURE_NAMES) for r in rows], dtype=float)


def _fit(x: np.ndarray, y: np.ndarray, c: float) -> dict[str, Any]:
    mean = x.mean(0)
    scale = x.std(0)
    scale[scale < 1e-9] = 1.0
    m = LogisticRegression(C=c, max_iter=5000, class_weight="balanced")
    m.fit((x - mean) / scale, y)
    return {"mean": mean.tolist(), "scale": scale.tolist(), "coef": m.coef_[0].tolist(),
            "intercept": float(m.intercept_[0]), "features": list(FEATURE_NAMES)}


def _proba(w: dict, rows: list[dict]) -> np.ndarray:
    return np.array(predict_proba(w, [r["features"] for r in rows]))


def _kappa_bin(y: np.ndarray, pred: np.ndarray) -> float:
    if len(set(y.tolist()) | set(pred.tolist())) < 2:
        return float("nan")
    return float(cohen_kappa_score(y, pred))


def _oof(rows: list[dict], y: np.ndarray, groups: Sequence[str], c: float) -> np.ndarray:
    """Out-of-fold P(genuine) of every row under item-grouped folds."""
    p = np.zeros(len(rows))
    x = _matrix(rows)
    for tr, te in GroupKFold(n_splits=N_FOLDS).split(x, y, groups):
        w = _fit(x[tr], y[tr], c)
        p[te] = _proba(w, [rows[i] for i in te])
    return p


def _best_threshold(y: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    best = (0.5, -1.0)
    for t in np.round(np.arange(0.2, 0.91, 0.05), 2):
        k = _kappa_bin(y, (p >= t).astype(int))
        if math.isfinite(k) and k > best[1]:
            best = (float(t), k)
    return best


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kappa_cell(k: dict) -> str:
    """A kappa (``Kappa.to_dict()``) as a table cell: κ [CI] (agreeing rows/rows)."""
    if not k["n"]:
        return "—"
    if not math.isfinite(k["kappa"]):
        return f"n/a ({k['agree']}/{k['n']} agree)"
    ci = f" [{k['lo']:.2f}, {k['hi']:.2f}]" if math.isfinite(k["lo"]) else ""
    return f"{k['kappa']:.2f}{ci} ({k['agree']}/{k['n']} agree)"


@dataclass(frozen=True)
class TrainedFit:
    """What :func:`fit_trained_judge` wrote: the weights (as written) and their file, and the report."""

    weights: dict[str, Any]
    weights_path: Path
    report: str
    report_path: Path


def fit_trained_judge(turns: LabelledTurns, weights_path: str | Path | None = None) -> TrainedFit:
    """Fit the trained judge on the dev split of ``turns`` and write its weights and ``fit.md``.

    Args:
        turns: the labelled-turn set, with ``features.jsonl`` (:func:`compute_features`).
        weights_path: where the weights go (default: the package's own file, :func:`package_weights_path`).
    """
    rows, groups, how = turns.rows_with_ref("dev")
    y = np.array([int(r["ref"] == GENUINE) for r in rows])
    print(f"dev: {len(rows)} turns, {y.sum()} genuine, {len(set(groups))} items; reference {how}", file=sys.stderr)
    cv = {}
    for c in C_GRID:
        p = _oof(rows, y, groups, c)
        t, k = _best_threshold(y, p)
        cv[c] = {"threshold": t, "kappa": k, "oof": p}
        print(f"  C={c:g}: best threshold {t:.2f}, out-of-fold binary kappa {k:.3f}", file=sys.stderr)
    c_best = max(cv, key=lambda c: cv[c]["kappa"])
    thr = cv[c_best]["threshold"]
    w = _fit(_matrix(rows), y, c_best)
    # leave one subject model out (dev turns only): transfer to a model the fit never saw
    lomo = {}
    for m in sorted({r["turn"]["model"] for r in rows}):
        tr = [r for r in rows if r["turn"]["model"] != m]
        te = [r for r in rows if r["turn"]["model"] == m]
        ytr = np.array([int(r["ref"] == GENUINE) for r in tr])
        if len(set(ytr.tolist())) < 2:
            continue
        wm = _fit(_matrix(tr), ytr, c_best)
        pred = (_proba(wm, te) >= thr).astype(int)
        k = kappa_with_ci([GENUINE if v else "x" for v in pred], [r["ref"] for r in te],
                          [r["turn"]["item_key"] for r in te], binary=True)
        lomo[m] = {"n": len(te), "genuine": int(sum(r["ref"] == GENUINE for r in te)), "kappa": k.to_dict()}
    # the other judges on the same dev turns, for the table beside the CV number
    others = {"offline": kappa_with_ci([r["offline"] for r in rows], [r["ref"] for r in rows], groups,
                                       binary=True).to_dict()}
    for spec, labs in turns.judge_labels().items():
        sub = [r for r in rows if r["turn_id"] in labs]
        if sub:
            others[spec] = kappa_with_ci([labs[r["turn_id"]] for r in sub], [r["ref"] for r in sub],
                                         [r["turn"]["item_key"] for r in sub], binary=True).to_dict()
    oof_pred = (cv[c_best]["oof"] >= thr).astype(int)
    oof_k = kappa_with_ci([GENUINE if v else "x" for v in oof_pred], [r["ref"] for r in rows], groups, binary=True)
    d = turns.directory
    fit = {"format": WEIGHTS_FORMAT, "version": VERSION, "scoring_model": SCORING_MODEL, "threshold": thr,
           "C": c_best, **w,
           "fit": {"script": FIT_COMMAND, "dev_turns": len(rows), "dev_items": len(set(groups)),
                   "dev_genuine": int(y.sum()), "reference": how,
                   "turns_sha256": _sha(d / "turns.jsonl"), "features_sha256": _sha(turns.features_file),
                   "labels_sha256": {p.name: _sha(p) for p in sorted(turns.label_dir.glob("*.json"))},
                   "cv": {f"{c:g}": {"threshold": v["threshold"], "kappa": round(v["kappa"], 4)}
                          for c, v in cv.items()},
                   "oof_kappa": oof_k.to_dict(), "lomo": lomo, "dev_kappa_other_judges": others}}
    fit = {k: v for k, v in fit.items() if k != "fit"} | {"weights_sha256": weights_digest(fit), "fit": fit["fit"]}
    out = Path(weights_path) if weights_path is not None else package_weights_path()
    write_text_atomic(out, json.dumps(fit, indent=1) + "\n")
    lines = ["# Trained judge: fit on the dev split", "",
             f"Dev split of `reports/labelled_turns`: {len(rows)} turns ({int(y.sum())} genuine by the reference) "
             f"on {len(set(groups))} items. Reference: two blind model-written labellers' agreed label, else the "
             f"adjudicator's ({how}). Features: {len(FEATURE_NAMES)} (rules' verdict, lexical cues, grounding "
             f"PMI and voice margin of `{SCORING_MODEL}`). Logistic regression, balanced classes; C and the "
             f"threshold chosen by {N_FOLDS}-fold item-grouped CV: **C = {c_best:g}, threshold {thr:.2f}**.", "",
             "| judge (dev turns) | binary κ vs reference [95% CI, item bootstrap] |", "|---|---|",
             f"| trained, out-of-fold (CV) | {oof_k.cell()} |",
             *(f"| {n} | {kappa_cell(k)} |" for n, k in others.items()), "",
             "Leave one subject model out (fit on the other models' dev turns, same C and threshold):", "",
             "| held-out subject model | turns | genuine | binary κ [95% CI] |", "|---|---|---|---|",
             *(f"| {m} | {v['n']} | {v['genuine']} | {kappa_cell(v['kappa'])} |" for m, v in lomo.items()), "",
             "Coefficients (standardised features):", "", "| feature | coef |", "|---|---|",
             *(f"| {n} | {c:+.3f} |" for n, c in sorted(zip(FEATURE_NAMES, w["coef"]), key=lambda t: -abs(t[1]))),
             ""]
    report = "\n".join(lines)
    write_text_atomic(d / "fit.md", report)
    return TrainedFit(fit, out, report, d / "fit.md")
