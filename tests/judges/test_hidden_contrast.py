"""The hidden-state judge's answer-contrast rows (``hidden-v7`` on): the turn's rows and their difference from the
same prompt read with the answer hidden; the weights name the kind, the judge reads what its weights name, and the
cache keeps both reads so a rerun reads nothing.

Oracle: :func:`~mechprobe.judges.hidden.hidden_features` (itself tested against HF ``output_hidden_states``) of the
turns and of their answer-hidden copies.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mechprobe.errors import UsageError
from mechprobe.judges import hidden_fit
from mechprobe.judges.hidden import (
    HIDDEN_ANSWER,
    WEIGHTS_FORMAT,
    HiddenStateJudge,
    answer_hidden,
    check_weights,
    feature_kind,
    hidden_features,
    hidden_head_proba,
    judge_features,
    reader_prompt,
    weights_digest,
    with_feature_kind,
)
from mechprobe.judges.hidden_fit import cached_hidden_features
from tests.judges.test_hidden import INPUTS


def _close(a, b):
    return np.allclose(a, b, rtol=1e-3, atol=1e-3)


def test_contrast_rows_are_the_turn_rows_and_their_difference_from_the_answer_hidden_read(smol):
    layer = 10
    a = hidden_features(smol, INPUTS, [layer])[layer]
    n = hidden_features(smol, [answer_hidden(i) for i in INPUTS], [layer])[layer]
    c = judge_features(smol, INPUTS, [layer], "answer-contrast")[layer]
    d = a.shape[1]
    assert c.shape == (len(INPUTS), 2 * d)
    assert _close(c[:, :d], a) and _close(c[:, d:], a - n)
    assert np.abs(c[:, d:]).max() > 1e-2  # hiding the answer changes what the reader reads
    assert _close(judge_features(smol, INPUTS, [layer])[layer], a)  # the default kind is the turn's rows
    tok = smol.tokenizer
    hidden = reader_prompt(tok, answer_hidden(INPUTS[1]))
    assert HIDDEN_ANSWER in tok.decode(hidden.ids) and INPUTS[1].response.strip() not in tok.decode(hidden.ids)
    assert tok.decode(hidden.ids[slice(*hidden.turn_span)]) == INPUTS[1].raw_text  # the same turn, as written
    with pytest.raises(UsageError, match="use one of turn, answer-contrast"):
        judge_features(smol, INPUTS, [layer], "contrast")


def _weights(d: int, coef=None, layer: int = 10) -> dict:
    w = {"format": WEIGHTS_FORMAT, "version": "test", "reader": "smollm2-135m-instruct", "layer": layer,
         "mean": [0.0] * d, "scale": [1.0] * d,
         "heads": {h: {"coef": list(coef if coef is not None else [0.0] * d), "intercept": 0.0, "threshold": 0.5}
                   for h in ("lenient", "strict")}}
    w["weights_sha256"] = weights_digest(w)
    return w


def test_the_kind_is_part_of_the_weights_and_their_digest():
    w = _weights(4)
    assert feature_kind(w) == "turn" and with_feature_kind(w, "turn") is w
    c = with_feature_kind(w, "answer-contrast")
    check_weights(c, "c.json")
    assert feature_kind(c) == "answer-contrast" and c["weights_sha256"] != w["weights_sha256"]
    assert "features" not in w and weights_digest(w) == w["weights_sha256"]  # a turn fit's digest is unchanged
    edited = {**c, "features": "turn"}  # a kind changed after the fit: its head would read other rows
    with pytest.raises(UsageError, match="weights_sha256"):
        check_weights(edited, "c.json")
    bad = {**w, "features": "bogus"}
    bad["weights_sha256"] = weights_digest(bad)
    with pytest.raises(UsageError, match="'features' must be one of turn, answer-contrast"):
        check_weights(bad, "b.json")


def test_judge_reads_the_rows_its_weights_name(smol, tmp_path):
    layer = 10
    rows = judge_features(smol, INPUTS, [layer], "answer-contrast")[layer]
    rng = np.random.default_rng(0)
    w = with_feature_kind(_weights(rows.shape[1], coef=(rng.normal(size=rows.shape[1]) * 0.05).tolist()),
                          "answer-contrast")
    p = tmp_path / "w.json"
    p.write_text(json.dumps(w))
    judge = HiddenStateJudge("smollm2-135m-instruct", weights=p, loaded=smol)
    got = judge.probabilities(INPUTS)
    assert np.allclose(got, hidden_head_proba(w, "strict", rows), atol=1e-3)
    assert judge.public_config()["features"] == "answer-contrast"


def test_contrast_rows_are_cached_in_two_reads_and_a_rerun_reads_nothing(smol, tmp_path, monkeypatch):
    inputs = {i.record_id: i for i in INPUTS}
    got = cached_hidden_features(smol, inputs, [10], tmp_path, batch_size=2, progress=False, kind="answer-contrast")
    assert list((tmp_path / f"hidden-{smol.name}").glob("batch-*.npz"))
    assert list((tmp_path / f"hidden-{smol.name}-answer-hidden").glob("batch-*.npz"))
    want = judge_features(smol, INPUTS, [10], "answer-contrast")[10]
    for j, t in enumerate(inputs):
        assert _close(got[10][t], want[j])

    def read(*_a, **_k):
        raise AssertionError("the reader ran although every row was cached")

    monkeypatch.setattr(hidden_fit, "hidden_features", read)
    again = cached_hidden_features(smol, inputs, [10], tmp_path, progress=False, kind="answer-contrast")
    assert all(np.array_equal(again[10][t], got[10][t]) for t in inputs)
    with pytest.raises(UsageError, match="use one of"):
        cached_hidden_features(smol, inputs, [10], tmp_path, kind="contrast")
