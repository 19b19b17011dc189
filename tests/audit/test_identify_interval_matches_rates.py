"""The identification table's judge-only genuine rate is the rates table's, interval included.

Why: one report showed the same stratum's judge-only rate with a Wilson interval in the identification table and
with the item-cluster interval in the rates table (turns of one item are not independent).
"""

from __future__ import annotations

import json

from mechprobe.audit import load_sample
from mechprobe.audit.identify import IDENTIFY_FORMAT, load_pairs
from mechprobe.cli.main import main
from mechprobe.io import read_json

from .run_fixture import build_run


def test_identification_judge_only_equals_the_rates_table(tmp_path, capsys):
    run_dir = tmp_path / "run"
    build_run(run_dir, n_steer_items=8, n_probe_items=4)
    assert main(["audit", str(run_dir), "--n", "12", "--by", "condition"]) == 0
    sample = load_sample(run_dir)
    pairs = load_pairs(run_dir, sample)
    f = tmp_path / "ida.json"
    f.write_text(json.dumps({"format": IDENTIFY_FORMAT, "sample_id": sample.sample_id,
                             "labeller": {"name": "ida", "kind": "person"},
                             "rows": [{"row": q.row, "choice": q.real, "note": ""} for q in pairs]}))
    assert main(["audit", str(run_dir), "--labels", str(f), "--n-boot", "200"]) == 0
    rep = read_json(run_dir / "audit" / "report.json")
    clustered = [s for s, r in rep["rates"].items() if r["clustered"]]
    assert clustered, "the fixture must have a stratum whose items hold several turns"
    for row in rep["identification"]["by_stratum"]:
        if row["stratum"] == "all":
            continue
        want = rep["rates"][row["stratum"]]["judge_only"]
        got = row["genuine_judge_only"]
        assert (got["method"], got["lo"], got["hi"]) == (want["method"], want["lo"], want["hi"]), row["stratum"]
