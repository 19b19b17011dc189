"""Linear probes on synthetic data with a planted direction: signal found, controls at chance, no leakage."""

from __future__ import annotations

import numpy as np
import pytest

from mechprobe.probes import (
    InsufficientPositives,
    controls,
    directions,
    grouped_bootstrap,
    make_folds,
    multiclass_confusion,
    probe_layers,
    transfer_matrix,
)


def synth(n_items=60, per_item=4, d=24, n_layers=3, signal_layer=2, seed=0):
    """Items share one state (like samples of a prompt); labels are drawn from a planted direction."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(d)
    states = rng.standard_normal((n_items, n_layers, d))
    logit = 3.0 * states[:, signal_layer] @ w / np.linalg.norm(w) - 1.0
    p = 1 / (1 + np.exp(-logit))
    rows, y, groups = [], [], []
    for i in range(n_items):
        for _ in range(per_item):
            rows.append(states[i])
            y.append(int(rng.random() < p[i]))
            groups.append(f"item-{i}")
    return np.asarray(rows), np.asarray(y), np.asarray(groups), w


def test_folds_are_grouped_and_stratified():
    x, y, g, _ = synth()
    folds = make_folds(y, g, n_splits=5)
    seen = []
    for tr, te in folds:
        assert not set(g[tr]) & set(g[te])
        assert 0 < y[te].sum() < len(te)
        seen.extend(te.tolist())
    assert sorted(seen) == list(range(len(y)))


def test_planted_signal_found_at_its_layer_and_not_elsewhere():
    x, y, g, w = synth()
    res, folds = probe_layers(x, [0, 1, 2], y, g, n_boot=100, progress=False)
    by = {r.layer: r for r in res}
    assert by[2].logreg_auroc.value > 0.8 and by[2].dom_auroc.value > 0.8
    assert by[2].logreg_auroc.lo > 0.65
    assert abs(by[0].logreg_auroc.value - 0.5) < 0.15
    ctrl = controls(x, [0, 1, 2], 2, y, g, folds, texts=[f"text {i % 7}" for i in range(len(y))], n_boot=100)
    assert abs(ctrl["shuffled_labels"].value - 0.5) < 0.15
    assert abs(ctrl["text_baseline"].value - 0.5) < 0.15
    assert ctrl["random_direction"].value < by[2].logreg_auroc.value
    d = directions(x[:, [2]], [2], y)
    cos = d["probe_2"] @ w / (np.linalg.norm(d["probe_2"]) * np.linalg.norm(w))
    assert cos > 0.7  # the saved direction points along the planted one


def test_text_baseline_can_win_when_labels_are_in_the_text():
    x, y, g, _ = synth()
    texts = ["yes please follow" if v else "no thanks" for v in y]
    folds = make_folds(y, g)
    ctrl = controls(x, [0, 1, 2], 2, y, g, folds, texts, n_boot=50)
    assert ctrl["text_baseline"].value > 0.95


def test_too_few_positives_stops():
    x, y, g, _ = synth()
    y2 = np.zeros_like(y)
    y2[:3] = 1
    with pytest.raises(InsufficientPositives, match="positive rows"):
        make_folds(y2, g)


def test_grouped_bootstrap_is_honest_about_repeated_rows():
    """40 items, each repeated 10 times (like samples sharing one boundary state): resampling rows
    pretends there are 400 independent examples; resampling items gives the wider, honest CI."""
    rng = np.random.default_rng(1)
    y_item = rng.integers(0, 2, 40)
    s_item = y_item + 1.5 * rng.standard_normal(40)
    y, s = np.repeat(y_item, 10), np.repeat(s_item, 10)
    items = np.repeat(np.arange(40), 10).astype(str)
    by_item = grouped_bootstrap(y, s, items, n_boot=300)
    by_row = grouped_bootstrap(y, s, np.arange(400).astype(str), n_boot=300)
    assert by_item.lo <= by_item.value <= by_item.hi
    assert by_item.value == by_row.value
    assert (by_item.hi - by_item.lo) > 2 * (by_row.hi - by_row.lo)


def test_multiclass_and_transfer():
    x, y, g, _ = synth()
    labels = np.where(y == 1, "genuine_followup", np.where(x[:, 1, 0] > 0, "new_query", "prompt_restatement"))
    folds = make_folds(y, g)
    mc = multiclass_confusion(x[:, 2], labels, g, folds)
    assert mc["labels"] == sorted(set(labels)) and np.asarray(mc["confusion"]).sum() == len(y)
    ds = np.where(np.arange(len(y)) % 2 == 0, "gsm8k", "mt_bench")
    tm = transfer_matrix(x[:, 2], y, ds)
    assert tm["auroc"][0][0] is None and tm["auroc"][0][1] > 0.75
