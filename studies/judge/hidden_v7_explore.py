"""The exploration that chose hidden-v7's features (studies/judge/hidden_v7_fit.json), kept so it can be rerun.

    python studies/judge/hidden_v7_explore.py base diff only

On the hidden-v6 pool (every labelled turn outside fresh test v6; v6 and v7 are never read), the unchanged pool
selection (:func:`mechprobe.judges.hidden_cv.fit_hidden_heads_cv`) of three feature variants of the 0.5B reader:

- ``base``: [last token, turn mean] of the reader prompt with the answer (hidden-v1..v6);
- ``diff``: ``base`` and ``base`` minus the same rows of the prompt whose answer is hidden;
- ``only``: the difference alone.

Why the difference: a turn that reacts to the answer is read differently once the answer is gone; a turn that fits
any answer is not. Features come from the reader caches under ``runs/judge_eval`` (computed where missing). Each
variant's summary is printed as JSON (``studies/judge/hidden_v7_explore.json`` holds the committed run's).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from mechprobe.audit.blind_sets import load_blind_sets
from mechprobe.judges.base import load_judge_model
from mechprobe.judges.hidden_cv import fit_hidden_heads_cv, pool_turns
from mechprobe.judges.hidden_fit import cached_hidden_features
from mechprobe.judges.judge_eval import judge_inputs

READER = "qwen2.5-coder-0.5b-instruct"
LAYERS = (9, 12, 15)
HIDDEN_ANSWER = "(the answer is not shown)"


def main(variants: list[str]) -> None:
    blind = load_blind_sets(Path("."))
    held = frozenset({"judge_fresh_test_v6", "judge_fresh_test_v7"})
    pool = pool_turns(blind, held)
    inputs = {t: x for t, x in judge_inputs(blind).items() if t in set(pool)}
    lm = load_judge_model(READER)
    A = cached_hidden_features(lm, inputs, LAYERS, Path("runs/judge_eval"))
    hidden = {t: dataclasses.replace(x, response=HIDDEN_ANSWER) for t, x in inputs.items()}
    N = cached_hidden_features(lm, hidden, LAYERS, Path("runs/judge_eval/noanswer"))
    for v in variants:
        if v == "base":
            feats = {L: {t: A[L][t] for t in pool} for L in LAYERS}
        elif v == "diff":
            feats = {L: {t: np.concatenate([A[L][t], A[L][t] - N[L][t]]) for t in pool} for L in LAYERS}
        elif v == "only":
            feats = {L: {t: A[L][t] - N[L][t] for t in pool} for L in LAYERS}
        else:
            raise SystemExit(f"unknown variant {v!r}: use base, diff or only")
        w, sel = fit_hidden_heads_cv(blind, feats, READER, held_out=held, progress=False)
        out: dict = {"variant": v, "pool": len(pool)}
        for h in ("strict", "lenient"):
            c = w["heads"][h]["chosen"]
            out[h] = {k: c[k] for k in ("layer", "target", "C", "cv_mean_kappa", "cv_kappa")}
            out[h]["threshold"] = w["heads"][h]["threshold"]
            out[h]["per_subject"] = c["per_subject"]["cv_kappa"]
        best: dict = {}
        for r in sel:
            if r["head"] == "strict" and (r["layer"] not in best or r["cv_mean_kappa"] > best[r["layer"]]["cv_mean_kappa"]):
                best[r["layer"]] = r
        out["strict_by_layer"] = {str(k): (round(r["cv_mean_kappa"], 3), r["target"], r["C"], r["threshold"],
                                           {m[:20]: round(x, 3) for m, x in r["cv_kappa"].items()})
                                  for k, r in best.items()}
        print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["base", "diff", "only"])
