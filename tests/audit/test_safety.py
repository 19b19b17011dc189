"""The audit never loses a labeller's work and never writes a report it cannot stand behind.

Each test drives ``mechprobe audit`` (the CLI entry, so a refusal is checked as one line on stderr and exit 2)
on the tiny real run of :mod:`.run_fixture`: spreadsheet formulas in sheet.csv, a filled sheet.csv, a CSV of two
labellers, two audits at once, bad labels files, damaged stored files, a read-only run, a full disk and
nonsense interval flags.
"""

from __future__ import annotations

import builtins
import csv
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mechprobe.io as mio
from mechprobe.audit import load_run_table, load_sample, read_labels_file
from mechprobe.cli import main
from mechprobe.errors import UsageError, UserError
from mechprobe.io import read_json

from .run_fixture import build_run

REPO = Path(__file__).resolve().parents[2]


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def _snapshot(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes: what a refused command must leave exactly as it was."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _debris(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob("*") if p.name.endswith((".lock", ".tmp")))


@pytest.fixture()
def drawn(tmp_path, capsys):
    """A run with a drawn sample of 8 turns (sheet.html + blank sheet.csv)."""
    run = tmp_path / "run"
    build_run(run, n_steer_items=6, n_probe_items=2)
    assert main(["audit", str(run), "--n", "8"]) == 0
    capsys.readouterr()
    return run


def _sheet(run: Path) -> list[dict[str, str]]:
    with open(run / "audit" / "sheet.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _write_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _export(path: Path, sample_id: str, rows: list, labeller: object = None) -> Path:
    path.write_text(json.dumps({"format": "mechprobe-audit-labels-v1", "sample_id": sample_id,
                                "labeller": {"name": path.stem, "kind": "person"} if labeller is None else labeller,
                                "rows": rows}))
    return path


def _labels_json(run: Path, path: Path, label: str = "new_query") -> Path:
    sample = load_sample(run)
    return _export(path, sample.sample_id, [{"row": k, "label": label, "borderline": False, "note": ""}
                                            for k in sample.keys()])


# --------------------------------------------------------------------------------------- formula injection


FORMULAS = ["=HYPERLINK(\"http://x.example\",\"click\")", "-2+3", "+1", "@SUM(A1)", "\t=1+1", "\r=1+1",
            "- How did you get 24?"]


def test_formula_cells_are_quoted_in_sheet_csv(tmp_path, capsys):
    run = tmp_path / "run"
    build_run(run, n_steer_items=len(FORMULAS), n_probe_items=2)
    none = run / "steering" / "alpha_0_none.jsonl"
    rows = [json.loads(x) for x in none.read_text().splitlines()]
    for r, f in zip(rows, FORMULAS):
        r["raw_text"] = r["text"] = f
    none.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a_p = run / "assistant.jsonl"
    answers = [json.loads(x) for x in a_p.read_text().splitlines()]
    answers[0]["prompt"] = "=1+1 is the question"
    answers[0]["response"] = "-5 is the answer"
    a_p.write_text("".join(json.dumps(r) + "\n" for r in answers))

    assert main(["audit", str(run), "--n", "100"]) == 0  # every turn of the run
    out = capsys.readouterr().out
    assert "leading '" in out and any(line.endswith("sheet.csv") for line in out.splitlines())
    sheet = _sheet(run)
    texts = [r[c] for r in sheet for c in ("query", "answer", "user_turn")]
    assert not [t for t in texts if t[:1] in ("=", "+", "-", "@", "\t", "\r")]
    turns = {r["user_turn"] for r in sheet}
    for f in FORMULAS:
        assert "'" + f in turns
    assert "'=1+1 is the question" in {r["query"] for r in sheet}
    assert "'-5 is the answer" in {r["answer"] for r in sheet}
    # the page shows the texts themselves (no spreadsheet there), and the filled CSV imports as before
    assert "- How did you get 24?" in (run / "audit" / "sheet.html").read_text()
    for r in sheet:
        r["label"], r["labeller"] = "new_query", "ann"
    filled = _write_csv(tmp_path / "ann.csv", sheet)
    assert main(["audit", str(run), "--labels", str(filled), "--labeller-kind", "person", "--n-boot", "20"]) == 0
    assert len(read_json(run / "audit" / "labels" / "ann.json")["rows"]) == len(sheet)


# --------------------------------------------------------------------------------------- filled sheet.csv


def test_filled_sheet_csv_is_never_overwritten(drawn, capsys):
    run = drawn
    sheet = _sheet(run)
    for r in sheet[:3]:
        r["label"] = "generic_followup"
    csv_p = _write_csv(run / "audit" / "sheet.csv", sheet)
    before = _snapshot(run / "audit")

    assert main(["audit", str(run), "--n", "8"]) == 2  # same arguments: today "reused sample" + a blank sheet
    msg = _one_line(capsys)
    assert "holds labels" in msg and f"--labels {csv_p}" in msg
    assert main(["audit", str(run), "--n", "9", "--redraw"]) == 2  # a redraw would orphan them
    assert "holds labels" in _one_line(capsys)
    assert _snapshot(run / "audit") == before and not _debris(run)

    # the message's own fix works: import it, and the labels are stored apart from the sheet
    assert main(["audit", str(run), "--labels", str(csv_p), "--labeller-kind", "person", "--n-boot", "20"]) == 0
    assert len(read_json(run / "audit" / "labels" / "sheet.json")["rows"]) == 3
    # a blank sheet (or one only re-saved) is rewritten as before
    csv_p.rename(run / "audit" / "ann.csv")
    assert main(["audit", str(run), "--n", "8"]) == 0
    assert "reused sample" in capsys.readouterr().out
    assert all(r["label"] == "" for r in _sheet(run))
    assert main(["audit", str(run), "--n", "8"]) == 0


def test_sheet_csv_saved_in_another_encoding_counts_as_filled(drawn, capsys):
    csv_p = drawn / "audit" / "sheet.csv"
    csv_p.write_bytes(csv_p.read_bytes() + "\u00e9".encode("cp1252"))
    assert main(["audit", str(drawn), "--n", "8"]) == 2
    assert "holds labels" in _one_line(capsys)


# --------------------------------------------------------------------------------------- two labellers, one CSV


def test_csv_of_two_labellers_is_split_by_name(drawn, tmp_path, capsys):
    run = drawn
    sheet = _sheet(run)
    for i, r in enumerate(sheet):
        r["label"] = "genuine_followup" if i % 2 else "new_query"
        r["labeller"] = "carol" if i < 4 else "dave"
    shared = _write_csv(tmp_path / "shared.csv", sheet)
    assert main(["audit", str(run), "--labels", str(shared), "--labeller-kind", "person", "--n-boot", "20"]) == 0
    out = capsys.readouterr().out
    stored = {p.stem: read_json(p) for p in (run / "audit" / "labels").glob("*.json")}
    assert set(stored) == {"carol", "dave"}  # today: one labeller "shared" with all 8 rows
    assert len(stored["carol"]["rows"]) == 4 and len(stored["dave"]["rows"]) == 4
    assert {r["row"] for r in stored["carol"]["rows"]} == {r["row"] for r in sheet[:4]}
    rep = read_json(run / "audit" / "report.json")
    assert [lab["name"] for lab in rep["labellers"]] == ["carol", "dave"]
    assert "carol (person, 4 labelled" in out
    with pytest.raises(UsageError, match="2 labellers"):
        read_labels_file(shared, kind="person")

    sheet[0]["labeller"] = ""  # a labelled row nobody owns, beside named ones
    orphan = _write_csv(tmp_path / "orphan.csv", sheet)
    before = _snapshot(run / "audit")
    assert main(["audit", str(run), "--labels", str(orphan), "--labeller-kind", "person"]) == 2
    assert "without a labeller name" in _one_line(capsys)
    assert _snapshot(run / "audit") == before


# --------------------------------------------------------------------------------------- two audits at once


_HOLDER = ("import sys, time\n"
           "from mechprobe.audit.store import audit_lock\n"
           "with audit_lock(sys.argv[1]):\n"
           "    print('held', flush=True)\n"
           "    time.sleep(60)\n")


@pytest.mark.parametrize("argv", [["--labels", "{alice}", "--n-boot", "20"], ["--n", "9", "--redraw"],
                                  ["--n", "8"]])
def test_second_audit_writer_is_refused(drawn, tmp_path, capsys, argv):
    run = drawn
    alice = _labels_json(run, tmp_path / "alice.json")
    before = _snapshot(run / "audit")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run / "audit")], stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["audit", str(run), *[a.format(alice=alice) for a in argv]]) == 2
        assert f"being written by another process (pid {holder.pid}" in _one_line(capsys)
        assert _snapshot(run / "audit") == {**before, "audit.lock": (run / "audit" / "audit.lock").read_bytes()}
    finally:
        holder.kill()
        holder.wait()
    assert main(["audit", str(run), *[a.format(alice=alice) for a in argv]]) == 0
    assert not _debris(run)  # no lock file is left after a clean exit, nor after a refusal
    assert main(["audit", str(run), "--labels", str(tmp_path / "missing.json")]) == 2
    assert not _debris(run)


