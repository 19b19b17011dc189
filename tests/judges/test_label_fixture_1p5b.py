"""The 1.5B model-written label fixture (``hand_labels_q15_c.jsonl`` / ``_d.jsonl``): well-formed, and the judges'
agreement with it does not regress (floors = measured − 0.15; the claims are in docs/judge_agreement.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechprobe.judges.agreement import cohen_kappa
from mechprobe.judges.base import inputs_from_rows
from mechprobe.taxonomy import GENUINE, LABELS

FIXTURES = Path(__file__).parents[1] / "fixtures"
C_FILE, D_FILE = FIXTURES / "hand_labels_q15_c.jsonl", FIXTURES / "hand_labels_q15_d.jsonl"
MARGIN = 0.15


def _rows(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def _binary_kappa(judged: dict[str, str], ref: list[dict]) -> float:
    return cohen_kappa([judged[r["record_id"]] == GENUINE for r in ref], [r["label"] == GENUINE for r in ref])


def test_q15_fixture_is_well_formed_and_both_labellings_cover_the_same_turns():
    c, d = _rows(C_FILE), _rows(D_FILE)
    assert len(c) == len(d) == 90
    assert [r["record_id"] for r in c] == [r["record_id"] for r in d]
    for a, b in zip(c, d):
        assert {k: v for k, v in a.items() if k not in ("label", "rationale")} == \
               {k: v for k, v in b.items() if k not in ("label", "rationale")}
        assert a["label"] in LABELS and b["label"] in LABELS and a["rationale"].strip() and b["rationale"].strip()
    dev = {r["item_id"] for r in c if r["split"] == "dev"}
    test = {r["item_id"] for r in c if r["split"] == "test"}
    assert dev and test and not dev & test
    # the labellers agree far better with each other than any judge does (measured 0.86 binary)
    assert cohen_kappa([r["label"] == GENUINE for r in c], [r["label"] == GENUINE for r in d]) > 0.6


def test_offline_judge_does_not_regress_on_the_q15_fixture():
    from mechprobe.judges.offline import OfflineJudge

    c = _rows(C_FILE)
    got = {r.record_id: r.label for r in OfflineJudge().label_many(inputs_from_rows(c))}
    assert _binary_kappa(got, c) >= max(0.0, 0.20 - MARGIN)  # measured 0.20 (minilm variant) vs labeller C


@pytest.mark.slow
def test_hybrid_judge_does_not_regress_on_the_q15_fixture():
    from mechprobe.lm.registry import ModelLoadError, embedded_gguf_path

    try:
        embedded_gguf_path("qwen2.5-coder-1.5b-instruct")
    except ModelLoadError as e:
        pytest.skip(str(e))
    from mechprobe.judges.hybrid import HybridJudge

    c = _rows(C_FILE)
    got = {r.record_id: r.label for r in HybridJudge("qwen2.5-coder-1.5b-instruct").label_many(inputs_from_rows(c))}
    assert _binary_kappa(got, c) >= 0.39 - MARGIN  # measured 0.39 [0.20, 0.57] vs labeller C, all 90 rows


STEER_FILE = FIXTURES / "hand_labels_steer_q15.jsonl"


def _check_blind_paired(rows: list[dict], label_keys: tuple[str, ...], conditions: set[str], n_items: int) -> None:
    """Unique ids that hide the condition, valid labels with rationales, every item under every condition."""
    assert len(rows) == n_items * len(conditions) and len({r["record_id"] for r in rows}) == len(rows)
    by_cond: dict[str, set] = {}
    for r in rows:
        by_cond.setdefault(r["condition"], set()).add(r["item_id"])
        assert all(r[k] in LABELS for k in label_keys)
        assert all(r["rationale_" + k[-1]].strip() for k in label_keys if k.startswith("label_"))
        assert r["condition"] not in r["record_id"]  # ids do not reveal the condition to a labeller
    assert set(by_cond) == conditions
    assert all(len(v) == n_items for v in by_cond.values()) and len(set.union(*by_cond.values())) == n_items


def test_steer_fixture_is_well_formed_blind_and_paired():
    """144 turns = 48 held-out items x (unsteered, diff-of-means, random) of the 1.5B steering run, two labellings."""
    _check_blind_paired(_rows(STEER_FILE), ("label_e", "label_f", "hybrid_label"), {"none", "diff_means", "random"}, 48)


def test_hand_label_table_counts_and_pairs():
    from mechprobe.steering.evaluate import hand_label_table

    rows = [{"item_id": f"i{k}", "condition": c, "a": lab}
            for k, (c0, c1) in enumerate([("genuine_followup", "new_query"), ("new_query", "genuine_followup"),
                                          ("new_query", "genuine_followup"), ("new_query", "new_query")])
            for c, lab in (("none", c0), ("steer", c1))]
    t = {r["condition"]: r for r in hand_label_table(rows, ["a"])}
    assert (t["none"]["genuine"], t["steer"]["genuine"], t["steer"]["n"]) == (1, 2, 4)
    assert (t["steer"]["b"], t["steer"]["c"], t["steer"]["n_paired"]) == (2, 1, 4)  # b: only steered genuine
    with pytest.raises(ValueError, match="base condition"):
        hand_label_table([r for r in rows if r["condition"] == "steer"], ["a"])
    real = hand_label_table(_rows(STEER_FILE), ["label_e", "label_f", "hybrid_label"])
    assert len(real) == 9 and all(0 <= r["genuine"] <= r["n"] == 48 for r in real)


STEER2_FILE = FIXTURES / "hand_labels_steer2_q15.jsonl"


def test_steer2_fixture_is_well_formed_blind_and_paired():
    """192 turns = 48 held-out items x (unsteered, diff-of-means, random, probe) of the hybrid-voice-selected 1.5B
    steering setting (residual 18, alpha 0.8), two blind labellings per turn."""
    _check_blind_paired(_rows(STEER2_FILE), ("label_g", "label_h", "hybrid2_label"),
                        {"none", "diff_means", "random", "probe"}, 48)


def test_steer2_hand_labels_table_reproduces_the_documented_counts():
    """The numbers docs/findings_appendix.md quotes for the hybrid-voice-selected setting come from this fixture and this code."""
    from mechprobe.steering.evaluate import hand_label_table

    t = {(r["labels"], r["condition"]): r for r in hand_label_table(_rows(STEER2_FILE),
                                                                      ["label_g", "label_h", "hybrid2_label"])}
    assert all(t[(k, "none")]["genuine"] == 3 for k in ("label_g", "label_h", "hybrid2_label"))
    assert (t[("label_g", "diff_means")]["genuine"], t[("label_h", "diff_means")]["genuine"]) == (25, 20)
    assert t[("label_h", "diff_means")]["p"] < 1e-3  # the steered rise holds for the stricter labeller
    rows = _rows(STEER2_FILE)
    g, h, j = ([r[k] == GENUINE for r in rows] for k in ("label_g", "label_h", "hybrid2_label"))
    assert (round(cohen_kappa(g, h), 2), round(cohen_kappa(j, g), 2), round(cohen_kappa(j, h), 2)) == (0.83, 0.56, 0.50)
