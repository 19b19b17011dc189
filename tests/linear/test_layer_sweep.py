"""Linear probes on synthetic data with a planted direction: signal found, controls at chance, no leakage.

Every synthetic set mimics a run: items share one boundary state across their sampled turns, labels are
drawn per row. The last tests run the experiment script on a real tiny run (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from mechprobe.linear.fit import (
    InsufficientPositives,
    auroc,
    grouped_bootstrap,
    make_folds,
    text_baseline_scores,
    weighted_auroc,
)
from mechprobe.linear.turn import (
    controls,
    directions,
    item_ceiling,
    modal_c,
    multiclass_confusion,
    oof_scores,
    shuffle_by_group,
    sweep_layers,
    transfer_matrix,
)
from tests.conftest import REPO, requires_smollm2


def synth(n_items=60, per_item=4, d=24, n_layers=3, signal_layer=2, scale=6.0, seed=0):
    """Items share one state (like samples of a prompt); labels are drawn from a planted direction."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(d)
    states = rng.standard_normal((n_items, n_layers, d))
    logit = scale * states[:, signal_layer] @ w / np.linalg.norm(w) - 1.0
    p = 1 / (1 + np.exp(-logit))
    rows, y, groups = [], [], []
    for i in range(n_items):
        for _ in range(per_item):
            rows.append(states[i])
            y.append(int(rng.random() < p[i]))
            groups.append(f"item-{i}")
    return np.asarray(rows), np.asarray(y), np.asarray(groups), w


@pytest.fixture(scope="module")
def planted():
    x, y, g, w = synth()
    greedy = np.zeros(len(y), bool)
    greedy[::4] = True  # first turn of every item plays the greedy one
    rep = sweep_layers(x, [0, 1, 2], y, g, greedy_mask=greedy, n_boot=200, n_random=50, progress=False)
    return x, y, g, w, rep


# ------------------------------------------------------------------ folds and leakage


def test_folds_are_grouped_and_stratified():
    x, y, g, _ = synth()
    folds = make_folds(y, g, n_splits=5)
    seen = []
    for tr, te in folds:
        assert not set(g[tr]) & set(g[te])
        assert y[te].sum() >= 2 and (1 - y[te]).sum() >= 1
        seen.extend(te.tolist())
    assert sorted(seen) == list(range(len(y)))


