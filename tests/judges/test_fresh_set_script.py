"""scripts/judge_fresh_set.py ``verdicts``: a judge's verdict on every sheet row, written as judged, resumed
without duplicates, and read back by the blind sets' loader as that judge's verdicts."""

from __future__ import annotations

import csv
import json

from mechprobe.audit.blind_sets import Source, load_blind_sets
from tests.script_loader import load_script


def _script():
    return load_script("scripts/judge_fresh_set.py")


def test_verdicts_cover_every_row_once_and_are_read_back(tmp_path):
    d = tmp_path / "reports" / "judge_sets" / "fresh"
    d.mkdir(parents=True)
    rows = [("r1", "What is 12 * 7?", "12 * 7 = 84.", "Why 84 and not 74?"), ("r2", "Name a prime.", "Seven.", ""),
            ("r3", "Write a haiku.", "Leaves fall...", "Write a limerick about cats.")]
    with open(d / "sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "query", "answer", "user_turn"])
        w.writerows(rows)
    (d / "key.json").write_text(json.dumps({"rows": {r[0]: {"turn_id": f"t{r[0]}", "model": "m", "dataset": "gsm8k",
                                                            "decoding": "greedy"} for r in rows}}))
    mod = _script()
    path = mod.verdicts(d, "offline-lexical")
    first = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["record_id"] for r in first) == ["r1", "r2", "r3"]
    lines = path.read_text(encoding="utf-8").splitlines()
    path.write_text("\n".join(lines[:1]) + "\n", encoding="utf-8")  # interrupted after one row
    mod.verdicts(d, "offline-lexical")
    again = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["record_id"] for r in again) == ["r1", "r2", "r3"]
    assert {r["record_id"]: r["genuine"] for r in again} == {r["record_id"]: r["genuine"] for r in first}
    blind = load_blind_sets(tmp_path, [Source("fresh", "fresh", "reports/judge_sets/fresh", "v2")])
    assert {v.turn_id for v in blind.verdicts} == {"tr1", "tr2", "tr3"}
    assert {v.judge for v in blind.verdicts} == {"offline-lexical"}


def test_a_turn_written_twice_is_one_sheet_row_that_keeps_both_records():
    mod = _script()
    rows = [{"turn_id": "t1", "record_id": "a|greedy", "decoding": "greedy"},
            {"turn_id": "t1", "record_id": "a|sample|s0", "decoding": "sample"},
            {"turn_id": "t2", "record_id": "a|sample|s1", "decoding": "sample"}]
    got = {r["turn_id"]: r for r in mod._one_row_per_turn(rows)}
    assert list(got) == ["t1", "t2"]
    assert got["t1"]["records"] == ["a|greedy", "a|sample|s0"] and got["t1"]["decoding"] == "greedy"
    assert got["t1"]["decodings"] == ["greedy", "sample"]


def _sheet(d, n=5):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "query", "answer", "user_turn"])
        w.writerows((f"r{i}", f"q{i}", f"a{i}", f"t{i}") for i in range(n))
    (d / "codebook_as_labelled.md").write_text("codebook", encoding="utf-8")


def _labels(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "label", "strict", "borderline", "note"])
        w.writerows(rows)


def test_batches_hold_the_sheet_and_merge_checks_every_row_once(tmp_path):
    import pytest

    mod = _script()
    out, dest = tmp_path / "set", tmp_path / "give"
    _sheet(out)
    (out / "labeller_instructions.md").write_text("instructions", encoding="utf-8")
    paths = mod.batches(out, dest, 2)
    assert [p.relative_to(dest).as_posix() for p in paths] == ["01/batch-01.csv", "02/batch-02.csv", "03/batch-03.csv"]
    for p in paths:  # each session's folder: its batch, the codebook, the instructions, nothing else
        assert sorted(x.name for x in p.parent.iterdir()) == ["batch-" + p.parent.name + ".csv", "codebook.md",
                                                             "instructions.md"]
        assert (p.parent / "codebook.md").read_text() == "codebook"
    with open(paths[2], newline="", encoding="utf-8") as f:
        assert [r["row"] for r in csv.DictReader(f)] == ["r4"]
    _labels(tmp_path / "a1.csv", [("r0", "genuine_followup", "yes", "0", ""), ("r1", "new_query", "", "0", ""),
                                  ("r2", "genuine_followup", "generic_followup", "1", "thin")])
    _labels(tmp_path / "a2.csv", [("r3", "empty_or_degenerate", "", "0", "")])
    with pytest.raises(SystemExit, match="1 sheet rows have no label"):
        mod.merge(out, "labeller-a", [tmp_path / "a1.csv", tmp_path / "a2.csv"])
    _labels(tmp_path / "a3.csv", [("r4", "generic_followup", "yes", "0", "")])
    with pytest.raises(Exception, match="strict 'yes' on a row labelled"):
        mod.merge(out, "labeller-a", [tmp_path / "a1.csv", tmp_path / "a2.csv", tmp_path / "a3.csv"])
    _labels(tmp_path / "a3.csv", [("r4", "generic_followup", "", "0", "")])
    dest_file = mod.merge(out, "labeller-a", [tmp_path / "a2.csv", tmp_path / "a1.csv", tmp_path / "a3.csv"])
    with open(dest_file, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["row"] for r in rows] == ["r0", "r1", "r2", "r3", "r4"]  # the sheet's order
    with pytest.raises(SystemExit, match="labelled twice"):
        mod.merge(out, "labeller-a", [tmp_path / "a1.csv", tmp_path / "a1.csv"])


def test_a_part_of_the_plan_is_its_datasets_and_an_unknown_one_is_named():
    """A set labelled in parts (the fresh test v4: GSM8K and Topical-Chat first, MATH500 later): each part is the
    plan's items of its datasets, and a dataset the plan lacks is refused naming the plan's."""
    mod = _script()
    items = {"gsm8k": ["g1"], "math500": ["m1", "m2"], "topical_chat": ["c1"]}
    assert mod._part(items, []) == items
    assert mod._part(items, ["topical_chat", "gsm8k"]) == {"gsm8k": ["g1"], "topical_chat": ["c1"]}
    try:
        mod._part(items, ["ifeval"])
    except SystemExit as e:
        assert "ifeval" in str(e) and "gsm8k, math500, topical_chat" in str(e)
    else:
        raise AssertionError("an unknown dataset was accepted")
