"""The 1.5B hand-label fixture (``hand_labels_q15_c.jsonl`` / ``_d.jsonl``): well-formed, and the judges'
agreement with it does not regress (floors = measured − 0.15; the claims are in docs/judge_agreement.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechprobe.agreement import cohen_kappa
from mechprobe.judge import inputs_from_rows
from mechprobe.taxonomy import GENUINE, LABELS

FIXTURES = Path(__file__).parent / "fixtures"
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
    from mechprobe.judge_offline import OfflineJudge

    c = _rows(C_FILE)
    got = {r.record_id: r.label for r in OfflineJudge().label_many(inputs_from_rows(c))}
    assert _binary_kappa(got, c) >= max(0.0, 0.20 - MARGIN)  # measured 0.20 (minilm variant) vs labeller C


@pytest.mark.slow
def test_hybrid_judge_does_not_regress_on_the_q15_fixture():
    from mechprobe.models import ModelLoadError, embedded_gguf_path

    try:
        embedded_gguf_path("qwen2.5-coder-1.5b-instruct")
    except ModelLoadError as e:
        pytest.skip(str(e))
    from mechprobe.judge_hybrid import HybridJudge

    c = _rows(C_FILE)
    got = {r.record_id: r.label for r in HybridJudge("qwen2.5-coder-1.5b-instruct").label_many(inputs_from_rows(c))}
    assert _binary_kappa(got, c) >= 0.39 - MARGIN  # measured 0.39 [0.20, 0.57] vs labeller C, all 90 rows