def test_grouping_prevents_leakage_that_row_splits_would_report():
    """Labels are per item and unrelated to any direction, but every row has identical twins. Row-level
    folds let the probe memorise twins (high AUROC: the test can fail); item-grouped folds do not."""
    from sklearn.model_selection import StratifiedKFold

    rng = np.random.default_rng(3)
    n_items, per, d = 40, 5, 200
    states = rng.standard_normal((n_items, d))
    y_item = rng.permutation(np.r_[np.ones(n_items // 2), np.zeros(n_items // 2)]).astype(int)
    x, y, g = np.repeat(states, per, 0), np.repeat(y_item, per), np.repeat(np.arange(n_items), per).astype(str)
    leaky = list(StratifiedKFold(5, shuffle=True, random_state=0).split(x, y))
    assert any(set(g[tr]) & set(g[te]) for tr, te in leaky)
    assert auroc(y, oof_scores(x, y, g, leaky, "logreg")) > 0.9
    grouped = make_folds(y, g)
    assert abs(auroc(y, oof_scores(x, y, g, grouped, "logreg")) - 0.5) < 0.2


# ------------------------------------------------------------------ the probe and its controls


def test_planted_signal_found_at_its_layer_and_not_elsewhere(planted):
    x, y, g, w, rep = planted
    sig, noise = rep.layer(2), rep.layer(0)
    assert sig.logreg_auroc.value > 0.9 and sig.logreg_auroc.lo > 0.8
    assert sig.dom_auroc.value > 0.85
    assert abs(noise.logreg_auroc.value - 0.5) < 0.15
    assert rep.best_layer == 2
    # nested selection picks the signal layer on the training items of every fold
    assert rep.nested["fold_layers"] == [2] * 5 and rep.nested["auroc"].value > 0.9
    # controls at the signal layer stay at chance; the ceiling bounds the probe
    assert abs(sig.shuffled_auroc.value - 0.5) < 0.15
    assert sig.random_dir_auroc.lo < 0.5 < sig.random_dir_auroc.hi
    assert sig.random_dir_auroc.hi < sig.logreg_auroc.lo
    assert sig.logreg_auroc.value <= rep.item_ceiling.value + 1e-9
    assert sig.greedy_auroc is not None and sig.greedy_auroc.value > 0.85
    for c in sig.fold_counts:
        assert c["test_pos"] >= 2 and c["train_pos"] + c["test_pos"] == y.sum()


def test_controls_and_directions(planted):
    x, y, g, w, rep = planted
    ctrl = controls(rep, y, g, texts=[f"text {i % 7}" for i in range(len(y))], n_boot=100)
    assert set(ctrl) >= {"shuffled_labels", "shuffled_labels_max", "random_direction", "embedding_layer",
                         "text_baseline", "item_ceiling"}
    assert abs(ctrl["text_baseline"].value - 0.5) < 0.15
    assert ctrl["shuffled_labels_max"].value >= ctrl["shuffled_labels"].value
    tensors, meta = directions(x, [0, 1, 2], y, g, cs=modal_c(rep))
    cos = tensors["probe_2"] @ w / (np.linalg.norm(tensors["probe_2"]) * np.linalg.norm(w))
    cos_dm = tensors["diff_means_2"] @ w / (np.linalg.norm(tensors["diff_means_2"]) * np.linalg.norm(w))
    assert cos > 0.7 and cos_dm > 0.7  # the saved directions point along the planted one
    assert meta["2"]["C"] == modal_c(rep)[2] and tensors["probe_0"].shape == (x.shape[2],)


def test_probe_direction_is_in_residual_coordinates():
    """Scaling one coordinate must not move the residual-space direction's projection ranking."""
    x, y, g, w = synth(d=12)
    x2 = x.copy()
    x2[:, :, 0] *= 100.0
    t1, _ = directions(x[:, [2]], [2], y, g, cs={2: 0.1})
    t2, _ = directions(x2[:, [2]], [2], y, g, cs={2: 0.1})
    s1, s2 = x[:, 2] @ t1["probe_2"], x2[:, 2] @ t2["probe_2"]
    assert np.corrcoef(s1, s2)[0, 1] > 0.999


def test_text_baseline_can_win_when_labels_are_in_the_text():
    x, y, g, _ = synth()
    texts = ["yes please follow" if v else "no thanks" for v in y]
    assert auroc(y, text_baseline_scores(texts, y, make_folds(y, g))) > 0.95


def test_shuffle_by_group_moves_whole_items():
    x, y, g, _ = synth(seed=4)
    ys = shuffle_by_group(y, g, seed=1)
    assert ys.sum() == y.sum() and not np.array_equal(ys, y)
    vec = lambda lab, item: tuple(lab[g == item])  # noqa: E731
    items = sorted(set(g))
    # the new label vectors are the old ones, reassigned between items
    assert sorted(vec(ys, i) for i in items) == sorted(vec(y, i) for i in items)


# ------------------------------------------------------------------ metrics


def test_weighted_auroc_matches_sklearn_and_replication():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    s = np.round(rng.standard_normal(200) + y, 1)  # rounding makes ties
    assert auroc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    w = rng.integers(0, 4, 200)
    rep = np.repeat(np.arange(200), w)
    assert weighted_auroc(y, s, w[None].astype(float))[0] == pytest.approx(roc_auc_score(y[rep], s[rep]), abs=1e-12)


def test_grouped_bootstrap_is_honest_about_repeated_rows():
    """40 items, each repeated 10 times (like samples sharing one boundary state): resampling rows
    pretends there are 400 independent examples; resampling items gives the wider, honest CI."""
    rng = np.random.default_rng(1)
    y_item = rng.integers(0, 2, 40)
    s_item = y_item + 1.5 * rng.standard_normal(40)
    y, s = np.repeat(y_item, 10), np.repeat(s_item, 10)
    items = np.repeat(np.arange(40), 10).astype(str)
    by_item = grouped_bootstrap(y, s, items, n_boot=500)
    by_row = grouped_bootstrap(y, s, np.arange(400).astype(str), n_boot=500)
    assert by_item.lo <= by_item.value <= by_item.hi
    assert by_item.value == by_row.value
    assert (by_item.hi - by_item.lo) > 2 * (by_row.hi - by_row.lo)


def test_item_ceiling():
    y = np.array([1, 1, 0, 0, 1, 0, 0, 0])
    g = np.array(["a", "a", "b", "b", "c", "c", "d", "d"])
    assert 0.5 < item_ceiling(y, g, n_boot=20).value < 1.0  # item c is mixed: no state separates it
    y2 = np.array([1, 1, 0, 0, 1, 1, 0, 0])
    assert item_ceiling(y2, g, n_boot=20).value == 1.0


# ------------------------------------------------------------------ refusing to report noise


def test_too_few_positives_stops():
    x, y, g, _ = synth()
    y2 = np.zeros_like(y)
    y2[:3] = 1
    with pytest.raises(InsufficientPositives, match="positive rows"):
        make_folds(y2, g)
    with pytest.raises(InsufficientPositives):
        sweep_layers(x, [0, 1, 2], y2, g, progress=False)


def test_too_few_positives_per_test_fold_stops():
    """Five positive items of one row each: enough items for 5 folds, but one positive per test fold."""
    x, y, g, _ = synth()
    y2 = np.zeros_like(y)
    y2[[0, 4, 8, 12, 16]] = 1
    with pytest.raises(InsufficientPositives, match="test fold"):
        make_folds(y2, g, n_splits=5)
    assert len(make_folds(y2, g, n_splits=2, min_test_pos=2)) == 2


# ------------------------------------------------------------------ multi-class and transfer


def test_multiclass_and_transfer():
    x, y, g, _ = synth()
    labels = np.where(y == 1, "genuine_followup", np.where(x[:, 1, 0] > 0, "new_query", "prompt_restatement"))
    folds = make_folds(y, g)
    mc = multiclass_confusion(x[:, 2], labels, g, folds)
    assert mc["labels"] == sorted(set(labels)) and np.asarray(mc["confusion"]).sum() == len(y)
    assert sum(mc["support"]) == len(y)
    ds = np.where(np.arange(len(y)) // 4 % 2 == 0, "gsm8k", "mt_bench")  # whole items per dataset
    tm = transfer_matrix(x[:, 2], y, ds, g, n_splits=3, n_boot=50)
    assert tm["cells"][0][1]["auroc"]["value"] > 0.8 and tm["cells"][0][0]["auroc"]["value"] > 0.7


def test_transfer_fails_when_datasets_use_different_directions():
    x, y, g, _ = synth(n_items=80)
    ds = np.where(np.arange(len(y)) // 4 % 2 == 0, "a", "b")
    rng = np.random.default_rng(9)
    y_b = (x[:, 1] @ rng.standard_normal(x.shape[2]) > 0.5).astype(int)  # another layer's direction
    y_mixed = np.where(ds == "a", y, y_b)
    tm = transfer_matrix(x[:, 2], y_mixed, ds, g, n_splits=3, n_boot=50)
    assert abs(tm["cells"][0][1]["auroc"]["value"] - 0.5) < 0.2


def test_plot_writes_a_figure(planted, tmp_path):
    from mechprobe.plots import plot_layer_auroc

    x, y, g, w, rep = planted
    ctrl = controls(rep, y, g, texts=None, n_boot=50)
    mc = {**multiclass_confusion(x[:, 2], np.where(y == 1, "genuine_followup", "new_query"), g, rep.folds),
          "layer": 2}
    out = plot_layer_auroc(rep, ctrl, tmp_path / "f.png", "synthetic", confusion=mc)
    assert out.stat().st_size > 20_000
    json.dumps(rep.to_dict())  # serialisable as written to metrics.json


# ------------------------------------------------------------------ the script on a real tiny run


def _script(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "experiments/linear_probe.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True)


@pytest.mark.slow
@requires_smollm2
def test_script_builds_every_stage_from_nothing(tmp_path):
    """Fresh run directory: the script generates, judges (offline), caches and probes. A tiny run may
    legitimately have too few positives; both outcomes must leave well-formed metrics."""
    run, figs = tmp_path / "tiny", tmp_path / "figs"
    common = ["--run", str(run), "--figures", str(figs), "--layers", "0,15,30", "--folds", "3", "--n-boot", "200"]
    p = _script(*common, "--new", "--dataset", "builtin", "--limit", "10", "--samples", "3", "--temperatures", "0", "1.0",
                "--max-assistant-tokens", "32", "--max-user-tokens", "16")
    assert p.returncode in (0, 3), p.stdout + p.stderr
    for f in ("assistant.jsonl", "user_turns.jsonl", "labels.jsonl", "activations/manifest.json"):
        assert (run / f).exists(), f
    m = json.loads((run / "probes" / "metrics.json").read_text())
    assert m["n_rows"] == 10 * 4 and set(m["stage_seconds"]) == {"probe", "judge", "cache"}
    if p.returncode == 3:
        assert m["status"] == "insufficient_positives" and "insufficient positives" in m["reason"]
        assert "Not reporting probe metrics" in p.stderr
    else:
        assert m["status"] == "ok" and [r["layer"] for r in m["per_layer"]] == [0, 15, 30]
        for r in m["per_layer"]:
            a = r["logreg_auroc"]
            assert 0.0 <= a["lo"] <= a["value"] <= a["hi"] <= 1.0
        assert (figs / "linear_probe_tiny.png").stat().st_size > 10_000
        assert (run / "probes" / "directions.safetensors").exists()
    # Second call reuses every stage and, asked for more folds than positive items, refuses to report.
    p2 = _script(*common[:4], "--folds", "40")
    assert p2.returncode == 3, p2.stdout + p2.stderr
    assert "reusing" in p2.stdout and "insufficient positives" in p2.stderr
    m2 = json.loads((run / "probes" / "metrics.json").read_text())
    assert m2["status"] == "insufficient_positives" and m2["stage_seconds"]["probe"] < 5
    assert len((run / "user_turns.jsonl").read_text().splitlines()) == 40  # nothing regenerated or added


def test_too_few_positives_suggests_what_helps_not_fewer_folds():
    """Fewer folds cannot fix too few positive rows: the hint names limit= (and more samples) only; where the
    fold count is what failed (positive items < folds), it names the fold count that fits."""
    groups = np.repeat([f"i{k}" for k in range(12)], 3)
    y = np.zeros(len(groups), int)
    y[:3] = 1  # 3 positive rows from one item: below min_pos whatever the folds
    with pytest.raises(InsufficientPositives) as e:
        make_folds(y, groups, n_splits=3)
    assert "folds=" not in str(e.value) and "limit=24" in str(e.value) and "samples=" in str(e.value)
    y[:9] = 1  # 9 positive rows from 3 items: enough rows, too few positive items for 5 folds
    with pytest.raises(InsufficientPositives, match=r"fewer folds \(folds=3\)"):
        make_folds(y, groups, n_splits=5)


def test_a_run_too_small_to_fit_writes_counts_and_a_figure_saying_why(tmp_path):
    from types import SimpleNamespace

    from mechprobe.linear.experiment import _no_fit, label_counts

    data = SimpleNamespace(y=np.array([1, 0, 0, 0]), groups=np.array(["a", "a", "b", "c"]), n_unlabelled=1,
                           labels=["genuine_followup", "new_query", "new_query", "assistant_continuation"])
    counts = label_counts(data)
    assert counts["genuine rows"] == 1 and counts["items with a genuine row"] == 1 and counts["label new_query"] == 2
    out = tmp_path / "run" / "probes"
    out.mkdir(parents=True)
    res = _no_fit(out, tmp_path / "figs" / "linear_probe_run.png", {"run": str(tmp_path / "run")}, counts,
                  "insufficient positives: 1 positive rows", "m · 4 turns · judge j · judge only", 0.0)
    assert res.exit_code == 3 and res.status == "insufficient_positives"
    m = json.loads((out / "metrics.json").read_text())
    assert m["status"] == "insufficient_positives" and m["label_counts"] == counts
    assert "| genuine rows | 1 |" in (out / "metrics.md").read_text()
    assert res.figure.stat().st_size > 10_000
    assert "Not reporting probe metrics" in res.message and "kept" in res.message
