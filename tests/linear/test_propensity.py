"""Item-level propensity probes: targets from label files, the split-half ceiling, planted signals.

Fast: synthetic arrays and hand-made JSONL files, no model. Tolerances are stated where a Monte-Carlo
quantity is compared with its expected value.
"""

from __future__ import annotations

import numpy as np
import pytest

from mechprobe.errors import UserError
from mechprobe.io import JsonlStore, read_jsonl
from mechprobe.linear.fit import spearman
from mechprobe.linear.propensity import (
    InsufficientItems,
    ItemTargets,
    above_median,
    choose_target,
    cost_summary,
    item_targets,
    one_row_per_item,
    propensity_controls,
    propensity_sweep_layers,
    propensity_table,
    propensity_transfer,
    split_half_reliability,
)

# ------------------------------------------------------------------------------------------ targets


def _write_run(tmp_path, genuine_counts, k=8, greedy=None, errors=None, other_t=0):
    """user_turns.jsonl + labels.jsonl with ``genuine_counts[i]`` genuine samples of item i at T=1.0.

    ``errors[i]`` of item i's samples are judge_error rows (genuine None); ``other_t`` samples at T=0.7
    (all genuine) must be ignored; ``greedy[i]`` is the greedy label (None: a judge_error).
    """
    turns, labels = JsonlStore(tmp_path / "user_turns.jsonl", key="record_id"), JsonlStore(
        tmp_path / "labels.jsonl", key="record_id")
    errors = errors or [0] * len(genuine_counts)
    greedy = greedy or [False] * len(genuine_counts)
    for i, (g, e) in enumerate(zip(genuine_counts, errors)):
        iid = f"toy-{i}"
        rows = [("greedy", 0.0, 0, greedy[i])]
        rows += [("sample", 1.0, s, (s < g) if s < k - e else None) for s in range(k)]
        rows += [("sample", 0.7, s, True) for s in range(other_t)]
        for dec, t, s, gen in rows:
            rid = f"{iid}|{dec}|T{t:g}|s{s}"
            turns.append({"record_id": rid, "item_id": iid, "dataset": "toy", "decoding": dec, "temperature": t,
                          "sample_index": s})
            labels.append({"record_id": rid, "label": "judge_error" if gen is None else
                           ("genuine_followup" if gen else "new_query"), "genuine": gen})
    return read_jsonl(tmp_path / "user_turns.jsonl"), read_jsonl(tmp_path / "labels.jsonl")


def test_item_targets_from_label_files(tmp_path):
    turns, labels = _write_run(tmp_path, [0, 2, 8, 5], greedy=[False, True, None, True], errors=[0, 2, 0, 7],
                               other_t=3)
    t = item_targets(turns, labels, temperature=1.0, min_samples=2)
    # item 3 keeps 1 judged sample (7 judge errors) -> dropped; item 1: 2 genuine of 6 judged samples
    assert t.item_ids == ["toy-0", "toy-1", "toy-2"]
    assert t.k.tolist() == [8, 6, 8]
    np.testing.assert_allclose(t.propensity, [0.0, 2 / 6, 1.0])
    assert t.n_dropped == 1 and t.dropped == ["toy::toy-3"]
    assert t.n_judge_errors == 2 + 7 + 1  # sampled errors of items 1 and 3, greedy error of item 2
    assert t.greedy[0] == 0.0 and t.greedy[1] == 1.0 and np.isnan(t.greedy[2])
    assert [sum(s) for s in t.samples] == [0, 2, 8]
    # min_samples=1 keeps item 3 (one judged sample, genuine since 0 < 5)
    t1 = item_targets(turns, labels, temperature=1.0, min_samples=1)
    assert t1.item_ids[-1] == "toy-3" and t1.propensity[-1] == 1.0
    # the T=0.7 samples are a separate target
    t07 = item_targets(turns, labels, temperature=0.7)
    assert t07.k.tolist() == [3, 3, 3, 3] and t07.propensity.tolist() == [1.0] * 4


def test_item_targets_refuses_missing_temperature(tmp_path):
    turns, labels = _write_run(tmp_path, [1, 2])
    with pytest.raises(UserError, match="no sampled user turns at temperature 0.5"):
        item_targets(turns, labels, temperature=0.5)


def test_above_median_is_strict():
    assert above_median(np.array([0, 0, 0, 0.25, 0.5])).tolist() == [0, 0, 0, 1, 1]


def test_choose_target():
    assert choose_target("auto", 8, [0.0, 1.0], 1.0)[0] == "propensity"
    assert choose_target("auto", 4, [0.0, 1.0], 1.0)[0] == "turn"
    assert choose_target("auto", 8, [0.0, 0.7], 1.0)[0] == "turn"
    assert choose_target("propensity", 2, [1.0], 1.0)[0] == "propensity"


