"""The hidden-state judge's pool protocol (:mod:`mechprobe.judges.hidden_cv`): the pool leaves out the held-out
sources and every item they hold, cross-validation chooses the layer that carries the label, and nothing of a
held-out turn (features or labels) moves the fit."""

from __future__ import annotations

import numpy as np
import pytest

from mechprobe.audit.blind_sets import SOURCES, BlindLabel, BlindSets, BlindTurn, query_item_key
from mechprobe.errors import UsageError
from mechprobe.judges.hidden import check_weights, head_threshold, hidden_head_proba
from mechprobe.judges.hidden_cv import (
    FOLDS,
    PER_SUBJECT_MARGIN,
    VERSION,
    fit_hidden_heads_cv,
    fold_of_item,
    held_out_sources,
    pool_turns,
)
from mechprobe.taxonomy import GENUINE


def _blind(n_items: int = 90, d: int = 6, held_items: int = 15):
    """Two subject models; turn genuine (both labellers, strict yes) when i % 3 == 0; layer 5's first feature says
    so, layer 9 is noise. The last ``held_items`` items are in a held-out source ``fresh``; one pool turn shares
    an item (its query) with a held-out turn."""
    rng = np.random.default_rng(0)
    turns, labels, f5, f9 = {}, [], {}, {}
    for i in range(n_items):
        for model in ("m-a", "m-b"):
            q, tid = f"query {i}", f"t{i}{model}"
            src = "fresh" if i >= n_items - held_items else "pool"
            genuine = i % 3 == 0
            turns[tid] = BlindTurn(tid, src, model, "gsm8k", query_item_key(q), "greedy", q, "answer", "turn")
            for who in ("labeller-a", "labeller-b"):
                labels.append(BlindLabel(tid, src, "v2", who, GENUINE if genuine else "new_query",
                                         "yes" if genuine else None, False))
            f5[tid] = np.r_[float(genuine) * 3, rng.normal(size=d - 1)]
            f9[tid] = rng.normal(size=d)
    # a pool-source turn on a held-out item (the same query under another id): never in the pool
    q = f"query {n_items - 1}"
    turns["leak"] = BlindTurn("leak", "pool", "m-a", "gsm8k", query_item_key(q), "greedy", q, "answer", "other turn")
    f5["leak"], f9["leak"] = rng.normal(size=d), rng.normal(size=d)
    return BlindSets(turns, labels, []), {5: f5, 9: f9}


def test_the_fresh_v7_set_is_the_held_out_test():
    # studies/judge/hidden_v7_fit.json: fresh v6 is pooled, fresh v7 tests the fit
    held = {"judge_fresh_test_v7"}
    assert held_out_sources() == held
    assert all(s.fit for s in SOURCES if s.name not in held)


def test_pool_leaves_out_held_out_sources_and_their_items():
    blind, _ = _blind()
    pool = pool_turns(blind, frozenset({"fresh"}))
    assert "leak" not in pool
    assert all(blind.turns[t].source == "pool" for t in pool)
    assert len(pool) == 2 * 75


def test_folds_are_by_item_and_deterministic():
    items = [query_item_key(f"query {i}") for i in range(200)]
    f = [fold_of_item(x) for x in items]
    assert f == [fold_of_item(x) for x in items] and set(f) == set(range(FOLDS))