def test_lock_file_replaced_between_open_and_lock(tmp_path, monkeypatch):
    """A holder that removes its lock file on exit cannot let two writers in: the lock taken is re-checked."""
    import fcntl

    target = tmp_path / "x"
    lock = tmp_path / "x.lock"
    real = mio.fcntl.flock
    calls = []

    def racing_flock(fd, op):
        if not calls:  # the previous holder exits (removes its file) and a third process creates a new one
            calls.append(1)
            lock.unlink()
            lock.write_text("pid 1, other")
        return real(fd, op)

    monkeypatch.setattr(mio.fcntl, "flock", racing_flock)
    with mio.writer_lock(target, remove=True):
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the file at the path is the one held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not lock.exists()


# --------------------------------------------------------------------------------------- bad labels files


def _bad_files(tmp_path: Path, sample_id: str, key: str) -> dict[str, Path]:
    row = {"row": key, "label": "new_query", "borderline": False, "note": ""}
    f = {}
    f["cp1252.csv"] = tmp_path / "cp1252.csv"
    f["cp1252.csv"].write_bytes(f"sample_id,row,label,note\n{sample_id},{key},new_query,caf\u00e9\n".encode("cp1252"))
    f["binary.csv"] = tmp_path / "binary.csv"
    f["binary.csv"].write_bytes(b"PK\x03\x04\x14\x00\x06\x00\x08\x00\x00\x00!\x00\xff\xfe\x00")
    f["binary.json"] = tmp_path / "binary.json"
    f["binary.json"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff")
    f["labeller_str.json"] = _export(tmp_path / "labeller_str.json", sample_id, [row], labeller="ann")
    f["labeller_name_list.json"] = _export(tmp_path / "labeller_name_list.json", sample_id, [row],
                                           labeller={"name": ["ann"], "kind": "person"})
    f["rows_dict.json"] = _export(tmp_path / "rows_dict.json", sample_id, {"a": row})  # type: ignore[arg-type]
    f["rows_str.json"] = _export(tmp_path / "rows_str.json", sample_id, "new_query")  # type: ignore[arg-type]
    f["row_str.json"] = _export(tmp_path / "row_str.json", sample_id, ["new_query"])
    f["label_int.json"] = _export(tmp_path / "label_int.json", sample_id, [{**row, "label": 3}])
    f["borderline_maybe.json"] = _export(tmp_path / "borderline_maybe.json", sample_id,
                                         [{**row, "borderline": "maybe"}])
    f["borderline_list.json"] = _export(tmp_path / "borderline_list.json", sample_id, [{**row, "borderline": [1]}])
    f["borderline_2.json"] = _export(tmp_path / "borderline_2.json", sample_id, [{**row, "borderline": 2}])
    return f


BAD = ["cp1252.csv", "binary.csv", "binary.json", "labeller_str.json", "labeller_name_list.json", "rows_dict.json",
       "rows_str.json", "row_str.json", "label_int.json", "borderline_maybe.json", "borderline_list.json",
       "borderline_2.json"]


@pytest.mark.parametrize("name", BAD)
def test_bad_labels_file_is_one_line_and_stores_nothing(drawn, tmp_path, capsys, name):
    run = drawn
    sample = load_sample(run)
    ok = _labels_json(run, tmp_path / "first.json")
    assert main(["audit", str(run), "--labels", str(ok), "--n-boot", "20"]) == 0
    capsys.readouterr()
    before = _snapshot(run / "audit")
    bad = _bad_files(tmp_path, sample.sample_id, next(iter(sample.keys())))[name]
    assert main(["audit", str(run), "--labels", str(bad), "--labeller-kind", "person"]) == 2
    msg = _one_line(capsys)
    assert bad.name in msg
    assert _snapshot(run / "audit") == before and not _debris(run)


@pytest.mark.parametrize("value,stored", [("false", False), ("0", False), (0, False), ("no", False), ("", False),
                                          (None, False), (False, False), ("true", True), ("1", True), (1, True),
                                          (True, True)])
def test_borderline_is_parsed_strictly(drawn, tmp_path, value, stored):
    run = drawn
    sample = load_sample(run)
    p = _export(tmp_path / "bea.json", sample.sample_id,
                [{"row": k, "label": "new_query", "borderline": value, "note": ""} for k in sample.keys()])
    assert main(["audit", str(run), "--labels", str(p), "--n-boot", "20"]) == 0
    rows = read_json(run / "audit" / "labels" / "bea.json")["rows"]
    assert {r["borderline"] for r in rows} == {stored}  # today "false" and "0" were stored as true


# --------------------------------------------------------------------------------------- the run changed since


def test_sampled_turn_judged_judge_error_later(drawn, tmp_path, capsys):
    run = drawn
    sample = load_sample(run)
    alice = _labels_json(run, tmp_path / "alice.json")
    assert main(["audit", str(run), "--labels", str(alice), "--n-boot", "20"]) == 0
    capsys.readouterr()
    probe = next(r for r in sample.record_ids if "#" not in r)
    labels_p = run / "labels.jsonl"
    rows = [json.loads(x) for x in labels_p.read_text().splitlines()]
    for r in rows:
        if r["record_id"] == probe:
            r.update(label="judge_error", genuine=None, error="rate limit")
    labels_p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not load_run_table(run).has(probe)
    before = _snapshot(run / "audit")
    bob = _labels_json(run, tmp_path / "bob.json")
    assert main(["audit", str(run), "--labels", str(bob), "--n-boot", "20"]) == 2  # today a KeyError traceback
    msg = _one_line(capsys)
    assert probe in msg and "mechprobe judge" in msg and "--redraw" in msg
    assert _snapshot(run / "audit") == before  # bob is not half-imported; alice is kept


@pytest.mark.parametrize("damage", ["truncated", "bogus_label", "rows_not_list", "borderline_str", "stray_row"])
def test_damaged_stored_labels_are_one_line(drawn, tmp_path, capsys, damage):
    run = drawn
    alice = _labels_json(run, tmp_path / "alice.json")
    assert main(["audit", str(run), "--labels", str(alice), "--n-boot", "20"]) == 0
    capsys.readouterr()
    stored = run / "audit" / "labels" / "alice.json"
    d = read_json(stored)
    if damage == "truncated":
        stored.write_text(stored.read_text()[:100])
    else:
        if damage == "bogus_label":
            d["rows"][0]["label"] = "bogus"
        elif damage == "rows_not_list":
            d["rows"] = {"x": d["rows"][0]}
        elif damage == "borderline_str":
            d["rows"][0]["borderline"] = "perhaps"
        else:
            d["rows"][0]["row"] = "rdeadbeef00"
        stored.write_text(json.dumps(d))
    before = _snapshot(run / "audit")
    bob = _labels_json(run, tmp_path / "bob.json")
    assert main(["audit", str(run), "--labels", str(bob), "--n-boot", "20"]) == 2
    msg = _one_line(capsys)
    assert "alice.json" in msg and "import" in msg
    assert _snapshot(run / "audit") == before


# --------------------------------------------------------------------------------------- read-only run, full disk


@pytest.fixture()
def read_only(monkeypatch):
    """Make every write under a directory fail with EROFS (the tests run as root, so chmod would not)."""
    state: dict[str, Path] = {}

    def inside(path) -> bool:
        return "root" in state and str(path).startswith(str(state["root"]))

    def fail(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    real_open, real_os_open, real_mkdir, real_replace = builtins.open, os.open, os.mkdir, os.replace

    def ro_open(file, mode="r", *a, **kw):
        if inside(file) and any(c in mode for c in "wax+"):
            fail(file)
        return real_open(file, mode, *a, **kw)

    def ro_os_open(path, flags, *a, **kw):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            fail(path)
        return real_os_open(path, flags, *a, **kw)

    def ro_mkdir(path, *a, **kw):
        if inside(path):
            fail(path)
        return real_mkdir(path, *a, **kw)

    def ro_replace(src, dst, *a, **kw):
        if inside(dst):
            fail(dst)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(builtins, "open", ro_open)
    monkeypatch.setattr(io, "open", ro_open)
    monkeypatch.setattr(os, "open", ro_os_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    monkeypatch.setattr(os, "replace", ro_replace)
    return state


def test_read_only_run_is_one_line(tmp_path, capsys, read_only):
    run = tmp_path / "run"
    build_run(run, n_steer_items=6, n_probe_items=2)
    read_only["root"] = run
    assert main(["audit", str(run), "--n", "8"]) == 2  # today a PermissionError/OSError traceback
    assert "read-only" in _one_line(capsys)
    assert not (run / "audit").exists()


def test_read_only_audit_dir_is_one_line(drawn, tmp_path, capsys, read_only):
    before = _snapshot(drawn / "audit")
    alice = _labels_json(drawn, tmp_path / "alice.json")
    read_only["root"] = drawn
    assert main(["audit", str(drawn), "--labels", str(alice), "--n-boot", "20"]) == 2
    assert "read-only" in _one_line(capsys)
    read_only.clear()
    assert _snapshot(drawn / "audit") == before


@pytest.fixture()
def disk_full(monkeypatch):
    """Writes into files under a directory write half their first chunk, then fail with ENOSPC."""
    state: dict[str, Path] = {}
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, s):
            self._f.write(s[: len(s) // 2])
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def full_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        if "root" in state and str(file).startswith(str(state["root"])) and any(c in mode for c in "wax+"):
            return Full(f)
        return f

    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)
    return state


def test_disk_full_during_report_keeps_the_old_report(drawn, tmp_path, capsys, disk_full):
    run = drawn
    alice = _labels_json(run, tmp_path / "alice.json")
    assert main(["audit", str(run), "--labels", str(alice), "--n-boot", "20"]) == 0
    capsys.readouterr()
    before = _snapshot(run / "audit")
    bob = _labels_json(run, tmp_path / "bob.json", "generic_followup")
    disk_full["root"] = run
    assert main(["audit", str(run), "--labels", str(bob), "--n-boot", "20"]) == 2  # today an OSError traceback
    assert "no space left" in _one_line(capsys).lower()
    disk_full.clear()
    assert _snapshot(run / "audit") == before  # old report whole, bob not half-stored
    assert not _debris(run) and not [p for p in run.rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert main(["audit", str(run), "--labels", str(bob), "--n-boot", "20"]) == 0  # the same command, space freed
    assert [lab["name"] for lab in read_json(run / "audit" / "report.json")["labellers"]] == ["alice", "bob"]


def test_disk_full_during_draw_leaves_no_empty_files(tmp_path, capsys, disk_full):
    run = tmp_path / "run"
    build_run(run, n_steer_items=6, n_probe_items=2)
    disk_full["root"] = run / "audit"
    assert main(["audit", str(run), "--n", "8"]) == 2
    assert "no space left" in _one_line(capsys).lower()
    disk_full.clear()
    assert not _debris(run) and not [p for p in run.rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert main(["audit", str(run), "--n", "8"]) == 0
    assert len(_sheet(run)) == 8


# --------------------------------------------------------------------------------------- interval flags


@pytest.mark.parametrize("flags", [["--confidence", "nan"], ["--confidence", "2"], ["--confidence", "-1"],
                                   ["--confidence", "0"], ["--confidence", "1"], ["--confidence", "inf"],
                                   ["--n-boot", "0"], ["--n-boot", "-5"]])
def test_bad_alpha_or_n_boot_is_refused_before_anything(drawn, tmp_path, capsys, flags):
    run = drawn
    alice = _labels_json(run, tmp_path / "alice.json")
    before = _snapshot(run / "audit")
    assert main(["audit", str(run), "--labels", str(alice), *flags]) == 2  # today a report of [nan%, nan%]
    msg = _one_line(capsys)
    assert flags[0] in msg
    assert _snapshot(run / "audit") == before


def test_build_report_refuses_bad_alpha(drawn):
    from mechprobe.audit import build_report

    with pytest.raises(UserError, match="alpha="):  # below the CLI the message names the parameter
        build_report(load_run_table(drawn), load_sample(drawn), [], alpha=float("nan"))


def test_confidence_is_the_audit_flag_and_alpha_a_deprecated_spelling_of_one_minus_it(capsys):
    import argparse

    from mechprobe.cli import audit as cli_audit

    p = argparse.ArgumentParser()
    cli_audit.add_args(p)
    assert cli_audit.significance(p.parse_args(["runs/x"])) == 0.05  # exactly what the report always used
    assert cli_audit.significance(p.parse_args(["runs/x", "--confidence", "0.9"])) == 0.1
    assert cli_audit.significance(p.parse_args(["runs/x", "--alpha", "0.1"])) == 0.1
    assert "deprecated" in capsys.readouterr().err
    with pytest.raises(UserError, match="disagree"):
        cli_audit.significance(p.parse_args(["runs/x", "--alpha", "0.1", "--confidence", "0.8"]))
