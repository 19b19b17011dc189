"""Strict and lenient readings of genuine_followup from one labelling pass; old label files still load."""

from __future__ import annotations

import csv
import json

import pytest

from mechprobe.audit import build_report, report_markdown, table_from_rows
from mechprobe.audit.labels import LabellerLabels, RowLabel, read_labels_file
from mechprobe.audit.readings import STRICT, genuine_under, label_under
from mechprobe.audit.sample import draw_sample
from mechprobe.errors import UsageError

G = "genuine_followup"


def _old_export(path, rows):
    """A labels file exactly as the sheet exported it before the strict field existed."""
    path.write_text(json.dumps({"format": "mechprobe-audit-labels-v1", "sample_id": "s1",
                                "labeller": {"name": "old", "kind": "model"},
                                "rows": [{"row": r, "label": lab, "borderline": b, "note": ""} for r, lab, b in rows]}))
    return path


def test_old_label_files_load_and_read_strict_as_genuine_and_not_borderline(tmp_path):
    p = _old_export(tmp_path / "old.json", [("r1", G, False), ("r2", G, True), ("r3", "new_query", True)])
    lab = read_labels_file(p)
    by = lab.by_row()
    assert [by[r].strict for r in ("r1", "r2", "r3")] == [None, None, None]
    assert genuine_under(by["r1"], STRICT) and not genuine_under(by["r2"], STRICT)
    assert label_under(by["r2"], STRICT) == "generic_followup" and label_under(by["r3"], STRICT) == "new_query"
    # stored form is unchanged for such files, so re-importing a stored old file stays a no-op
    assert "strict" not in lab.to_dict()["rows"][0]
    assert LabellerLabels.from_dict(lab.to_dict()) == lab


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["sample_id", "row", "label", "borderline", "note", "strict"])
        w.writeheader()
        for r, lab, strict in rows:
            w.writerow({"sample_id": "s1", "row": r, "label": lab, "borderline": "", "note": "", "strict": strict})
    return path


def test_strict_column_is_read_and_checked(tmp_path):
    p = _csv(tmp_path / "a.csv", [("r1", G, "yes"), ("r2", G, "no"), ("r3", G, "assistant_continuation"),
                                   ("r4", "new_query", ""), ("r5", G, "")])
    by = read_labels_file(p, kind="person").by_row()
    assert [by[r].strict for r in ("r1", "r2", "r3", "r4", "r5")] == ["yes", "generic_followup",
                                                                      "assistant_continuation", None, None]
    assert [label_under(by[r], STRICT) for r in ("r1", "r2", "r3", "r4", "r5")] == [
        G, "generic_followup", "assistant_continuation", "new_query", G]
    stored = LabellerLabels.from_dict(read_labels_file(p, kind="person").to_dict())
    assert stored.by_row()["r3"].strict == "assistant_continuation"  # survives the stored JSON
    with pytest.raises(UsageError, match="only narrows"):
        read_labels_file(_csv(tmp_path / "b.csv", [("r1", "new_query", "yes")]), kind="person")
    with pytest.raises(UsageError, match="not yes, no or a label"):
        read_labels_file(_csv(tmp_path / "c.csv", [("r1", G, "maybe")]), kind="person")


def test_report_prints_both_readings_side_by_side():
    rows = []
    for i in range(30):
        for c in ("none", "steer"):
            rows.append({"record_id": f"{c}#{i}", "item_id": f"i{i}", "prompt": "q", "response": "a",
                         "raw_text": "t", "judge_label": G if i % 2 else "new_query", "condition": c})
    table = table_from_rows(rows)
    sample = draw_sample(table, 40, "condition", seed=0)
    keys = {rid: sample.row_key(rid) for rid in sample.record_ids}
    # both labellers call every odd turn genuine; only the first in four is genuine under the strict reading
    labs = []
    for name in ("a", "b"):
        out = []
        for rid, k in keys.items():
            i = int(rid.split("#")[1])
            out.append(RowLabel(k, G if i % 2 else "new_query", False, "", ("yes" if i % 4 == 1 else "generic_followup")
                                if i % 2 else None))
        labs.append(LabellerLabels(name, "model", sample.sample_id, tuple(out)))
    rep = build_report(table, sample, labs, n_boot=50)
    none = rep["rates"]["none"]
    assert none["corrected"]["point"] > none["strict"]["corrected"]["point"] + 0.1
    assert none["strict"]["corrected"]["lo"] < none["strict"]["corrected"]["hi"]
    assert [x["labeller"] for x in none["strict"]["corrected_by_labeller"]] == ["a", "b"]
    assert rep["inter_labeller"][0]["strict"]["binary"]["kappa"] == pytest.approx(1.0)
    assert rep["judge_vs_labeller"][0]["strict"]["binary"]["kappa"] < rep["judge_vs_labeller"][0]["binary"]["kappa"]
    d = rep["differences"][0]
    assert set(d) >= {"judge_only", "corrected", "corrected_strict"}
    md = report_markdown(rep)
    assert "corrected, strict" in md and "binary, strict" in md and "| none | consensus |" in md
