"""scripts/steer_audit_table.py on a real audited run: every condition gets judge-only, corrected and both readings."""

from __future__ import annotations

import json

from mechprobe.audit import load_sample
from mechprobe.cli.audit import run
from tests.script_loader import load_script

from .run_fixture import build_run
from .test_roundtrip import _ns


def _script():
    return load_script("scripts/steer_audit_table.py")


def test_dose_response_table_from_an_audit_by_condition_and_decoding(tmp_path):
    truth = build_run(tmp_path / "run")
    rd = tmp_path / "run"
    assert run(_ns(str(rd), "--n", "30", "--by", "condition+decoding", "--seed", "0")) == 0
    sample = load_sample(rd)
    files = []
    for lab in ("E", "F"):
        rows = [{"row": k, "label": truth[lab].get(rid) or truth["C"][rid], "borderline": False, "note": ""}
                for k, rid in sample.keys().items()]
        p = tmp_path / f"{lab}.json"
        p.write_text(json.dumps({"format": "mechprobe-audit-labels-v1", "sample_id": sample.sample_id,
                                 "labeller": {"name": lab, "kind": "model"}, "rows": rows}))
        files.append(str(p))
    assert run(_ns(str(rd), "--labels", *files, "--n-boot", "20")) == 0
    out, fig = tmp_path / "steer.md", tmp_path / "steer.png"
    assert _script().main([str(rd), "--model", "fixture-model", "--out", str(out), "--figure", str(fig)]) == 0
    md = out.read_text()
    for cond in ("probe greedy", "probe T1", "none greedy", "diff_means L14 a0.8 greedy", "random L14 a0.8 greedy"):
        assert f"| {cond} |" in md
    assert fig.stat().st_size > 10_000
    dm = next(line for line in md.splitlines() if line.startswith("| diff_means"))
    assert dm.count("%") >= 8  # judge only, corrected, both readings, template share, both differences
