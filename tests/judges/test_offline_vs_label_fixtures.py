"""The model-written label fixtures are well-formed, and the offline judge does not regress against them.

Two independent labellings of the same 216 turns: ``hand_labels.jsonl`` (labeller A, the reference of
the reports) and ``hand_labels_b.jsonl`` (labeller B, labelled blind to A and to the judge). See
``tests/fixtures/hand_labels.md`` and ``docs/judge_agreement.md``.

The floors are the measured values minus 0.15 (never below 0), so that a change to the judge's rules
that loses agreement fails here. They are regression guards, not claims: the claim is the test-split
report, and with 4-14 genuine follow-ups on that split the binary kappa is very uncertain.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from mechprobe.judges.agreement import cohen_kappa
from mechprobe.judges.base import inputs_from_rows
from mechprobe.judges.offline import OfflineJudge
from mechprobe.taxonomy import GENUINE, LABELS

FIXTURES = Path(__file__).parents[1] / "fixtures"
A_FILE = FIXTURES / "hand_labels.jsonl"
B_FILE = FIXTURES / "hand_labels_b.jsonl"

# (split, kind) -> measured value per judge variant (offline-v3, docs/judge_agreement.md), reference A.
MEASURED = {
    ("test", "binary"): {"minilm": 0.189, "lexical": 0.175},
    ("test", "multi"): {"minilm": 0.229, "lexical": 0.235},
    ("dev", "multi"): {"minilm": 0.620, "lexical": 0.620},
}
MARGIN = 0.15


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("path", [A_FILE, B_FILE], ids=["A", "B"])
def test_fixture_is_well_formed(path):
    rows = _rows(path)
    assert len(rows) >= 200
    assert len({r["record_id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["label"] in LABELS, (r["record_id"], r["label"])
        assert r["rationale"].strip(), r["record_id"]
        assert r["split"] in ("dev", "test"), r["record_id"]
        assert r["raw_text"] is not None and r["prompt"].strip() and r["response"] is not None
    dev = {r["item_id"] for r in rows if r["split"] == "dev"}
    test = {r["item_id"] for r in rows if r["split"] == "test"}
    assert dev and test and not dev & test, "splits must be item-disjoint"
    assert {r["dataset"] for r in rows} == {"gsm8k", "mt_bench", "ifeval"}
    assert {r["decoding"] for r in rows} == {"greedy", "sample"}


def test_second_labelling_covers_the_same_turns_and_splits():
    a = {r["record_id"]: r for r in _rows(A_FILE)}
    b = {r["record_id"]: r for r in _rows(B_FILE)}
    assert a.keys() == b.keys()
    for rid, ra in a.items():
        assert (ra["split"], ra["raw_text"], ra["prompt"], ra["response"]) == (
            b[rid]["split"], b[rid]["raw_text"], b[rid]["prompt"], b[rid]["response"]), rid


@lru_cache(maxsize=2)
def _judged(embed: bool) -> tuple[str, dict[str, str]]:
    judge = OfflineJudge(embed=embed)
    rows = _rows(A_FILE)
    return judge.variant, {rec.record_id: rec.label for rec in judge.label_many(inputs_from_rows(rows))}


def _variants() -> list[bool]:
    from mechprobe.judges.offline import embeddings_available

    return [False, True] if embeddings_available() else [False]


@pytest.mark.parametrize("embed", _variants(), ids=lambda e: "minilm" if e else "lexical")
@pytest.mark.parametrize("split,kind", sorted(MEASURED))
def test_offline_judge_agreement_does_not_regress(embed, split, kind):
    variant, got = _judged(embed)
    rows = [r for r in _rows(A_FILE) if r["split"] == split]
    ref = [r["label"] for r in rows]
    out = [got[r["record_id"]] for r in rows]
    if kind == "binary":
        kappa = cohen_kappa([x == GENUINE for x in ref], [y == GENUINE for y in out])
    else:
        kappa = cohen_kappa(ref, out, LABELS)
    assert kappa == kappa, "kappa is undefined: both sources used a single class"
    floor = max(0.0, MEASURED[(split, kind)][variant] - MARGIN)
    assert kappa >= floor, f"{kind} kappa on {split} = {kappa:.3f} fell below {floor:.3f} ({variant})"
