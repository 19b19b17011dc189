"""The hand-label fixture is well-formed, and the offline judge does not regress on its held-out split."""

from __future__ import annotations

import json
from pathlib import Path

from mechprobe.agreement import cohen_kappa
from mechprobe.judge import inputs_from_rows
from mechprobe.judge_offline import OfflineJudge
from mechprobe.taxonomy import GENUINE, LABELS

FIXTURE = Path(__file__).parent / "fixtures" / "hand_labels.jsonl"


def _rows():
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def test_fixture_is_well_formed():
    rows = _rows()
    assert len(rows) >= 200
    assert len({r["record_id"] for r in rows}) == len(rows)
    assert all(r["label"] in LABELS and r["rationale"].strip() for r in rows)
    dev = {r["item_id"] for r in rows if r["split"] == "dev"}
    test = {r["item_id"] for r in rows if r["split"] == "test"}
    assert dev and test and not dev & test
    assert {r["dataset"] for r in rows} == {"gsm8k", "mt_bench", "ifeval"}
    assert {r["decoding"] for r in rows} == {"greedy", "sample"}


def test_offline_judge_binary_kappa_on_test_split_does_not_regress():
    rows = [r for r in _rows() if r["split"] == "test"]
    judge = OfflineJudge()
    got = {rec.record_id: rec.label for rec in judge.label_many(inputs_from_rows(rows))}
    a = [r["label"] == GENUINE for r in rows]
    b = [got[r["record_id"]] == GENUINE for r in rows]
    kappa = cohen_kappa(a, b)
    # Measured 0.175 (offline-v2+minilm) / see docs/judge_agreement_test.md; the floor catches regressions.
    floor = 0.10 if judge.variant == "minilm" else 0.0
    assert kappa >= floor, f"binary kappa {kappa:.3f} fell below {floor}"
