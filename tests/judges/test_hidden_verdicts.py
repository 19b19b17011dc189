"""The hidden-state judge's verdict files per weights version (:mod:`mechprobe.judges.hidden_verdicts`): the current
fit's file is rewritten from its weights, an archived fit's committed rows never move and it gains verdicts on the
turns it lacks, a pool fit never scores its own pool, and the reader reads only the turns some version needs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mechprobe.audit.blind_sets import BlindLabel, BlindSets, BlindTurn, query_item_key
from mechprobe.audit.judge_table import hidden_verdicts_file
from mechprobe.judges import hidden_verdicts as hv
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.hidden import WEIGHTS_FORMAT, weights_digest
from mechprobe.taxonomy import GENUINE

READER = "toy-reader"


def _weights(version: str, sign: float, pool: bool = False, layer: int = 3) -> dict:
    d = 4
    w = {"format": WEIGHTS_FORMAT, "version": version, "reader": READER, "layer": layer, "mean": [0.0] * d,
         "scale": [1.0] * d, "heads": {h: {"coef": [sign * 10.0, 0.0, 0.0, 0.0], "intercept": 0.0, "threshold": 0.5}
                                       for h in ("lenient", "strict")}}
    if pool:
        w["fit"] = {"protocol": "pool", "held_out_sources": ["fresh"]}
    w["weights_sha256"] = weights_digest(w)
    return w


def _blind() -> tuple[BlindSets, dict[str, JudgeInput], dict[str, np.ndarray]]:
    turns, labels, inputs, feats = {}, [], {}, {}
    for i in range(12):
        src = "fresh" if i >= 8 else "old"
        q, tid = f"query {i}", f"t{i:02d}"
        turns[tid] = BlindTurn(tid, src, "m", "gsm8k", query_item_key(q), "greedy", q, "answer", "turn")
        for who in ("labeller-a", "labeller-b"):
            labels.append(BlindLabel(tid, src, "v2", who, GENUINE, "yes", False))
        inputs[tid] = JudgeInput(tid, q, "answer", "turn")
        feats[tid] = np.array([1.0 if i % 2 else -1.0, 0.0, 0.0, 0.0])
    return BlindSets(turns, labels, []), inputs, feats


class _LM:
    name = READER


@pytest.fixture
def fake_features(monkeypatch):
    """Features from a table; records which turns the reader was asked to read."""
    asked: list[list[str]] = []

    def cached(lm, inputs, layers, cache, **_):
        asked.append(sorted(inputs))
        return {r: {t: FEATS[t] for t in inputs} for r in layers}

    monkeypatch.setattr(hv, "cached_hidden_features", cached)
    return asked


_, _, FEATS = _blind()


def _rows(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_archived_fit_keeps_its_rows_and_gains_the_turns_it_lacks(tmp_path, fake_features):
    blind, inputs, _ = _blind()
    old, new = _weights("hidden-v1", +1.0), _weights("hidden-v2", -1.0, pool=True)
    old_file = tmp_path / hidden_verdicts_file(READER, "hidden-v1")
    old_file.parent.mkdir(parents=True)
    # v1's committed verdicts on the old turns, deliberately all False: they must survive unchanged
    committed = [{"turn_id": f"t{i:02d}", "judge": f"hidden:{READER}", "reading": r, "genuine": False}
                 for r in ("lenient", "strict") for i in range(8)]
    old_file.write_text("".join(json.dumps(r) + "\n" for r in committed), encoding="utf-8")

    written = hv.write_hidden_verdicts(_LM(), new, [old], blind, inputs, tmp_path, tmp_path / "cache")

    new_file = tmp_path / hidden_verdicts_file(READER, "hidden-v2")
    assert written == [new_file, old_file]
    # the reader read only the fresh turns (v2 scores only them; v1 lacks only them), once
    assert fake_features == [[f"t{i:02d}" for i in range(8, 12)]]
    v1 = _rows(old_file)
    assert v1[:16] == committed and len(v1) == 24
    assert {r["turn_id"]: r["genuine"] for r in v1[16:] if r["reading"] == "strict"} == \
        {f"t{i:02d}": bool(i % 2) for i in range(8, 12)}
    v2 = _rows(new_file)
    assert {r["turn_id"] for r in v2} == {f"t{i:02d}" for i in range(8, 12)}  # never its own pool
    assert all(r["judge"] == f"hidden:{READER}@hidden-v2" for r in v2)
    assert {r["turn_id"]: r["genuine"] for r in v2 if r["reading"] == "lenient"} == \
        {f"t{i:02d}": not bool(i % 2) for i in range(8, 12)}

    # a rerun reads nothing and moves nothing
    before = (new_file.read_text(), old_file.read_text())
    hv.write_hidden_verdicts(_LM(), new, [old], blind, inputs, tmp_path, tmp_path / "cache")
    assert (new_file.read_text(), old_file.read_text()) == before and len(fake_features) == 1


def test_committed_rows_of_the_current_fit_stay_unless_it_was_just_refit(tmp_path, fake_features):
    """A committed verdict is what was scored (another CPU may flip a turn near its threshold): kept; a refit
    rewrites its own file from its new weights."""
    blind, inputs, _ = _blind()
    new = _weights("hidden-v2", -1.0, pool=True)
    path = tmp_path / hidden_verdicts_file(READER, "hidden-v2")
    path.parent.mkdir(parents=True)
    flipped = {"turn_id": "t08", "judge": f"hidden:{READER}@hidden-v2", "reading": "lenient", "genuine": False}
    path.write_text(json.dumps(flipped) + "\n", encoding="utf-8")  # one head only: t08 is scored again
    hv.write_hidden_verdicts(_LM(), new, [], blind, inputs, tmp_path, tmp_path / "cache")
    assert fake_features == [[f"t{i:02d}" for i in range(8, 12)]] and len(_rows(path)) == 8
    path.write_text("".join(json.dumps({**flipped, "reading": r}) + "\n" for r in ("lenient", "strict")),
                    encoding="utf-8")
    hv.write_hidden_verdicts(_LM(), new, [], blind, inputs, tmp_path, tmp_path / "cache")
    rows = _rows(path)
    assert rows[0] == flipped and len(rows) == 8  # t08 kept as committed (both heads); the other 3 turns added
    assert fake_features[-1] == [f"t{i:02d}" for i in range(9, 12)]
    hv.write_hidden_verdicts(_LM(), new, [], blind, inputs, tmp_path, tmp_path / "cache", refit=True)
    assert {(r["turn_id"], r["reading"]): r["genuine"] for r in _rows(path)}[("t08", "lenient")] is True


def test_split_fit_scores_every_turn_and_archived_weights_are_found_by_reader(tmp_path):
    blind, inputs, _ = _blind()
    assert hv.turns_to_score(_weights("hidden-v1", 1.0), blind, inputs) == sorted(inputs)
    assert hv.turns_to_score(_weights("hidden-v2", 1.0, pool=True), blind, inputs) == \
        [f"t{i:02d}" for i in range(8, 12)]
    arch = tmp_path / "weights"
    arch.mkdir()
    v1, v2 = _weights("hidden-v1", 1.0), _weights("hidden-v2", -1.0, pool=True)
    for w in (v1, v2):
        (arch / f"hidden_{READER}_{w['version']}.json").write_text(json.dumps(w), encoding="utf-8")
    (arch / "textfit-v1.json").write_text("{}", encoding="utf-8")  # another judge's archive: not read
    assert [w["version"] for w in hv.archived_hidden_weights(arch, READER, v2)] == ["hidden-v1"]
    assert hv.archived_hidden_weights(arch, "other-reader", v2) == []


def test_a_test_set_added_after_a_pool_fit_is_scored_by_it_at_each_subjects_threshold(tmp_path):
    """A pool fit held out ``fresh``; a set held out later (``newer``) was never in its pool, so it scores it too.
    A head's per-subject threshold decides the turns of that subject model."""
    blind, inputs, feats = _blind()
    turns = dict(blind.turns)
    for i in range(12, 14):
        q, tid = f"query {i}", f"t{i:02d}"
        turns[tid] = BlindTurn(tid, "newer", "m2", "gsm8k", query_item_key(q), "greedy", q, "answer", "turn")
        inputs[tid] = JudgeInput(tid, q, "answer", "turn", subject="m2")
        feats[tid] = np.array([1.0, 0.0, 0.0, 0.0])
    blind = BlindSets(turns, blind.labels, [])
    v2 = _weights("hidden-v2", 1.0, pool=True)
    assert hv.turns_to_score(v2, blind, inputs, held_now=frozenset()) == [f"t{i:02d}" for i in range(8, 12)]
    assert hv.turns_to_score(v2, blind, inputs, held_now=frozenset({"newer"})) == \
        [f"t{i:02d}" for i in range(8, 14)]
    w = _weights("hidden-v3", 1.0, pool=True)
    w["heads"]["strict"]["thresholds"] = {"m2": 0.99999}  # P = sigmoid(10) < this: m2's turns are not genuine
    rows = hv.verdict_rows(w, feats, ["t09", "t12"], {"t09": "m", "t12": "m2"})
    got = {(r["turn_id"], r["reading"]): r["genuine"] for r in rows}
    assert got == {("t09", "lenient"): True, ("t12", "lenient"): True, ("t09", "strict"): True,
                   ("t12", "strict"): False}