# ------------------------------------------------------------------------------------------ ceiling


def _simulate(n, k, a, b, rng):
    p = rng.beta(a, b, n)
    return p, (rng.random((n, k)) < p[:, None]).astype(int)


@pytest.mark.parametrize("k,a,b", [(8, 2.0, 2.0), (8, 0.5, 2.0)])
def test_split_half_ceiling_matches_simulated_test_retest(k, a, b):
    """The Spearman-Brown corrected split-half rho estimates the correlation between two independent
    k-sample propensities of the same items (test-retest), simulated here with 200k items.

    Tolerance 0.08: the estimate from 400 items has a sampling sd of ~0.03 (its bootstrap CI is about
    +-0.06), and Spearman-Brown is exact only for Pearson reliability of parallel halves.
    """
    rng = np.random.default_rng(7)
    _, s = _simulate(400, k, a, b, rng)
    m = split_half_reliability(s.tolist(), n_splits=100, seed=0, n_boot=200)
    p = rng.beta(a, b, 200_000)
    ra = (rng.random((len(p), k)) < p[:, None]).mean(1)
    rb = (rng.random((len(p), k)) < p[:, None]).mean(1)
    expected = spearman(ra, rb)
    assert abs(m.value - expected) < 0.08, (m, expected)
    assert m.lo < m.value < m.hi
    # Without the Spearman-Brown step (half-length reliability) it would be clearly lower: the step matters.
    assert expected > 0.5


