"""The trained judge (``--judge trained:MODEL``): features, the logistic model, weights files, the spec."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mechprobe.errors import UsageError
from mechprobe.io import read_jsonl
from mechprobe.judges.base import JudgeInput, inputs_from_rows
from mechprobe.judges.factory import check_judge_spec, make_judge, spec_of_judge_name
from mechprobe.judges.offline import OfflineJudge
from mechprobe.judges.trained import WEIGHTS_FORMAT, TrainedJudge, feature_rows, load_weights, predict_proba
from mechprobe.judges.turn_features import FEATURE_NAMES, TEXT_FEATURES, text_features, vector
from mechprobe.taxonomy import GENUINE, LABELS
from tests.conftest import REPO, requires_smollm2

FIXTURE = REPO / "tests" / "fixtures" / "hand_labels.jsonl"


def _weights(coef: list[float], mean=None, scale=None, intercept=0.0, threshold=0.5, model="smollm2-135m-instruct"):
    n = len(FEATURE_NAMES)
    return {"format": WEIGHTS_FORMAT, "version": "test", "scoring_model": model, "threshold": threshold,
            "features": list(FEATURE_NAMES), "coef": coef, "intercept": intercept,
            "mean": mean or [0.0] * n, "scale": scale or [1.0] * n}


def test_predict_proba_equals_sklearn_on_standardised_features():
    """Oracle: sklearn's own predict_proba of the fitted model on the standardised matrix."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, len(FEATURE_NAMES))) * rng.uniform(0.5, 3, len(FEATURE_NAMES)) + 2
    y = (x[:, 0] + rng.normal(size=60) > 2).astype(int)
    mean, scale = x.mean(0), x.std(0)
    m = LogisticRegression(C=0.3, max_iter=2000).fit((x - mean) / scale, y)
    w = _weights(m.coef_[0].tolist(), mean.tolist(), scale.tolist(), float(m.intercept_[0]))
    rows = [dict(zip(FEATURE_NAMES, r)) for r in x]
    np.testing.assert_allclose(predict_proba(w, rows), m.predict_proba((x - mean) / scale)[:, 1], rtol=1e-9)


def test_text_features_read_the_codebook_cues():
    off = OfflineJudge(embed=False)
    q, a = "Natalia sold 48 clips in April and half as many in May. How many in total?", "48 + 24 = 72 clips."
    f = {t: text_features(inp, off.label(inp)) for t, inp in {
        "challenge": JudgeInput("r1", q, a, "Why is May 24 and not 96?<|im_end|>"),
        "assistant": JudgeInput("r2", q, a, "Let's solve this step by step. The answer is 72.<|im_end|>"),
        "thanks": JudgeInput("r3", q, a, "Thanks!<|im_end|>")}.items()}
    assert set(f["challenge"]) == set(TEXT_FEATURES)
    assert f["challenge"]["question"] == 1 and f["challenge"]["challenge_word"] == 1
    assert f["challenge"]["resp_only_items"] > 0  # "24" is the answer's, not the query's
    assert f["assistant"]["assistant_phrase"] == 1 and f["assistant"]["question"] == 0
    assert f["thanks"]["ack_opening"] == 1 and f["thanks"]["log_words"] < f["challenge"]["log_words"]
    assert sum(v for k, v in f["thanks"].items() if k.startswith("offline_")) == 1  # one-hot offline label


def test_weights_file_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_weights(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(UsageError, match="not a mechprobe-trained-judge-v1"):
        load_weights(bad)
    w = _weights([0.0] * len(FEATURE_NAMES))
    w["features"] = w["features"][:-1]
    with pytest.raises(KeyError):
        vector({k: 0.0 for k in w["features"]}, FEATURE_NAMES)


def test_spec_round_trip_and_errors():
    assert spec_of_judge_name("trained:qwen2.5-coder-1.5b-instruct@trained-v1+offline-v3+minilm") == \
        "trained:qwen2.5-coder-1.5b-instruct"
    with pytest.raises(UsageError, match="trained:MODEL needs"):
        make_judge("trained:")
    with pytest.raises(UsageError, match="needs a model name"):
        check_judge_spec("trained:")


@requires_smollm2
def test_wrong_scoring_model_is_refused(tmp_path):
    p = tmp_path / "w.json"
    p.write_text(json.dumps(_weights([0.0] * len(FEATURE_NAMES), model="qwen2.5-coder-1.5b-instruct")))
    with pytest.raises(UsageError, match="fit with scoring model qwen2.5-coder-1.5b-instruct"):
        TrainedJudge("smollm2-135m-instruct", weights=p)


@requires_smollm2
@pytest.mark.slow
def test_trained_judge_labels_follow_its_probabilities(smol, tmp_path):
    """On the real embedded model: features equal the hybrid judge's own PMI for candidates, each label follows
    P(genuine) vs the threshold, and a weight on one feature moves exactly that feature's turns."""
    rows = [r for r in read_jsonl(FIXTURE) if r["split"] == "dev"][:12]
    inputs = inputs_from_rows(rows)
    coef = [0.0] * len(FEATURE_NAMES)
    coef[FEATURE_NAMES.index("question")] = 5.0  # P(genuine) high exactly for turns with a question mark
    p = tmp_path / "w.json"
    p.write_text(json.dumps(_weights(coef, intercept=-2.5)))
    j = TrainedJudge(loaded=smol, model="smollm2-135m-instruct", weights=p, cache_dir=tmp_path / "cache")
    recs = list(j.label_many(inputs))
    feats, offline = feature_rows(j.hybrid, inputs)
    assert [r.record_id for r in recs] == [i.record_id for i in inputs]
    for r in recs:
        f = feats[r.record_id]
        assert r.label in LABELS
        assert (r.label == GENUINE) == (f["question"] == 1.0)
        assert r.probs[GENUINE] == pytest.approx(predict_proba(j.weights, [f])[0], abs=1e-6)
        if r.label != GENUINE and offline[r.record_id].label != GENUINE:
            assert r.label == offline[r.record_id].label
    hyb = {r.record_id: r for r in j.hybrid.label_many(inputs)}  # same cache: PMIs shared with the features
    for rid, r in hyb.items():
        if "pmi" in r.probs:
            assert feats[rid]["pmi"] == pytest.approx(r.probs["pmi"], abs=1e-5)
