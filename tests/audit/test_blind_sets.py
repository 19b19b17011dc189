"""Blind-labelled sets (audit/blind_sets) and the judge table (audit/judge_table) on tiny committed-style folders."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from mechprobe.audit.blind_sets import (
    BlindLabel,
    JudgeVerdict,
    Source,
    consensus,
    genuine_of,
    load_blind_sets,
    query_item_key,
    split_of_item,
)
from mechprobe.audit.judge_table import cell_key, judge_table, model_short, read_verdicts
from mechprobe.errors import UsageError
from mechprobe.io import redact

MODEL = "qwen2.5-coder-0.5b-instruct"
COLS = ["sample_id", "row", "query", "answer", "user_turn", "label", "strict", "borderline", "note"]


def _lab(who: str, label: str, strict: str | None = None, codebook: str = "v2") -> BlindLabel:
    return BlindLabel("t", "s", codebook, who, label, strict, False)


def test_consensus_needs_two_labellers_agreeing_under_the_reading():
    g_yes, g_no = _lab("a", "genuine_followup", "yes"), _lab("b", "genuine_followup", "generic_followup")
    assert consensus([g_yes, g_no], "lenient") is True
    assert consensus([g_yes, g_no], "strict") is None  # split under strict
    assert consensus([g_yes], "lenient") is None  # one labeller is no consensus
    assert consensus([_lab("a", "new_query"), _lab("b", "new_query")], "strict") is False


def test_strict_is_never_inferred_from_a_v1_label():
    assert genuine_of(_lab("a", "genuine_followup", None, "v1"), "strict") is None
    assert genuine_of(_lab("a", "new_query", None, "v1"), "strict") is None
    assert genuine_of(_lab("a", "new_query", None, "v2"), "strict") is False
    with pytest.raises(ValueError):
        genuine_of(_lab("a", "new_query"), "loose")


def test_split_is_deterministic_label_blind_and_keeps_the_labelled_set_test_rule():
    keys = [query_item_key(f"question {i}") for i in range(400)]
    splits = [split_of_item(k) for k in keys]
    assert splits == [split_of_item(k) for k in keys]
    share = {s: splits.count(s) / len(splits) for s in ("train", "dev", "test")}
    assert 0.3 < share["test"] < 0.5 and 0.08 < share["dev"] < 0.25 and share["train"] > 0.35
    assert query_item_key("What  is\n2+2?") == query_item_key("What is 2+2?")  # whitespace does not make a new item


def _sheet_source(tmp: Path) -> Source:
    """A study-style train folder: two turns of a model and one LM-authored stimulus, two labellers."""
    d = tmp / "train"
    (d / "sheets").mkdir(parents=True)
    rows = [("r1", "Q one?", "A is 42.", "Why 42?"), ("r2", "Q two?", "B is 7.", "Solve: x=1"),
            ("r3", "Q one?", "A is 42.", "authored stimulus")]
    with (d / "sheets" / "batch01.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLS)
        for r in rows:
            w.writerow(["s", *r, "", "", "", ""])
    key = {"rows": {"r1": {"decoding": "greedy", "item_id": "gsm8k-1"}, "r2": {"decoding": "answer_removed",
                                                                               "item_id": "gsm8k-2"},
                    "r3": {"decoding": "react", "item_id": "gsm8k-1"}}}
    (d / "sheets" / "batch01.key.json").write_text(json.dumps(key))
    for who, l2 in (("labeller-a", "assistant_continuation"), ("labeller-b", "assistant_continuation")):
        (d / "labels" / "batch01").mkdir(parents=True, exist_ok=True)
        with (d / "labels" / "batch01" / f"{who}.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["sample_id", "row", "label", "strict", "borderline", "note"])
            w.writerow(["s", "r1", "genuine_followup", "yes", "0", ""])
            w.writerow(["s", "r2", l2, "", "1", ""])
            w.writerow(["s", "r3", "genuine_followup", "yes", "0", ""])
    return Source("toy", "sheets", "train", "v2", MODEL)


def test_sheet_source_loads_model_turns_only_and_the_inventory_counts_them(tmp_path):
    src = _sheet_source(tmp_path)
    b = load_blind_sets(tmp_path, [src, Source("gone", "sheets", "nowhere", "v2", MODEL)])
    assert len(b.turns) == 2  # the react stimulus is not a model turn
    assert {t.arm for t in b.turns.values()} == {"greedy", "answer_removed"}
    assert any("gone" in n and "not found" in n for n in b.notes)
    (row,) = b.counts()
    assert (row["turns"], row["labels"], row["strict_consensus"], row["strict_genuine"]) == (2, 4, 2, 1)


def test_bad_label_is_one_clear_error(tmp_path):
    src = _sheet_source(tmp_path)
    f = tmp_path / "train" / "labels" / "batch01" / "labeller-a.csv"
    f.write_text(f.read_text().replace("assistant_continuation", "assistant_voice"))
    with pytest.raises(UsageError, match="assistant_voice"):
        load_blind_sets(tmp_path, [src])


def test_judge_table_kappa_confusion_and_rates(tmp_path):
    b = load_blind_sets(tmp_path, [_sheet_source(tmp_path)])
    tids = sorted(b.turns)
    truth = {t: consensus(b.labels_of(t), "strict") for t in tids}
    perfect = [JudgeVerdict(t, "oracle", None, bool(truth[t]), "") for t in tids]
    flipped = [JudgeVerdict(t, "contrary", "strict", not truth[t], "") for t in tids]
    splits = sorted({split_of_item(t.item) for t in b.turns.values()})
    rows = judge_table(b, perfect + flipped, splits=splits, readings=("strict",), n_boot=50)
    alls = {r["judge"]: r for r in rows if r["dataset"] == "all"}
    n = sum(r["n"] for r in rows if r["dataset"] == "all" and r["judge"] == "oracle")
    assert n == 2
    for r in rows:
        if r["judge"] == "oracle":
            assert r["fp"] == r["fn"] == 0 and r["judge_genuine"] == r["labellers_genuine"]
        else:
            assert r["tp"] == r["tn"] == 0
    assert set(alls) == {"oracle", "contrary"}
    assert rows[0]["finding"].startswith("judge_table.")
    assert redact(rows) == rows  # no field the JSON writer would blank as a secret (a field named "key" was)


def test_verdicts_file_round_trip_and_bad_row(tmp_path):
    f = tmp_path / "v.jsonl"
    f.write_text(json.dumps({"turn_id": "t1", "judge": "textfit", "reading": "strict", "genuine": True}) + "\n")
    (v,) = read_verdicts(f)
    assert (v.turn_id, v.judge, v.reading, v.genuine) == ("t1", "textfit", "strict", True)
    assert read_verdicts(tmp_path / "missing.jsonl") == []
    f.write_text('{"turn_id": "t1"}\n')
    with pytest.raises(UsageError, match="v.jsonl:1"):
        read_verdicts(f)


def test_key_names():
    assert model_short("qwen2.5-coder-1.5b-instruct") == "qwen1.5b"
    assert model_short("smollm2-135m-instruct") == "smollm135m"
    assert cell_key("hybrid2:qwen2.5-coder-1.5b-instruct", MODEL, "all", "strict", "test") == \
        "judge_table.hybrid2_qwen2_5-coder-1_5b-instruct.qwen0.5b.all.strict.test"


def test_heldout_layout_with_the_study_judges_verdicts(tmp_path):
    """The study's held-out folder: one sheet, labels/<name>.csv, verdicts_<spec>.jsonl keyed by sheet row."""
    d = tmp_path / "heldout"
    (d / "labels").mkdir(parents=True)
    with (d / "sheet.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLS)
        w.writerow(["h", "r1", "Q?", "A 5.", "Why 5?", "", "", "", ""])
        w.writerow(["h", "r2", "Q2?", "A 6.", "Tell me a joke", "", "", "", ""])
    (d / "sheet.key.json").write_text(json.dumps({"sample_id": "h", "rows": {
        "r1": {"arm": "base", "item_id": "gsm8k-1", "turn_id": "gsm8k-1|base"},
        "r2": {"arm": "answer_removed", "item_id": "gsm8k-2", "turn_id": "gsm8k-2|answer_removed"}}}))
    for who in ("labeller-c", "labeller-d"):
        (d / "labels" / f"{who}.csv").write_text("sample_id,row,label,strict,borderline,note\n"
                                                 "h,r1,genuine_followup,yes,0,\nh,r2,new_query,,0,\n")
    (d / "verdicts_hybrid-voice_qwen2.5-coder-1.5b-instruct.jsonl").write_text(
        json.dumps({"record_id": "r1", "genuine": True}) + "\n" + json.dumps({"record_id": "r2", "genuine": True}))
    b = load_blind_sets(tmp_path, [Source("held", "sheets", "heldout", "v2", MODEL)])
    assert sorted(t.arm for t in b.turns.values()) == ["answer_removed", "base"]
    assert {v.judge for v in b.verdicts} == {"hybrid-voice:qwen2.5-coder-1.5b-instruct"} and len(b.verdicts) == 2
    assert sorted(consensus(b.labels_of(t), "strict") for t in b.turns) == [False, True]


def test_fresh_layout_holds_several_models_in_one_sheet(tmp_path):
    """The judge's fresh test set: one blind sheet over two subject models; the key gives each row's model and
    dataset, the labels are the labellers' own files."""
    d = tmp_path / "reports" / "judge_sets" / "fresh"
    (d / "labels").mkdir(parents=True)
    rows = [("r1", "What is 2+2?", "4.", "Why 4?", "m-a", "gsm8k"), ("r2", "What is 2+2?", "4.", "Thanks", "m-b", "gsm8k"),
            ("r3", "Write a poem.", "Roses...", "More roses?", "m-a", "ifeval")]
    with open(d / "sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "query", "answer", "user_turn"])
        w.writerows([r[:4] for r in rows])
    (d / "key.json").write_text(json.dumps({"rows": {r[0]: {"turn_id": f"t{r[0]}", "model": r[4], "dataset": r[5],
                                                            "decoding": "greedy"} for r in rows}}))
    for who in ("labeller-a", "labeller-b"):
        with open(d / "labels" / f"{who}.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["row", "label", "strict", "borderline", "note"])
            w.writerow(["r1", "genuine_followup", "yes", "0", ""])
            w.writerow(["r2", "generic_followup", "", "0", ""])
            w.writerow(["r3", "genuine_followup", "generic_followup", "1", "plan"])
    blind = load_blind_sets(tmp_path, [Source("fresh", "fresh", "reports/judge_sets/fresh", "v2")])
    assert {t.model for t in blind.turns.values()} == {"m-a", "m-b"}
    assert blind.turns["tr3"].dataset == "ifeval" and blind.turns["tr2"].turn == "Thanks"
    assert consensus(blind.labels_of("tr1"), "strict") is True and consensus(blind.labels_of("tr3"), "strict") is False
    assert consensus(blind.labels_of("tr3"), "lenient") is True
    # a judge's committed verdicts beside the sheet, keyed by row, are read as that judge's (turn id, file named)
    (d / "verdicts_hybrid-voice_m-judge.jsonl").write_text(
        "".join(json.dumps({"record_id": r, "genuine": r == "r1"}) + "\n" for r in ("r1", "r2", "rX")))
    blind = load_blind_sets(tmp_path, [Source("fresh", "fresh", "reports/judge_sets/fresh", "v2")])
    assert sorted((v.turn_id, v.genuine) for v in blind.verdicts) == [("tr1", True), ("tr2", False)]
    assert {v.judge for v in blind.verdicts} == {"hybrid-voice:m-judge"}
    assert {v.where for v in blind.verdicts} == {"reports/judge_sets/fresh/verdicts_hybrid-voice_m-judge.jsonl"}
