"""The textfit judge (``--judge textfit``): weights, the logistic heads, verdicts, and the fit's selection rules."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mechprobe.audit.blind_sets import BlindLabel, BlindSets, BlindTurn, query_item_key, split_of_item
from mechprobe.errors import UsageError
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.factory import make_judge, spec_of_judge_name
from mechprobe.judges.judge_eval import _targets, fit_heads
from mechprobe.judges.textfit import (
    TEXTFIT_FEATURES,
    WEIGHTS_FORMAT,
    TextFitJudge,
    check_weights,
    head_proba,
    load_weights,
    weights_digest,
)
from mechprobe.taxonomy import GENUINE

N = len(TEXTFIT_FEATURES)


def _weights(coef, intercept=0.0, threshold=0.5, mean=None, scale=None, embed=False):
    w = {"format": WEIGHTS_FORMAT, "version": "test", "features": list(TEXTFIT_FEATURES), "embed": embed,
         "mean": mean or [0.0] * N, "scale": scale or [1.0] * N,
         "heads": {h: {"coef": list(coef), "intercept": intercept, "threshold": threshold} for h in ("lenient",
                                                                                                    "strict")}}
    w["weights_sha256"] = weights_digest(w)
    return w


def test_head_proba_equals_sklearn():
    """Oracle: sklearn's predict_proba of the same fitted model on the standardised matrix."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, N)) * 2 + 1
    y = (x[:, 3] > 1).astype(int)
    mean, scale = x.mean(0), x.std(0)
    m = LogisticRegression(C=0.5, max_iter=2000).fit((x - mean) / scale, y)
    w = _weights(m.coef_[0].tolist(), float(m.intercept_[0]), mean=mean.tolist(), scale=scale.tolist())
    got = head_proba(w, "strict", [dict(zip(TEXTFIT_FEATURES, r)) for r in x])
    np.testing.assert_allclose(got, m.predict_proba((x - mean) / scale)[:, 1], rtol=1e-9, atol=1e-12)


def test_edited_or_bad_weights_are_refused(tmp_path):
    w = _weights([0.0] * N)
    w["heads"]["strict"]["threshold"] = 0.2  # edited after the fit
    with pytest.raises(UsageError, match="weights_sha256"):
        check_weights(w, "w.json")
    bad = _weights([0.0] * N, threshold=1.5)
    with pytest.raises(UsageError, match="threshold"):
        check_weights(bad, "w.json")
    short = _weights([0.0] * (N - 1))
    with pytest.raises(UsageError, match="coef"):
        check_weights(short, "w.json")
    with pytest.raises(UsageError, match="not found"):
        load_weights(tmp_path / "none.json")


def test_package_weights_load_and_name_both_heads():
    w = load_weights()
    assert set(w["heads"]) == {"lenient", "strict"} and w["embed"] is True


def test_judge_decides_by_its_head_and_keeps_the_rules_failure_label(tmp_path):
    coef = [0.0] * N
    coef[TEXTFIT_FEATURES.index("question")] = 10.0  # a question mark decides
    p = tmp_path / "w.json"
    p.write_text(json.dumps(_weights(coef, intercept=-5.0)))
    judge = make_judge("textfit", weights=str(p))
    assert isinstance(judge, TextFitJudge) and judge.reading == "strict"
    a = JudgeInput("r1", "What is 12 * 7?", "12 * 7 = 84.", "Why 84 and not 74?<|im_end|>")
    b = JudgeInput("r2", "What is 12 * 7?", "12 * 7 = 84.", "Thanks!<|im_end|>")
    ra, rb = list(judge.label_many([a, b]))
    assert ra.label == GENUINE and ra.genuine and rb.label != GENUINE and not rb.genuine
    assert spec_of_judge_name(ra.judge) == "textfit"
    with pytest.raises(UsageError, match="reading"):
        TextFitJudge("loose", weights=p)


def _blind(n_items: int = 80) -> tuple[BlindSets, dict[str, dict[str, float]]]:
    """Synthetic turns of two models: a turn is genuine (both labellers) exactly when its 'question' feature is 1."""
    turns, labels, feats = {}, [], {}
    for i in range(n_items):
        for model in ("m-a", "m-b"):
            q = f"query {i}"
            tid = f"t{i}{model}"
            genuine = i % 3 == 0
            arm = "answer_removed" if i % 9 == 3 else "greedy"
            turns[tid] = BlindTurn(tid, "toy", model, "gsm8k", query_item_key(q), arm, q, "answer", "turn")
            for who in ("labeller-a", "labeller-b"):
                lab = GENUINE if genuine or arm == "answer_removed" else "new_query"
                labels.append(BlindLabel(tid, "toy", "v2", who, lab, "yes" if lab == GENUINE else None, False))
            feats[tid] = {n: 0.0 for n in TEXTFIT_FEATURES} | {"question": float(genuine),
                                                               "log_words": float(i % 5)}
    return BlindSets(turns, labels, []), feats


def test_fit_chooses_on_dev_and_answer_removed_turns_are_hard_negatives():
    blind, feats = _blind()
    targets = _targets(blind)
    removed = [t for t, x in blind.turns.items() if x.arm == "answer_removed"]
    assert removed and all(targets["strict"][t] is False for t in removed)  # labelled genuine, trained as not
    w, selection = fit_heads(blind, feats)
    check_weights(w, "fit")
    assert selection and all("dev_mean_kappa" in r for r in selection)
    # the chosen strict head separates the dev turns (genuine = question) perfectly
    dev = [t for t, x in blind.turns.items() if split_of_item(x.item) == "dev" and x.arm != "answer_removed"]
    assert dev
    p = head_proba(w, "strict", [feats[t] for t in dev])
    thr = w["heads"]["strict"]["threshold"]
    assert [pp >= thr for pp in p] == [feats[t]["question"] == 1.0 for t in dev]
    assert w["heads"]["strict"]["chosen"]["dev_mean_kappa"] == pytest.approx(1.0)


def test_fit_refuses_when_dev_holds_no_positive():
    blind, feats = _blind()
    no_pos = [lab if split_of_item(blind.turns[lab.turn_id].item) != "dev" else
              BlindLabel(lab.turn_id, lab.source, lab.codebook, lab.labeller, "new_query", None, False)
              for lab in blind.labels]
    with pytest.raises(UsageError, match="nothing to choose"):
        fit_heads(BlindSets(blind.turns, no_pos, []), feats)
