"""The text-fit judge: a logistic head over the rules' verdict, lexical cues and small-embedding similarities.

``--judge textfit`` (no scoring LM: the only model is the offline rules' MiniLM sentence encoder, so it runs at
tens of turns per second on a 2-core CPU where the hybrid and trained judges, which run a 0.5B-1.5B LM per turn,
run at about a quarter of a turn per second).

Why: the linear probes predict *judged* follow-up, so the judge is their target. The trained judge
(:mod:`mechprobe.judges.trained`) weighed the hybrid judge's LM features with few labelled turns of the Qwen
models; this judge is fit by ``mechprobe judges evaluate --fit`` on every committed blind-labelled turn
(:mod:`mechprobe.audit.blind_sets`) of the train and dev items, with one head per reading (lenient, strict), and
is scored once on the test items. Its weights (``mechprobe/data/textfit_judge.json``) hold the features, the
standardisation, one coefficient vector and decision threshold per head, and a digest of those numbers.

Labels: P(genuine) of the head >= its threshold -> ``genuine_followup``; otherwise the offline rules' label, with
an offline ``genuine_followup`` turned into ``generic_followup`` (the rules saw a reaction, the head did not find
it specific). The binary decision is what the weights were fit for; the failure labels are the rules'.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.offline import Embedder, OfflineJudge, features
from mechprobe.judges.turn_features import TEXT_FEATURES, text_features
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import GENUINE, is_genuine

__all__ = ["TextFitJudge", "EMBED_FEATURES", "TEXTFIT_FEATURES", "WEIGHTS_FORMAT", "DEFAULT_WEIGHTS", "HEADS",
           "feature_rows", "head_proba", "check_weights", "load_weights", "weights_digest"]

WEIGHTS_FORMAT = "mechprobe-textfit-judge-v1"
DEFAULT_WEIGHTS = "textfit_judge.json"
HEADS = ("lenient", "strict")
EMBED_FEATURES: tuple[str, ...] = ("emb_sim_answer", "emb_sim_query", "emb_margin")
TEXTFIT_FEATURES: tuple[str, ...] = TEXT_FEATURES + EMBED_FEATURES


def feature_rows(inputs: Sequence[JudgeInput], offline: OfflineJudge, embedder: Embedder | None
                 ) -> tuple[list[dict[str, float]], list[LabelRecord]]:
    """Feature rows (:data:`TEXTFIT_FEATURES`) and the offline verdicts of ``inputs``, in order.

    ``embedder`` None gives the embedding features as the lexical cosines (the ``offline-lexical`` stand-in);
    the fitted weights record which was used (``embed``) and the judge refuses to mix them.
    """
    inputs = list(inputs)
    verdicts = list(offline.label_many(inputs))
    feats = [features(inp) for inp in inputs]
    if embedder is not None:
        embedder.add([x for inp, f in zip(inputs, feats) for x in (f.user_text, inp.prompt, inp.response)])
    rows = []
    for inp, f, v in zip(inputs, feats, verdicts):
        row = text_features(inp, v, f)
        if embedder is not None and f.user_text.strip():
            sa, sq = embedder.cos(f.user_text, inp.response), embedder.cos(f.user_text, inp.prompt)
        else:
            sa, sq = row["sim_response"], row["sim_prompt"]
        rows.append(row | {"emb_sim_answer": sa, "emb_sim_query": sq, "emb_margin": sa - sq})
    return rows, verdicts


def weights_digest(w: dict[str, Any]) -> str:
    """SHA-256 of the numbers that decide a label; a file edited after the fit no longer matches it."""
    core = {k: w.get(k) for k in ("features", "mean", "scale", "heads", "embed")}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _finite(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def check_weights(w: Any, where: str) -> dict[str, Any]:
    """Refuse a weights dict that would judge wrongly without failing (``where`` names the file)."""
    fix = "refit with the judges evaluate command, fit=True (never edit the weights by hand)"
    if not isinstance(w, dict) or w.get("format") != WEIGHTS_FORMAT:
        raise UsageError(f"{where}: not a {WEIGHTS_FORMAT} file; {fix}")
    names = w.get("features")
    if not isinstance(names, list) or not names or not set(names) <= set(TEXTFIT_FEATURES):
        raise UsageError(f"{where}: 'features' must list names from TEXTFIT_FEATURES; {fix}")
    n = len(names)
    for key in ("mean", "scale"):
        v = w.get(key)
        if not isinstance(v, list) or len(v) != n or not all(_finite(x) for x in v):
            raise UsageError(f"{where}: '{key}' must hold {n} finite numbers; {fix}")
    if any(s <= 0 for s in w["scale"]):
        raise UsageError(f"{where}: 'scale' holds a value <= 0; {fix}")
    heads = w.get("heads")
    if not isinstance(heads, dict) or not heads or not set(heads) <= set(HEADS):
        raise UsageError(f"{where}: 'heads' must map {'/'.join(HEADS)} to a fitted head; {fix}")
    for name, h in heads.items():
        coef = h.get("coef") if isinstance(h, dict) else None
        if not isinstance(coef, list) or len(coef) != n or not all(_finite(x) for x in coef):
            raise UsageError(f"{where}: head {name!r}: 'coef' must hold {n} finite numbers; {fix}")
        if not _finite(h.get("intercept")) or not _finite(h.get("threshold")) or not 0 <= h["threshold"] <= 1:
            raise UsageError(f"{where}: head {name!r}: intercept and threshold (in [0, 1]) must be finite; {fix}")
    if not isinstance(w.get("embed"), bool):
        raise UsageError(f"{where}: 'embed' must be true or false; {fix}")
    if w.get("weights_sha256") != weights_digest(w):
        raise UsageError(f"{where}: the weights do not match their weights_sha256 (edited after the fit); {fix}")
    return w


def load_weights(path: str | Path | None = None) -> dict[str, Any]:
    """The fitted weights: a path, or None for the package's own file.

    Raises:
        UsageError: missing, not JSON, or not a valid weights file (:func:`check_weights`).
    """
    if path is None:
        ref = resources.files("mechprobe") / "data" / DEFAULT_WEIGHTS
        if not ref.is_file():
            raise UsageError(f"no fitted weights in the package ({DEFAULT_WEIGHTS}); refit with the judges "
                             "evaluate command, fit=True")
        where, raw = f"mechprobe/data/{DEFAULT_WEIGHTS}", ref.read_bytes()
    else:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"{p}: textfit weights not found; pass the JSON that the judges "
                             "evaluate command wrote with fit=True and weights=PATH")
        where, raw = str(p), p.read_bytes()
    try:
        w = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UsageError(f"{where}: not valid UTF-8 JSON; refit with the judges evaluate command, fit=True") from None
    return check_weights(w, where)


def head_proba(w: dict[str, Any], head: str, rows: Sequence[dict[str, float]]) -> list[float]:
    """P(genuine) of feature rows under one head (standardise, then the logistic model)."""
    names, mean, scale = w["features"], w["mean"], w["scale"]
    h = w["heads"][head]
    out = []
    for row in rows:
        z = float(h["intercept"]) + sum(c * (float(row[n]) - m) / s
                                        for c, n, m, s in zip(h["coef"], names, mean, scale))
        out.append(1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, z)))))
    return out


class TextFitJudge:
    """Logistic head over rules, lexical cues and MiniLM similarities (see the module docstring).

    Args:
        reading: which head decides, ``strict`` (default: the codebook v2 reading the findings use) or
            ``lenient``.
        weights: a weights JSON path; None (default) = the package's fitted file.
        batch_size: turns per offline-rules batch.

    Example:
        >>> judge = TextFitJudge()                                                         # doctest: +SKIP
        >>> judge.label(JudgeInput("r1", "What is 12 * 7?", "84.", "Why 84 and not 74?")).genuine  # doctest: +SKIP
        True
    """

    def __init__(self, reading: str | None = None, *, weights: str | Path | None = None, batch_size: int = 256):
        self.weights = load_weights(weights)
        self.reading = reading or "strict"
        if self.reading not in self.weights["heads"]:
            raise UsageError(f"textfit: reading {self.reading!r} has no head in the weights (heads: "
                             f"{', '.join(sorted(self.weights['heads']))}); pass one of those")
        self.offline = OfflineJudge(embed=bool(self.weights["embed"]), batch_size=batch_size)
        self._embedder: Embedder | None = None
        self.threshold = float(self.weights["heads"][self.reading]["threshold"])
        self.name = f"textfit-{self.reading}@{self.weights['version']}+{self.offline.name}"

    def public_config(self) -> dict[str, Any]:
        return {"reading": self.reading, "version": self.weights["version"], "threshold": self.threshold,
                "weights_sha256": self.weights["weights_sha256"], "offline": self.offline.name}

    def probabilities(self, inputs: Sequence[JudgeInput]) -> tuple[list[float], list[LabelRecord]]:
        """P(genuine) under the judge's head, and the offline verdicts, of ``inputs`` in order."""
        if self.weights["embed"] and self._embedder is None:
            self._embedder = Embedder()
            self.offline._embedder = self._embedder  # one encoder and one memo: each text is encoded once
        rows, offline = feature_rows(inputs, self.offline, self._embedder)
        return head_proba(self.weights, self.reading, rows), offline

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        inputs = list(inputs)
        probs, offline = self.probabilities(inputs)
        for inp, p, off in zip(inputs, probs, offline):
            if p >= self.threshold:
                label = GENUINE
            else:
                label = "generic_followup" if off.label == GENUINE else off.label
            yield LabelRecord(record_id=inp.record_id, label=label, genuine=is_genuine(label), judge=self.name,
                              rationale=f"P(genuine, {self.reading}) {p:.3f} (threshold {self.threshold:.3f}); "
                                        f"offline {off.label}", probs={GENUINE: round(p, 6)})

    def label(self, inp: JudgeInput) -> LabelRecord:
        return next(self.label_many([inp]))
