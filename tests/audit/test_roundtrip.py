"""Round trip on a real run: draw -> sheet (blind) -> filled CSV and JSON labels -> import -> report."""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mechprobe.audit import load_labellers, load_run_table, load_sample
from mechprobe.cli.audit import add_args, run
from mechprobe.io import read_json

from .run_fixture import build_run

REPO = Path(__file__).resolve().parents[2]


def _ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def fill_csv(src: Path, dest: Path, labels_by_key: dict[str, str], name: str | None = None) -> None:
    """A labeller fills sheet.csv in a spreadsheet: label column (and a borderline flag on one row)."""
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    for i, r in enumerate(rows):
        r["label"] = labels_by_key.get(r["row"], "")
        r["borderline"] = "1" if i == 0 else ""
        if name:
            r["labeller"] = name
    with open(dest, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.fixture()
def drawn(tmp_path, capsys):
    truth = build_run(tmp_path / "run")
    assert run(_ns(str(tmp_path / "run"), "--n", "24", "--by", "condition", "--seed", "0")) == 0
    out = capsys.readouterr().out
    return tmp_path / "run", truth, out


def test_sheet_is_blind_and_complete(drawn):
    run_dir, _, out = drawn
    html_p, csv_p = run_dir / "audit" / "sheet.html", run_dir / "audit" / "sheet.csv"
    assert str(html_p) in out and str(csv_p) in out
    sample, table = load_sample(run_dir), load_run_table(run_dir)
    page = html_p.read_text()
    for rid in sample.record_ids:
        assert rid not in page  # record ids name the condition file
        assert sample.row_key(rid) in page
    for secret in ("diff_means", "random|L14", "hybrid:test", "hand-D", "alpha_0"):
        assert secret not in page
    data = json.loads(page.split('id="sheet-data">')[1].split("</script>")[0])
    assert all(set(r) == {"row", "query", "answer", "turn", "truncated"} for r in data["rows"])
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    # special tokens are data, escaped inside the JSON script block, never raw HTML
    assert "\\u003c|im_end|\\u003e" in page
    with open(csv_p, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 24 and all(r["label"] == "" for r in rows)
    assert {r["row"] for r in rows} == set(sample.keys())
    assert {r["user_turn"] for r in rows} == {table.get(rid).turn for rid in sample.record_ids}
    order = [r["row"] for r in rows]
    assert order != [sample.row_key(r) for r in sample.record_ids]  # shuffled, not in stratum order


def test_import_and_report(drawn, tmp_path, capsys):
    run_dir, truth, _ = drawn
    sample = load_sample(run_dir)
    keys = sample.keys()
    by_key = {lab: {k: truth[lab].get(rid) or truth["C"][rid] for k, rid in keys.items()} for lab in ("E", "F")}
    fill_csv(run_dir / "audit" / "sheet.csv", tmp_path / "eve.csv", by_key["E"])
    export = {"format": "mechprobe-audit-labels-v1", "sample_id": sample.sample_id,
              "labeller": {"name": "fred", "kind": "model"},
              "rows": [{"row": k, "label": v, "borderline": False, "note": ""} for k, v in by_key["F"].items()]}
    (tmp_path / "fred.json").write_text(json.dumps(export))
    assert run(_ns(str(run_dir), "--labels", str(tmp_path / "eve.csv"), str(tmp_path / "fred.json"),
                   "--labeller-kind", "model", "--n-boot", "50")) == 0
    out = capsys.readouterr().out
    assert "judge only" in out and "corrected (n audited)" in out
    stored = read_json(run_dir / "audit" / "labels" / "eve.json")
    assert stored["labeller"] == {"name": "eve", "kind": "model"} and len(stored["rows"]) == 24
    assert sum(r["borderline"] for r in stored["rows"]) == 1
    assert [lab.name for lab in load_labellers(run_dir, sample)] == ["eve", "fred"]
    rep = read_json(run_dir / "audit" / "report.json")
    assert set(rep["rates"]) == {"probe", "none", "diff_means|L14|a0.8", "random|L14|a0.8"}
    dm = rep["rates"]["diff_means|L14|a0.8"]
    # the probe stratum has 4 items: one turn each, and its remainder goes to the steered strata (7, 7, 6)
    assert sample.per_stratum == {"diff_means|L14|a0.8": 7, "none": 7, "probe": 4, "random|L14|a0.8": 6}
    assert dm["n_turns"] == 16 and dm["n_audited"] == 7
    assert dm["judge_only"]["n_audited"] == 0 and dm["corrected"]["n_audited"] == 7
    assert rep["rates"]["probe"]["clustered"] and "cluster" in rep["rates"]["probe"]["judge_only"]["method"]
    assert rep["codebook_version"] == "v2" and rep["sample"]["codebook_version"] == "v2"
    assert set(dm["strict"]) == {"audited_genuine", "corrected", "corrected_by_labeller"}
    assert [x["labeller"] for x in dm["corrected_by_labeller"]] == ["eve", "fred"]
    assert len(rep["inter_labeller"]) == 1 and rep["inter_labeller"][0]["binary"]["n"] == 24
    assert {(k["labeller"], k["stratum"]) for k in rep["judge_vs_labeller"]} >= {("eve", "none"), ("fred", "all")}
    assert sum(sum(v.values()) for v in rep["confusion"]["counts"].values()) == 24
    diffs = {d["condition"]: d for d in rep["differences"]}
    assert set(diffs) == {"diff_means|L14|a0.8", "random|L14|a0.8"}
    assert diffs["diff_means|L14|a0.8"]["corrected"]["n_audited"] == 7
    assert diffs["diff_means|L14|a0.8"]["corrected_strict"]["n_audited"] == 7
    assert diffs["diff_means|L14|a0.8"]["judge_only"]["n_total"] == 16
    md = (run_dir / "audit" / "report.md").read_text()
    assert "| diff_means\\|L14\\|a0.8 | 16 |" in md and "Paired difference" in md
    assert "corrected, strict" in md and "binary, strict" in md and "Corrected rate per labeller" in md
    assert "codebook v2" in md
    # importing the same files again is a no-op
    assert run(_ns(str(run_dir), "--labels", str(tmp_path / "fred.json"), "--n-boot", "20")) == 0


def test_python_c_wrapper(tmp_path):
    build_run(tmp_path / "run", n_steer_items=6, n_probe_items=2)
    code = ("import argparse, sys; from mechprobe.cli.audit import add_args, run; p = argparse.ArgumentParser(); "
            "add_args(p); sys.exit(run(p.parse_args(sys.argv[1:])))")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), "--n", "8", "--by", "decoding"],
                         capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert any(line.endswith("sheet.csv") for line in lines) and any(line.endswith("identify.html") for line in lines)
    assert lines[-1].startswith("  3. import and report: mechprobe audit ")  # the next step is printed last
    res = subprocess.run([sys.executable, "-m", "mechprobe", "audit", str(tmp_path / "run"), "--n", "9"],
                         capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                         timeout=120)
    assert res.returncode == 2 and "--redraw" in res.stderr and "Traceback" not in res.stderr
