"""New runs of a model other than the embedded default get the finding settings; existing runs keep theirs."""

from __future__ import annotations

import json

import pytest

from mechprobe import stages
from mechprobe.lm.registry import DEFAULT_MODEL


@pytest.mark.parametrize("total,sizes,want", [
    (200, [1319, 80], [120, 80]),      # MT-Bench gives its 80, GSM8K takes the rest
    (200, [1319], [200]),
    (200, [50, 60, 1000], [50, 60, 90]),
    (7, [3, 3, 3], [2, 2, 3]),         # remainder to the largest, never above a size
    (10, [2, 3], [2, 3]),              # fewer rows than asked: every row, nothing invented
])
def test_share_items(total, sizes, want):
    got = stages.share_items(total, sizes)
    assert got == want
    assert all(g <= s for g, s in zip(got, sizes, strict=True))


def test_finding_preset_only_for_other_models():
    assert stages.finding_preset(None) is None
    assert stages.finding_preset(DEFAULT_MODEL) is None
    p = stages.finding_preset("qwen2.5-coder-1.5b-instruct")
    assert p["limit"] == 200 and p["samples"] >= 8 and 0.0 in p["temperatures"] and 1.0 in p["temperatures"]
    assert p["engine"] in ("hf", "llamacpp")


def test_preset_applies_to_new_runs_and_options_override(tmp_path):
    pre = stages.finding_preset("qwen2.5-coder-1.5b-instruct")
    _, cfg = stages.resolve_run(tmp_path / "new", "qwen2.5-coder-1.5b-instruct", "builtin", preset=pre)
    assert (cfg.limit, cfg.samples, cfg.max_user_tokens) == (200, pre["samples"], 40)
    _, cfg = stages.resolve_run(tmp_path / "new", "qwen2.5-coder-1.5b-instruct", "builtin", preset=pre, limit=30)
    assert cfg.limit == 30
    _, cfg = stages.resolve_run(tmp_path / "main", None, "builtin")
    assert cfg.limit == stages.MAIN_JOB["limit"] and cfg.samples == stages.MAIN_JOB["samples"]


def test_existing_run_keeps_its_config(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    cfg0 = stages.probe_config("qwen2.5-coder-1.5b-instruct", "builtin", limit=12, samples=2, engine="hf")
    from dataclasses import asdict
    (run / "manifest.json").write_text(json.dumps({"config": asdict(cfg0), "identity": {"config": cfg0.identity()}}))
    pre = stages.finding_preset("qwen2.5-coder-1.5b-instruct")
    _, cfg = stages.resolve_run(run, "qwen2.5-coder-1.5b-instruct", "builtin", preset=pre)
    assert (cfg.limit, cfg.samples, cfg.engine) == (12, 2, "hf")


def test_auto_judge(tmp_path, monkeypatch):
    monkeypatch.delenv("MECHPROBE_JUDGE_MODEL", raising=False)
    assert stages.auto_judge(tmp_path, DEFAULT_MODEL) == "offline"
    assert stages.auto_judge(tmp_path, str(tmp_path)) == "offline"          # a local checkpoint
    monkeypatch.setattr("mechprobe.judges.factory.best_judge", lambda: "hybrid-voice:qwen2.5-coder-1.5b-instruct")
    assert stages.auto_judge(tmp_path, "qwen2.5-coder-1.5b-instruct") == "hybrid-voice:qwen2.5-coder-1.5b-instruct"
    # the run's own labels decide, so a re-run never meets a judge mismatch
    for name, want in [("offline-v3+minilm", "offline"), ("offline-v3+lexical", "offline-lexical"),
                       ("hybrid:qwen2.5-coder-1.5b-instruct@hybrid-v2+voice0.1+offline-v3+minilm",
                        "hybrid-voice:qwen2.5-coder-1.5b-instruct"),
                       ("hybrid:qwen2.5-coder-1.5b-instruct@hybrid-v1+offline-v3+minilm",
                        "hybrid:qwen2.5-coder-1.5b-instruct")]:
        (tmp_path / "labels.jsonl").write_text(json.dumps({"record_id": "a", "judge": name}) + "\n")
        assert stages.auto_judge(tmp_path, "qwen2.5-coder-1.5b-instruct") == want
    monkeypatch.setenv("MECHPROBE_JUDGE_MODEL", "gpt-x")
    assert stages.auto_judge(tmp_path, DEFAULT_MODEL) == "openai:gpt-x"