@pytest.mark.parametrize("k,a,b", [(8, 2.0, 2.0), (8, 0.5, 2.0)])
def test_the_ceiling_is_sqrt_of_the_reliability_not_the_reliability(k, a, b):
    """A probe that knows every item's true propensity correlates with the observed k-sample propensity at
    ~sqrt(R), above R itself: R (test-retest) is not a ceiling for a probe, sqrt(R) is.

    Tolerance 0.08 as above (400 items for the estimate; the truth simulated with 200k items).
    """
    from mechprobe.linear.propensity import attenuation_ceiling

    rng = np.random.default_rng(11)
    _, s = _simulate(400, k, a, b, rng)
    ceiling = attenuation_ceiling(split_half_reliability(s.tolist(), n_splits=100, seed=0, n_boot=200))
    p, big = _simulate(200_000, k, a, b, rng)
    oracle = spearman(p, big.mean(1))  # the best any probe of the true propensity can do
    r = spearman(big[:, : k // 2].mean(1), big[:, k // 2:].mean(1))
    r_full = 2 * r / (1 + r)
    assert oracle > r_full + 0.05  # the reliability is below what a perfect probe reaches
    assert abs(ceiling.value - oracle) < 0.08, (ceiling, oracle)


def test_split_half_ceiling_is_zero_without_item_differences():
    rng = np.random.default_rng(3)
    s = (rng.random((300, 8)) < 0.3).astype(int)
    m = split_half_reliability(s.tolist(), n_splits=100, seed=0, n_boot=200)
    assert abs(m.value) < 0.15 and m.lo < 0 < m.hi


# ------------------------------------------------------------------------------------------ probes


def _targets(p, samples, datasets=None, greedy=None):
    n = len(p)
    ds = datasets or ["toy"] * n
    return ItemTargets(keys=[f"{d}::{i}" for i, d in enumerate(ds)], item_ids=[str(i) for i in range(n)],
                       datasets=ds, propensity=np.asarray(p, float), k=np.array([len(s) for s in samples]),
                       greedy=np.asarray(greedy if greedy is not None else np.full(n, np.nan), float),
                       samples=[list(s) for s in samples], temperature=1.0, min_samples=2)


def _planted(n=120, d=24, k=16, seed=0, layers=(0, 1, 2, 3), planted=2, strength=2.0, with_logit=False):
    """Activations [n, L, d]; only layer ``planted`` carries w.x, and propensity = sigmoid(w.x) + noise
    (through k Bernoulli samples). Layer 0 is constant, as the embedding layer is at the boundary."""
    rng = np.random.default_rng(seed)
    stack = rng.standard_normal((n, len(layers), d))
    stack[:, 0] = rng.standard_normal(d)  # one token embedding for every item
    w = rng.standard_normal(d) / np.sqrt(d)
    true_p = 1 / (1 + np.exp(-strength * stack[:, layers.index(planted)] @ w * 2))
    samples = (rng.random((n, k)) < true_p[:, None]).astype(int)
    greedy = (true_p > 0.5).astype(float)
    out = stack, list(layers), _targets(samples.mean(1), samples, greedy=greedy)
    return (*out, stack[:, layers.index(planted)] @ w) if with_logit else out


def test_planted_signal_is_recovered_and_nested_picks_its_layer():
    stack, layers, t = _planted()
    rep = propensity_sweep_layers(stack, layers, t, n_splits=5, seed=0, n_boot=200, n_random=50, progress=False)
    m = rep.layer(2).rho
    assert m.value > 0.5 and m.lo > 0, m
    assert rep.best_layer == 2
    assert rep.nested["fold_layers"] == [2] * 5 and rep.nested["rho"].lo > 0
    assert rep.nested["above_median_auroc"].value > 0.75
    assert rep.layer(2).greedy_auroc is not None and rep.layer(2).greedy_auroc.value > 0.75
    # layers without the signal, the shuffled target and the constant embedding layer do not clear zero
    for la in (1, 3):
        assert rep.layer(la).rho.lo < 0.2
    assert rep.layer(2).shuffled_rho.lo < 0 < rep.layer(2).shuffled_rho.hi
    assert rep.layer(2).random_dir_rho.value < m.value
    texts = [f"item {i} text" for i in range(len(t))]
    ctrl = propensity_controls(rep, stack, t, texts, np.arange(len(t)) % 7 + 1, seed=0, n_boot=200, n_splits_ceiling=50)
    assert ctrl["shuffled_max"].value >= ctrl["shuffled"].value - 1e-12
    assert abs(ctrl["embedding_layer"].value) < 0.3
    assert ctrl["split_half_ceiling"].value > m.lo  # the probe cannot beat the ceiling beyond noise
    md = propensity_table(rep, ctrl, t)
    assert "ceiling** sqrt(R)" in md and "reliability R" in md and "| 2 |" in md
    r = ctrl["split_half_reliability"]
    assert abs(ctrl["split_half_ceiling"].value - np.sqrt(max(r.value, 0))) < 1e-12


def test_greedy_auroc_is_not_reported_when_a_fold_cannot_be_fitted():
    """Two greedy positives in 120 items (the 0.5B model had 2/200): a fold whose training part holds one positive
    cannot fit a logistic probe. Scoring its items 0 once put the positives above the other folds' negative
    decision values -- AUROC ~0.8 at every layer, signal or not. Such a layer must report no greedy AUROC."""
    stack, layers, t = _planted()
    g = np.zeros(len(t))
    g[[3, 50]] = 1.0  # two positives, uncorrelated with the states
    t = _targets(t.propensity, t.samples, greedy=g)
    rep = propensity_sweep_layers(stack, layers, t, n_splits=5, seed=0, n_boot=50, n_random=0, progress=False)
    assert all(r.greedy_auroc is None for r in rep.per_layer), [r.greedy_auroc for r in rep.per_layer]
    assert rep.layer(2).rho.lo > 0  # the rest of the report is unaffected


def test_shuffled_target_is_not_recovered():
    stack, layers, t = _planted(seed=1)
    rng = np.random.default_rng(5)
    perm = rng.permutation(len(t))
    t_sh = _targets(t.propensity[perm], [t.samples[i] for i in perm])
    rep = propensity_sweep_layers(stack, layers, t_sh, n_splits=5, seed=0, n_boot=200, n_random=0,
                                  shuffled=False, progress=False)
    m = rep.nested["rho"]
    assert m.lo < 0 < m.hi, m


def test_transfer_between_datasets_with_shared_signal():
    stack, layers, t = _planted(n=160)
    ds = ["a" if i % 2 else "b" for i in range(len(t))]
    t2 = _targets(t.propensity, t.samples, datasets=ds)
    tm = propensity_transfer(stack[:, 2], t2, n_splits=3, seed=0, n_boot=100)
    assert tm["train_rows"] == ["a", "b"]
    for row in tm["cells"]:
        for c in row:
            assert c["rho"]["value"] > 0.4 and c["rho"]["lo"] > 0
    tm0 = propensity_transfer(stack[:, 1], t2, n_splits=3, seed=0, n_boot=100)
    assert tm0["cells"][0][1]["rho"]["lo"] < 0.25


def test_constant_propensity_and_too_few_items_are_refused():
    stack, layers, t = _planted(n=40)
    flat = _targets(np.full(len(t), 0.5), t.samples)
    with pytest.raises(InsufficientItems, match="nothing to rank"):
        propensity_sweep_layers(stack, layers, flat, progress=False)
    small = t.subset(range(6))
    with pytest.raises(InsufficientItems, match="only 6 items"):
        propensity_sweep_layers(stack[:6], layers, small, n_splits=5, progress=False)


def test_one_row_per_item_checks_rows_are_the_same_state():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 5)).astype(np.float32)
    rows = np.stack([a, b, a, b + 1e-6])
    out = one_row_per_item(rows, ["x", "y", "x", "y"], ["y", "x"])
    np.testing.assert_array_equal(out[0], b)
    np.testing.assert_array_equal(out[1], a)
    with pytest.raises(UserError, match="differ"):
        one_row_per_item(np.stack([a, a + 0.5]), ["x", "x"], ["x"])
    with pytest.raises(UserError, match="no cached activations"):
        one_row_per_item(rows, ["x", "y", "x", "y"], ["z"])


