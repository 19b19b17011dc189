"""``experiments/linear_probe.py --target propensity`` on a tiny real run (135M model, 4 items x 8 samples).

First with the offline judge as a user would run it (exit 0, or 3 when the judge happens to give every
item the same propensity: nothing to rank); then with labels written by the test so the propensities
are known to differ between items, which must give finite numbers for every layer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from mechprobe.io import JsonlStore, read_json, read_jsonl
from mechprobe.judges.factory import make_judge
from mechprobe.records import LabelRecord
from mechprobe.turns.pipeline import ProbeConfig, run_probe
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _py(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_propensity_script_on_tiny_real_run(smol, tmp_path):
    run = tmp_path / "run"
    cfg = ProbeConfig(dataset="builtin", limit=4, temperatures=[0.0, 1.0], samples=8, max_assistant_tokens=24,
                      max_user_tokens=8, batch_size=12)
    run_probe(cfg, run, lm=smol, progress=False)
    timing = read_json(run / "manifest.json")["timing"]
    assert timing["user_rows"] == 4 * 9 and timing["user_seconds"] > 0
    figs = tmp_path / "figs"
    args = ["experiments/linear_probe.py", "--run", str(run), "--layers", "0,10,20,30", "--folds", "2",
            "--n-boot", "50", "--figures", str(figs)]
    p = _py(*args, "--target", "propensity")
    assert p.returncode in (0, 3), p.stdout + p.stderr
    assert "target: propensity (asked for with target=propensity)" in p.stdout
    assert read_json(run / "activations" / "manifest.json")["timing"]["forward_prompts"] == 4
    assert read_json(run / "labels_manifest.json")["timing"]["rows"] == 36

    # Known labels (same judge name, so they are reused): item i has 2i genuine samples of 8.
    items = sorted({r["item_id"] for r in read_jsonl(run / "assistant.jsonl")})
    (run / "labels.jsonl").unlink()
    st = JsonlStore(run / "labels.jsonl", key="record_id")
    name = make_judge("offline").name
    for r in read_jsonl(run / "user_turns.jsonl"):
        i = items.index(r["item_id"])
        g = (r["sample_index"] < 2 * i) if r["decoding"] == "sample" else bool(i % 2)
        st.append(LabelRecord(record_id=r["record_id"], label="genuine_followup" if g else "new_query", genuine=g,
                              rationale="test label", judge=name).to_dict())
    p = _py(*args)  # --target auto: 8 samples at T=1.0 -> propensity
    assert p.returncode == 0, p.stdout + p.stderr
    assert "target: propensity (the run has 8 samples per item at T = 1 (>= 8)" in p.stdout
    res = json.loads((run / "probes" / "propensity.json").read_text())
    assert res["status"] == "ok" and res["layers"] == [0, 10, 20, 30]
    assert res["targets"]["items"] == 4 and res["targets"]["k_per_item"] == {"8": 4}
    for r in res["per_layer"]:
        assert all(math.isfinite(r["rho"][k]) for k in ("value", "lo", "hi")), r
    assert math.isfinite(res["nested"]["rho"]["value"])
    assert math.isfinite(res["controls"]["split_half_ceiling"]["value"])
    assert res["cost"][0]["ratio"] is not None and res["cost"][0]["ratio"] > 0
    assert (run / "probes" / "propensity.md").read_text().count("ceiling** sqrt(R)") >= 1
    assert (figs / f"propensity_{run.name}.png").stat().st_size > 10_000


def test_datasets_pool_runs_and_transfer(smol, tmp_path, monkeypatch):
    """``--datasets gsm8k mt_bench``: one run per dataset at runs/<model>-<dataset> (built here, labels
    written by the test), pooled probes with a transfer matrix, outputs in runs/<model>-gsm8k+mt_bench."""
    from tests.conftest import shared_data_dir

    data = shared_data_dir()
    if data is None:
        pytest.skip("needs ../shared/data (gsm8k, mt_bench)")
    monkeypatch.setenv("MECHPROBE_DATA_DIR", str(data))
    name = make_judge("offline").name
    flags = dict(limit=6, temperatures=[0.0, 1.0], samples=8, max_assistant_tokens=16, max_user_tokens=6,
                 batch_size=16)
    for ds in ("gsm8k", "mt_bench"):
        run = tmp_path / "runs" / f"smollm2-135m-instruct-{ds}"
        run_probe(ProbeConfig(dataset=ds, **flags), run, lm=smol, progress=False)
        items = sorted({r["item_id"] for r in read_jsonl(run / "assistant.jsonl")})
        st = JsonlStore(run / "labels.jsonl", key="record_id")
        for r in read_jsonl(run / "user_turns.jsonl"):
            i = items.index(r["item_id"])
            g = r["decoding"] == "sample" and r["sample_index"] <= i
            st.append(LabelRecord(record_id=r["record_id"], label="genuine_followup" if g else "new_query",
                                  genuine=g, rationale="test label", judge=name).to_dict())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MECHPROBE_DATA_DIR": str(data)}
    p = subprocess.run([sys.executable, str(REPO / "experiments" / "linear_probe.py"), "--datasets", "gsm8k",
                        "mt_bench", "--layers", "0,15,30", "--folds", "2", "--n-boot", "50", "--no-shuffled"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "runs" / "smollm2-135m-instruct-gsm8k+mt_bench"
    res = json.loads((out / "probes" / "propensity.json").read_text())
    assert res["targets"]["datasets"] == {"gsm8k": 6, "mt_bench": 6}
    tm = res["transfer"]
    assert tm["train_rows"] == ["gsm8k", "mt_bench"] and len(tm["cells"]) == 2
    assert all(c["rho"] is not None and math.isfinite(c["rho"]["value"]) for row in tm["cells"] for c in row)
    assert len(res["cost"]) == 2
    assert (out / "figures" / f"propensity_{out.name}.png").exists()
