"""Real vs swapped human turns: the pairing, the AUROC and the rates."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mechprobe.judges.human_reference import auroc_pos_neg as auroc
from mechprobe.judges.human_reference import evaluate, reference_inputs
from tests.conftest import shared_data_dir


def test_auroc_equals_brute_force_pair_count_with_ties():
    rng = random.Random(1)
    pos = [rng.choice([0.1, 0.5, 0.9, rng.random()]) for _ in range(40)]
    neg = [rng.choice([0.1, 0.5, rng.random()]) for _ in range(35)]
    brute = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert abs(auroc(pos, neg) - brute) < 1e-12
    assert auroc([1.0], [0.0]) == 1.0 and auroc([0.0], [1.0]) == 0.0 and auroc([0.3], [0.3]) == 0.5


def _rows(real_genuine: list[bool], swapped_genuine: list[bool]) -> list[dict]:
    rows = []
    for i, (a, b) in enumerate(zip(real_genuine, swapped_genuine)):
        for kind, g in (("real", a), ("swapped", b)):
            lab = "genuine_followup" if g else "new_query"
            rows.append({"record_id": f"c{i}|{kind}", "label": lab, "probs": None})
    return rows


def test_evaluate_rates_gap_and_auroc_from_labels():
    rows = _rows([True] * 8 + [False] * 2, [True] * 1 + [False] * 9)
    rows.append({"record_id": "c99|real", "label": "judge_error", "probs": None})
    r = evaluate(rows, n_boot=200)
    assert r.n == 10 and r.n_errors == 1
    assert r.rate_real == 0.8 and r.rate_swapped == 0.1 and abs(r.gap - 0.7) < 1e-12
    assert r.ci_real[0] < 0.8 < r.ci_real[1] and r.ci_gap[0] <= 0.7 <= r.ci_gap[1]
    assert abs(r.auroc - (0.5 + (0.8 - 0.1) / 2)) < 1e-12  # binary scores: AUROC = (1 + TPR - FPR) / 2


@pytest.mark.skipif(shared_data_dir() is None, reason="needs the shared HH-RLHF / Topical-Chat files")
def test_each_next_turn_appears_once_real_and_once_swapped_never_with_its_own_conversation():
    inputs = reference_inputs(n=30)
    assert Counter(i.dataset for i in inputs) == {"hh_rlhf": 60, "topical_chat": 60}
    for ds in ("hh_rlhf", "topical_chat"):
        real = {i.item_id: i for i in inputs if i.dataset == ds and i.record_id.endswith("|real")}
        swapped = {i.item_id: i for i in inputs if i.dataset == ds and "|swapped<-" in i.record_id}
        assert set(real) == set(swapped) and len(real) == 30
        assert Counter(i.raw_text for i in real.values()) == Counter(i.raw_text for i in swapped.values())
        for iid, s in swapped.items():
            assert (s.prompt, s.response) == (real[iid].prompt, real[iid].response)
        # another conversation's turn (a few short replies like "Yes" may coincide by text)
        assert sum(s.raw_text != real[iid].raw_text for iid, s in swapped.items()) >= 28
    assert reference_inputs(n=30) == inputs  # seeded: the same pairs every time
    # the partner is in the swapped id: another pairing (another n) gives other ids, not stale reuse
    other = {i.record_id: i.raw_text for i in reference_inputs(n=31)}
    assert all(other.get(i.record_id, i.raw_text) == i.raw_text for i in inputs)
