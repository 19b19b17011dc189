"""A tampered trained-judge weights file is refused on load, with one line naming the file and the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mechprobe.errors import UsageError
from mechprobe.judges.trained import load_weights, predict_proba, weights_digest
from tests.conftest import REPO

PACKAGE_WEIGHTS = REPO / "mechprobe" / "data" / "trained_judge.json"


def _write(tmp_path: Path, d: dict, text: str | None = None) -> Path:
    p = tmp_path / "w.json"
    p.write_text(text if text is not None else json.dumps(d), encoding="utf-8")
    return p


@pytest.fixture
def weights() -> dict:
    return json.loads(PACKAGE_WEIGHTS.read_text(encoding="utf-8"))


def test_package_weights_load_and_match_their_digest(weights):
    assert load_weights() == weights
    assert weights["weights_sha256"] == weights_digest(weights)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["coef"].__setitem__(3, math.nan), "coef"),
    (lambda d: d.__setitem__("intercept", math.nan), "intercept"),
    (lambda d: d.__setitem__("intercept", math.inf), "intercept"),
    (lambda d: d.__setitem__("coef", d["coef"][:-2]), "coef"),
    (lambda d: d.__setitem__("mean", d["mean"] + [0.0]), "mean"),
    (lambda d: d.__setitem__("threshold", -1), "threshold"),
    (lambda d: d.__setitem__("threshold", 1.5), "threshold"),
    (lambda d: d["scale"].__setitem__(0, 0), "scale"),
    (lambda d: d["scale"].__setitem__(0, -2.0), "scale"),
    (lambda d: d["coef"].__setitem__(0, "1.0"), "coef"),
    (lambda d: d["features"].__setitem__(0, "no_such_feature"), "features"),
])
def test_tampered_numbers_are_refused(tmp_path, weights, edit, match):
    weights.pop("weights_sha256")  # each check must hold on its own, without the digest
    edit(weights)
    p = _write(tmp_path, weights, json.dumps(weights))  # json writes NaN / Infinity literals
    with pytest.raises(UsageError, match=match) as e:
        load_weights(p)
    msg = str(e.value)
    assert str(p) in msg and "mechprobe judges fit" in msg and "\n" not in msg


def test_nan_weights_would_otherwise_call_every_turn_genuine(weights):
    """Why the check matters: the clamped logit turns a NaN intercept into P(genuine) = 1 for any row."""
    weights["intercept"] = math.nan
    row = dict.fromkeys(weights["features"], 0.0)
    assert predict_proba(weights, [row])[0] == pytest.approx(1.0)


def test_edited_value_breaks_the_recorded_digest(tmp_path, weights):
    weights["coef"][0] += 0.5
    with pytest.raises(UsageError, match="weights_sha256"):
        load_weights(_write(tmp_path, weights))
    del weights["weights_sha256"]  # a file with no digest is checked on its values alone
    assert load_weights(_write(tmp_path, weights))["coef"][0] == weights["coef"][0]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\udcff"])
def test_not_a_weights_object(tmp_path, text):
    p = tmp_path / "w.json"
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(UsageError, match="w.json"):
        load_weights(p)