def test_cv_chooses_the_informative_layer_and_ignores_held_out_turns():
    blind, feats = _blind()
    w, selection = fit_hidden_heads_cv(blind, feats, "toy-reader", held_out=frozenset({"fresh"}), progress=False)
    check_weights(w, "fit")
    assert w["version"] == VERSION and w["layer"] == 5 and w["fit"]["protocol"] == "pool"
    assert w["fit"]["pool_turns"] == 150 and w["fit"]["held_out_sources"] == ["fresh"]
    assert {r["layer"] for r in selection} == {5, 9}
    best = max((r for r in selection if r["head"] == "strict"), key=lambda r: r["cv_mean_kappa"])
    assert best["layer"] == 5 and best["cv_mean_kappa"] > 0.9 and set(best["cv_kappa"]) == {"m-a", "m-b"}
    held = [t for t, x in blind.turns.items() if x.source == "fresh"]
    p = hidden_head_proba(w, "strict", np.stack([feats[5][t] for t in held]))
    assert [bool(x >= w["heads"]["strict"]["threshold"]) for x in p] == [feats[5][t][0] > 0 for t in held]
    # held-out turns never decide: scrambling their features and flipping their labels leaves the fit unchanged
    scrambled = {r: {t: (v[::-1] if t in held or t == "leak" else v) for t, v in f.items()} for r, f in feats.items()}
    flipped = BlindSets(blind.turns, [BlindLabel(x.turn_id, x.source, x.codebook, x.labeller,
                                                 "new_query" if x.label == GENUINE else GENUINE,
                                                 None if x.label == GENUINE else "yes", x.borderline)
                                      if x.source == "fresh" else x for x in blind.labels], [])
    w2, _ = fit_hidden_heads_cv(flipped, scrambled, "toy-reader", held_out=frozenset({"fresh"}), progress=False)
    assert w2["weights_sha256"] == w["weights_sha256"]
    # one threshold already separates both models: per-model thresholds gain nothing and are not kept
    per = w["heads"]["strict"]["chosen"]["per_subject"]
    assert per["kept"] is False and per["gain"] < PER_SUBJECT_MARGIN and "thresholds" not in w["heads"]["strict"]


def test_per_subject_thresholds_are_kept_where_one_threshold_cannot_serve_both_models():
    """m-a's turns sit high on the signal (genuine 4, other 2), m-b's low (genuine 1, other -1): no single
    threshold separates both, one per model does; held-out turns are then judged right at their model's."""
    rng = np.random.default_rng(1)
    turns, labels, f5 = {}, [], {}
    for i in range(120):
        for model, (pos, neg) in (("m-a", (4.0, 2.0)), ("m-b", (1.0, -1.0))):
            q, tid = f"query {i}", f"t{i}{model}"
            src = "fresh" if i >= 100 else "pool"
            genuine = i % 3 == 0
            turns[tid] = BlindTurn(tid, src, model, "gsm8k", query_item_key(q), "greedy", q, "answer", "turn")
            for who in ("labeller-a", "labeller-b"):
                labels.append(BlindLabel(tid, src, "v2", who, GENUINE if genuine else "new_query",
                                         "yes" if genuine else None, False))
            f5[tid] = np.r_[(pos if genuine else neg) + rng.normal(scale=0.1), rng.normal(size=3)]
    blind = BlindSets(turns, labels, [])
    w, _ = fit_hidden_heads_cv(blind, {5: f5}, "toy-reader", held_out=frozenset({"fresh"}), progress=False)
    check_weights(w, "fit")
    per = w["heads"]["strict"]["chosen"]["per_subject"]
    assert per["kept"] is True and per["gain"] >= PER_SUBJECT_MARGIN
    thr = w["heads"]["strict"]["thresholds"]
    assert set(thr) == {"m-a", "m-b"} and thr["m-a"] != thr["m-b"]
    held = [t for t, x in turns.items() if x.source == "fresh"]
    p = hidden_head_proba(w, "strict", np.stack([f5[t] for t in held]))
    got = [bool(x >= head_threshold(w, "strict", turns[t].model)) for t, x in zip(held, p)]
    assert got == [int(turns[t].query.split()[1]) % 3 == 0 for t in held]
    one = [bool(x >= head_threshold(w, "strict")) for x in p]  # the global threshold alone errs on one model
    assert one != got


def test_a_pool_turn_without_features_is_named():
    blind, feats = _blind()
    del feats[9]["t0m-a"]
    with pytest.raises(UsageError, match="layer 9: no reader features for 1 pool turns"):
        fit_hidden_heads_cv(blind, feats, "toy-reader", held_out=frozenset({"fresh"}), progress=False)
