"""The trained judge: a logistic model over the hybrid judge's signals and lexical cues, fit on labelled turns.

``--judge trained:MODEL`` (the scoring model the weights were fit with: ``qwen2.5-coder-0.5b-instruct`` for the
package's weights, a third of the 1.5B hybrid judge's forward cost).
Why: the hybrid judge's two hand-set thresholds and fixed decision order let one signal decide alone, and on
independently labelled turns it agreed with labellers no better than the rules (docs/judge_agreement.md). Here
the same signals (:mod:`mechprobe.judges.turn_features`) are weighed jointly by a classifier whose weights come
from ``mechprobe judges fit`` (:mod:`mechprobe.judges.fit_trained`) on the dev split of ``reports/labelled_turns`` (item-grouped CV chose the
regularisation and the decision threshold), never edited by hand.

Labels: P(genuine) >= the fitted threshold -> ``genuine_followup``. Otherwise the offline rules' label stands,
except an offline ``genuine_followup``, which becomes ``assistant_continuation`` when the voice margin is
negative (the text is likelier in the assistant's slot) and ``new_query`` otherwise. The binary decision is
what the weights were fit for; the seven failure labels are the rules'.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from mechprobe.errors import UsageError
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.hybrid import HybridJudge
from mechprobe.judges.offline import split_roles
from mechprobe.judges.turn_features import FEATURE_NAMES, model_feature_row, text_features, vector
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import GENUINE, is_genuine

__all__ = ["TrainedJudge", "check_weights", "feature_rows", "load_weights", "weights_digest", "predict_proba", "verdict", "WEIGHTS_FORMAT",
           "DEFAULT_WEIGHTS"]

WEIGHTS_FORMAT = "mechprobe-trained-judge-v1"
DEFAULT_WEIGHTS = "trained_judge.json"


def weights_digest(weights: dict[str, Any]) -> str:
    """SHA-256 of the values that decide a label (features, standardisation, coefficients, intercept, threshold).

    Why: the fit script records it as ``weights_sha256``; a file whose numbers were edited after the fit (by hand
    or by a bad merge) no longer matches, and :func:`load_weights` refuses it instead of judging with them.
    """
    core = {k: weights.get(k) for k in ("features", "mean", "scale", "coef", "intercept", "threshold")}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _finite_list(d: dict[str, Any], key: str, n: int, where: str, fix: str) -> list[float]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} values" if isinstance(v, list) else type(v).__name__
        raise UsageError(f"{where}: '{key}' must list one number per feature ({n}), got {got}; {fix}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise UsageError(f"{where}: '{key}' holds {x!r}, not a finite number; {fix}")
    return v


def check_weights(d: Any, where: str) -> dict[str, Any]:
    """Refuse a weights dict that would judge wrongly without failing (``where`` names the file in the message).

    Why: ``predict_proba`` clamps the logit, so a NaN coefficient or intercept labels every turn genuine; ``zip``
    truncates a short ``coef``; a zero scale divides by zero; a threshold outside [0, 1] makes every turn one
    label. Each is refused with a line that names the file and the fix.
    """
    fix = "refit with mechprobe judges fit (never edit the weights by hand)"
    if not isinstance(d, dict):
        raise UsageError(f"{where}: not a trained-judge weights file (a JSON object); {fix}")
    if d.get("format") != WEIGHTS_FORMAT:
        raise UsageError(f"{where}: not a {WEIGHTS_FORMAT} file (format {d.get('format')!r}); {fix}")
    for key in ("version", "scoring_model"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise UsageError(f"{where}: '{key}' missing or not a string; {fix}")
    names = d.get("features")
    if (not isinstance(names, list) or not names or len(set(map(str, names))) != len(names)
            or not set(names) <= set(FEATURE_NAMES)):
        raise UsageError(f"{where}: 'features' must be a list of distinct feature names from "
                         f"mechprobe.judges.turn_features.FEATURE_NAMES; {fix}")
    n = len(names)
    _finite_list(d, "coef", n, where, fix)
    _finite_list(d, "mean", n, where, fix)
    if any(s <= 0 for s in _finite_list(d, "scale", n, where, fix)):
        raise UsageError(f"{where}: 'scale' holds a value <= 0 (features are divided by it); {fix}")
    for key, lo, hi in (("intercept", -math.inf, math.inf), ("threshold", 0.0, 1.0)):
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            rng = " in [0, 1]" if key == "threshold" else ""
            raise UsageError(f"{where}: '{key}' is {v!r}, not a finite number{rng}; {fix}")
    if "weights_sha256" in d and d["weights_sha256"] != weights_digest(d):
        raise UsageError(f"{where}: the weights do not match their recorded weights_sha256 (edited after the fit); "
                         f"{fix}")
    return d


def load_weights(path: str | Path | None = None) -> dict[str, Any]:
    """The fitted weights: a path, or None for the package's own file (written by the fit script).

    Raises:
        UsageError: the file is missing, not JSON, or not a valid trained-judge weights file
            (:func:`check_weights`).
    """
    if path is None:
        ref = resources.files("mechprobe") / "data" / DEFAULT_WEIGHTS
        if not ref.is_file():
            raise UsageError(f"no fitted weights in the package ({DEFAULT_WEIGHTS}); run "
                             "mechprobe judges fit, or pass weights=PATH")
        where, text = f"mechprobe/data/{DEFAULT_WEIGHTS}", ref.read_bytes()
    else:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"{p}: trained-judge weights not found; pass the JSON mechprobe judges fit wrote")
        where, text = str(p), p.read_bytes()
    try:
        d = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{where}: not valid UTF-8 JSON ({type(e).__name__}); refit with mechprobe "
                         "judges fit") from None
    return check_weights(d, where)


def predict_proba(weights: dict[str, Any], rows: Sequence[dict[str, float]]) -> list[float]:
    """P(genuine) of feature rows under ``weights`` (standardise, then the logistic model)."""
    names = weights["features"]
    mean, scale, coef, b = weights["mean"], weights["scale"], weights["coef"], float(weights["intercept"])
    out = []
    for row in rows:
        x = vector(row, names)
        z = b + sum(c * (v - m) / s for c, v, m, s in zip(coef, x, mean, scale))
        out.append(1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, z)))))
    return out


def feature_rows(hybrid: HybridJudge, inputs: Sequence[JudgeInput]
                 ) -> tuple[dict[str, dict[str, float]], dict[str, LabelRecord]]:
    """Feature rows and offline verdicts per record id; the model features come from ``hybrid``'s store and cache,
    batched per conversation (the same forwards, and cache keys, as the hybrid judge's own).

    Args:
        hybrid: a loaded :class:`~mechprobe.judges.hybrid.HybridJudge` (its scoring model and offline rules).
        inputs: the turns.
    Returns:
        ``({record_id: {feature: value}}, {record_id: offline verdict})``.
    """
    offline = {r.record_id: r for r in hybrid.offline.label_many(list(inputs))}
    rows = {inp.record_id: text_features(inp, offline[inp.record_id]) for inp in inputs}
    groups: dict[str, list[JudgeInput]] = {}
    for inp in inputs:
        groups.setdefault(json.dumps(inp.conversation(), sort_keys=True, ensure_ascii=False), []).append(inp)
    for group in groups.values():
        texts = {inp.record_id: split_roles(inp.raw_text)[0].text for inp in group}
        live = [inp for inp in group if texts[inp.record_id].strip()]
        memo: dict[str, tuple[float, int]] = {}
        tx = [texts[i.record_id] for i in live]
        pmis = hybrid.pmi_many(live, tx, memo) if live else []
        voices = hybrid.voice_many(live, tx, memo) if live else []
        got = {inp.record_id: (p, v) for inp, p, v in zip(live, pmis, voices)}
        for inp in group:
            p, v = got.get(inp.record_id, (None, None))
            rows[inp.record_id] |= model_feature_row(p, v)
        hybrid.store.forget("real", pool=True)
        for slot in ("null", "assistant"):
            hybrid.store.forget(slot)
    return rows, offline


def verdict(p: float, threshold: float, offline_label: str, row: dict[str, float]) -> str:
    """The trained judge's label from its P(genuine), the rules' label and the turn's feature row.

    Why a pure function: the fit script scores the 8-label agreement on stored features with the same rule the
    judge applies at run time. The fit decides only genuine vs not; the failure label is the rules', except where
    the rules said genuine and the fit did not: then the voice margin picks assistant continuation (the turn reads
    as the assistant's) over a new query.

    Args:
        p: P(genuine) from :func:`predict_proba`.
        threshold: the fitted decision threshold.
        offline_label: the offline rules' label of the same turn.
        row: the turn's feature row (needs ``voice`` and ``no_text``).

    Returns:
        One of the eight taxonomy labels.

    Example:
        >>> verdict(0.9, 0.65, "new_query", {"voice": 0.1, "no_text": 0.0})
        'genuine_followup'
        >>> verdict(0.2, 0.65, "genuine_followup", {"voice": -0.3, "no_text": 0.0})
        'assistant_continuation'
    """
    if p >= threshold:
        return GENUINE
    if offline_label == GENUINE:
        return "assistant_continuation" if row["voice"] < 0 and not row["no_text"] else "new_query"
    return offline_label


class TrainedJudge:
    """Logistic judge over rules, lexical cues, grounding PMI and voice (see the module docstring).

    Args:
        model: the scoring model; must be the one the weights were fit with (PMI and voice scales differ between
            models). None (default) = the weights' own scoring model.
        weights: a weights JSON path; None (default) = the package's fitted file.
        dtype, device, cache_dir, loaded, embed: as for :class:`~mechprobe.judges.hybrid.HybridJudge`, whose
            store and cache compute the model features.

    Attributes:
        name: ``"trained:<model>@<version>+<offline name>"``.
        threshold: the P(genuine) cut chosen by item-grouped CV on the dev split.

    Example:
        >>> from mechprobe.judges.trained import TrainedJudge
        >>> judge = TrainedJudge("qwen2.5-coder-0.5b-instruct")                        # doctest: +SKIP
        >>> judge.label(JudgeInput("r1", "What is 12 * 7?", "84.", "Why 84?")).label  # doctest: +SKIP
        'genuine_followup'
    """

    def __init__(self, model: str | None = None, *, weights: str | Path | None = None,
                 dtype: str | torch.dtype | None = None, device: str | None = None,
                 cache_dir: str | Path | bool | None = None, loaded: Any = None, embed: bool | None = None):
        self.weights = load_weights(weights)
        fit_model = self.weights["scoring_model"]
        model = model or fit_model
        given = loaded.name if loaded is not None else Path(str(model)).name.removesuffix(".gguf")
        if given != fit_model:
            raise UsageError(f"trained:{model}: these weights were fit with scoring model {fit_model}; use "
                             f"judge=trained:{fit_model} or refit with mechprobe judges fit")
        self.hybrid = HybridJudge(model, dtype=dtype, device=device, cache_dir=cache_dir, loaded=loaded, embed=embed)
        self.lm = self.hybrid.lm
        self.model_name = self.hybrid.model_name
        self.threshold = float(self.weights["threshold"])
        self.name = f"trained:{self.model_name}@{self.weights['version']}+{self.hybrid.offline.name}"
        self.stats = self.hybrid.stats

    def public_config(self) -> dict[str, Any]:
        return {"model": self.model_name, "weight_hash": self.lm.weight_hash, "version": self.weights["version"],
                "threshold": self.threshold, "features": self.weights["features"],
                "fit": self.weights.get("fit", {}), "offline": self.hybrid.offline.name}

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        inputs = list(inputs)
        rows, offline = feature_rows(self.hybrid, inputs)
        probs = dict(zip([i.record_id for i in inputs], predict_proba(self.weights, [rows[i.record_id]
                                                                                      for i in inputs])))
        for inp in inputs:
            rid = inp.record_id
            p, off, row = probs[rid], offline[rid], rows[rid]
            label = verdict(p, self.threshold, off.label, row)
            self.hybrid.stats["judged"] += 1
            why = (f"P(genuine) {p:.3f} (threshold {self.threshold:.3f}); offline {off.label}; "
                   f"PMI {row['pmi']:+.3f}; voice {row['voice']:+.3f}")
            yield LabelRecord(record_id=rid, label=label, genuine=is_genuine(label), rationale=why, judge=self.name,
                              probs={GENUINE: round(p, 6), "pmi": round(row["pmi"], 6),
                                     "voice": round(row["voice"], 6)})

    def label(self, inp: JudgeInput) -> LabelRecord:
        return next(self.label_many([inp]))