def test_fits_of_two_feature_kinds_on_one_layer_each_read_their_own_rows(tmp_path, monkeypatch):
    """An answer-contrast fit (hidden-v7 on) and a turn fit at the same layer: the reader is asked once per kind, and
    each fit's head reads rows of its own width (a turn fit given contrast rows would fail on the shapes)."""
    blind, inputs, _ = _blind()
    asked: list[tuple[str, list[str]]] = []

    def cached(lm, inputs, layers, cache, kind="turn", **_):
        asked.append((kind, sorted(inputs)))
        rows = {t: FEATS[t] if kind == "turn" else np.r_[FEATS[t], -FEATS[t]] for t in inputs}
        return {r: rows for r in layers}

    monkeypatch.setattr(hv, "cached_hidden_features", cached)
    turn_fit = _weights("hidden-v1", +1.0)
    d = 8
    contrast = {"format": WEIGHTS_FORMAT, "version": "hidden-v7", "reader": READER, "layer": 3, "mean": [0.0] * d,
                "scale": [1.0] * d, "features": "answer-contrast",
                "heads": {h: {"coef": [0.0] * 4 + [10.0, 0.0, 0.0, 0.0], "intercept": 0.0, "threshold": 0.5}
                          for h in ("lenient", "strict")}}
    contrast["weights_sha256"] = weights_digest(contrast)
    (tmp_path / hidden_verdicts_file(READER, "hidden-v7")).parent.mkdir(parents=True)
    hv.write_hidden_verdicts(_LM(), contrast, [turn_fit], blind, inputs, tmp_path, tmp_path / "cache")
    assert sorted(k for k, _ in asked) == ["answer-contrast", "turn"]
    v7 = _rows(tmp_path / hidden_verdicts_file(READER, "hidden-v7"))
    v1 = _rows(tmp_path / hidden_verdicts_file(READER, "hidden-v1"))
    # the contrast head reads the second half (-x): the opposite verdicts of the turn head, which reads x
    assert {r["turn_id"]: r["genuine"] for r in v7 if r["reading"] == "strict"} == \
        {f"t{i:02d}": not bool(i % 2) for i in range(12)}
    assert {r["turn_id"]: r["genuine"] for r in v1 if r["reading"] == "strict"} == \
        {f"t{i:02d}": bool(i % 2) for i in range(12)}