def test_cost_summary_ratio_and_missing_parts():
    c = cost_summary({"user_seconds": 90.0, "user_rows": 90}, {"forward_seconds": 2.0, "forward_prompts": 10},
                     {"seconds": 9.0, "rows": 90}, k=8)
    assert c["boundary_forward_s_per_item"] == pytest.approx(0.2)
    assert c["sample_s_per_item"] == pytest.approx(8.0) and c["judge_s_per_item"] == pytest.approx(0.8)
    assert c["ratio"] == pytest.approx(8.8 / 0.2)
    c2 = cost_summary(None, {"forward_seconds": 2.0, "forward_prompts": 10}, None, k=8)
    assert c2["ratio"] is None and "user-turn generation" in c2["missing"]


def _probes_args(*argv):
    import argparse

    from mechprobe.cli.linear_probe import add_args, config_from_args

    p = argparse.ArgumentParser()
    add_args(p)
    return config_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("flags, needle", [(["--datasets", "nope"], "--datasets"),
                                           (["--datasets", "gsm8k", "--run", "RUN"], "drop --run"),
                                           (["--datasets", "gsm8k", "gsm8k"], "twice"),
                                           (["--min-samples", "1"], "--min-samples"),
                                           (["--propensity-temperature", "0"], "--propensity-temperature")])
def test_invalid_propensity_flags_rejected_before_any_stage(tmp_path, flags, needle):
    from mechprobe.linear.experiment import run_linear_probe

    run = tmp_path / "run"
    flags = [str(run) if f == "RUN" else f for f in flags]
    with pytest.raises(UserError, match=needle):
        run_linear_probe(_probes_args(*flags))
    assert not run.exists()


def test_constant_score_has_rho_zero_not_nan():
    from mechprobe.linear.propensity import bootstrap_indices, rho_metric

    y = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    m = rho_metric(y, np.full(5, 3.0), bootstrap_indices(5, 50, 0))
    assert m.value == 0.0 and m.lo == 0.0 and m.hi == 0.0
    assert rho_metric(y, y, bootstrap_indices(5, 50, 0)).value == pytest.approx(1.0)
    assert np.isnan(spearman(np.ones(5), y))  # the plain statistic stays undefined


def test_probe_beyond_length_is_zero_when_length_carries_the_signal():
    """A planted state signal that the answer's length also carries: the plain length control and the probe both
    score high, the partial rho given length (slope per dataset) does not; with length unrelated it keeps the
    probe's rho. Two datasets with different length ranges, as GSM8K (capped) and MT-Bench."""
    stack, layers, t, logit = _planted(n=200, seed=3, with_logit=True)
    ds = ["a" if i % 2 else "b" for i in range(len(t))]
    t2 = _targets(t.propensity, t.samples, datasets=ds)
    rep = propensity_sweep_layers(stack, layers, t2, n_splits=5, seed=0, n_boot=200, n_random=0, progress=False)
    assert rep.nested["rho"].lo > 0.3
    offset = np.where(np.asarray(ds) == "a", 0.0, 3.0)  # dataset b's answers are longer
    riding = np.exp(logit + offset)  # length = a monotone function of the state's signal
    ctrl = propensity_controls(rep, stack, t2, None, riding, seed=0, n_boot=200, n_splits_ceiling=20)
    assert ctrl["length_by_dataset"].value > 0.4
    b = ctrl["probe_beyond_length"]
    assert abs(b.value) < 0.2 and b.lo < 0.1, b
    unrelated = np.exp(np.random.default_rng(0).standard_normal(len(t)) + offset)
    ctrl = propensity_controls(rep, stack, t2, None, unrelated, seed=0, n_boot=200, n_splits_ceiling=20)
    assert abs(ctrl["length_by_dataset"].value) < 0.2
    b = ctrl["probe_beyond_length"]
    assert b.value > 0.3 and b.lo > 0.1, b
    assert "beyond length" in propensity_table(rep, ctrl, t2)
