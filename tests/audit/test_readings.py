"""Strict and lenient readings of genuine_followup from one labelling pass; old label files and sheets still load."""

from __future__ import annotations

import csv
import json
import re

import pytest

from mechprobe.audit import build_report, codebook_text, report_markdown, table_from_rows
from mechprobe.audit.labels import LabellerLabels, RowLabel, read_labels_file
from mechprobe.audit.readings import STRICT, STRICT_CHOICES, STRICT_LABELS, genuine_under, label_under
from mechprobe.audit.sample import draw_sample
from mechprobe.audit.sheet import CSV_COLUMNS, STRICT_KEYS
from mechprobe.cli import main
from mechprobe.errors import UsageError
from mechprobe.io import read_json

from .run_fixture import build_run

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


# --------------------------------------------------------------------------------------- sheet.csv's strict column


@pytest.fixture()
def drawn(tmp_path, capsys):
    """A run with a drawn sample of 8 turns and its blank sheet.csv (written by the command)."""
    run = tmp_path / "run"
    build_run(run, n_steer_items=6, n_probe_items=2)
    assert main(["audit", str(run), "--n", "8"]) == 0
    capsys.readouterr()
    return run


def _sheet(run) -> tuple[list[str], list[dict[str, str]]]:
    with open(run / "audit" / "sheet.csv", newline="", encoding="utf-8") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames or []), list(r)


def _write(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def test_sheet_csv_strict_column_round_trips(drawn, tmp_path, capsys):
    header, rows = _sheet(drawn)
    assert header == list(CSV_COLUMNS) and header.index("strict") == header.index("borderline") + 1
    assert all(r["strict"] == "" for r in rows)
    strict = ["yes", "no", "assistant_continuation", "empty_or_degenerate"]
    for i, r in enumerate(rows):
        r["label"] = G if i < 4 else "new_query"
        r["strict"] = strict[i] if i < 4 else ""
    filled = _write(tmp_path / "sam.csv", header, rows)
    assert main(["audit", str(drawn), "--labels", str(filled), "--labeller-kind", "person", "--n-boot", "20"]) == 0
    stored = {r["row"]: r.get("strict") for r in read_json(drawn / "audit" / "labels" / "sam.json")["rows"]}
    assert [stored[r["row"]] for r in rows] == ["yes", "generic_followup", "assistant_continuation",
                                                "empty_or_degenerate", None, None, None, None]
    rep = read_json(drawn / "audit" / "report.json")
    (lab,) = rep["labellers"]
    assert lab["strict_given"] == 4 and lab["genuine"] == {"lenient": 4, "strict": 1}
    assert sum(s["audited_genuine"] for s in rep["rates"].values()) == 4
    assert sum(s["strict"]["audited_genuine"] for s in rep["rates"].values()) == 1


def test_older_sheet_csv_without_strict_column_still_imports(drawn, tmp_path, capsys):
    header, rows = _sheet(drawn)
    old = [c for c in header if c != "strict"]
    for i, r in enumerate(rows):
        r["label"] = G if i < 2 else "new_query"
        r["borderline"] = "1" if i == 1 else ""
    assert main(["audit", str(drawn), "--labels", str(_write(tmp_path / "old.csv", old, rows)),
                 "--labeller-kind", "person", "--n-boot", "20"]) == 0
    (lab,) = read_json(drawn / "audit" / "report.json")["labellers"]
    assert lab["strict_given"] == 0 and lab["genuine"] == {"lenient": 2, "strict": 1}  # genuine and not borderline
    # the codebook's fix for such a sheet: a column named strict added at the end
    for r in rows:
        r["strict"] = "yes" if r["label"] == G else ""
    added = _write(tmp_path / "olda.csv", [*old, "strict"], rows)
    assert {r.strict for r in read_labels_file(added, kind="person").rows} == {"yes", None}


def test_strict_typed_beyond_the_header_is_refused_and_counts_as_filled(drawn, capsys):
    header, rows = _sheet(drawn)
    old = [c for c in header if c != "strict"]
    sheet = drawn / "audit" / "sheet.csv"
    with open(sheet, "w", newline="", encoding="utf-8") as f:  # an older sheet, strict typed in a cell with no name
        w = csv.writer(f)
        w.writerow(old)
        for i, r in enumerate(rows):
            w.writerow([r[c] for c in old] + (["yes"] if i == 0 else []))
    before = sheet.read_bytes()
    assert main(["audit", str(drawn), "--n", "8"]) == 2  # a labeller's work: never overwritten
    assert "holds labels" in _one_line(capsys)
    assert sheet.read_bytes() == before
    assert main(["audit", str(drawn), "--labels", str(sheet), "--labeller-kind", "person"]) == 2
    msg = _one_line(capsys)
    assert "sheet.csv:2: cells beyond the last named column" in msg and "strict" in msg


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_sheet_offers_the_codebooks_strict_labels():
    """The sheet's strict choices are the labels the codebook's table assigns, plus yes."""
    text = codebook_text()
    section = text.split("## Strict and lenient readings")[1].split("\n## ")[0]
    table = set(re.findall(r"^\|[^\n]*\| `([a-z_]+)` \|$", section, flags=re.M))
    assert table == set(STRICT_LABELS) and STRICT_CHOICES == ("yes", *STRICT_LABELS)
    assert set(STRICT_KEYS) == set(STRICT_CHOICES) and len(set(STRICT_KEYS.values())) == len(STRICT_KEYS)
