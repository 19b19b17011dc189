"""scripts/propensity_evidence.py: a propensity finding's bundle holds every answer, turn and verdict of its run,
and refuses a run with an unjudged turn (a bundle without a turn's verdict cannot recompute the finding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _run(tmp_path, judged=True):
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "assistant.jsonl", [{"item_id": i, "dataset": "gsm8k", "prompt": f"q {i}", "response": f"a {i}",
                                      "stop_reason": "end_of_turn"} for i in ("it-2", "it-1")])
    turns = [{"record_id": f"{i}|{d}|s0", "item_id": i, "decoding": d, "temperature": t, "text": f"{i} {d}",
              "stop_reason": "end_of_turn"} for i in ("it-2", "it-1") for d, t in (("greedy", 0.0), ("T1", 1.0))]
    _write(run / "user_turns.jsonl", turns)
    labels = [{"record_id": t["record_id"], "label": "genuine_followup" if t["item_id"] == "it-1" else "new_query",
               "genuine": t["item_id"] == "it-1", "judge": "j", "probs": {"genuine_followup": 0.9}}
              for t in turns[: None if judged else -1]]
    _write(run / "labels.jsonl", labels)
    beside = str(ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl")
    (run / "manifest.json").write_text(json.dumps({"data": {"dataset_source": beside}}), encoding="utf-8")
    return run


def test_bundle_has_every_item_turn_and_verdict(tmp_path):
    script = load_script("scripts/propensity_evidence.py")
    out = tmp_path / "bundle"
    assert script.main([str(_run(tmp_path)), str(out)]) == 0
    rows = [json.loads(x) for x in (out / "evidence.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["item_id"] for r in rows] == ["it-1", "it-2"]
    assert [t["decoding"] for t in rows[0]["turns"]] == ["greedy", "T1"]
    assert all(t["genuine"] for t in rows[0]["turns"]) and not any(t["genuine"] for t in rows[1]["turns"])
    assert rows[0]["turns"][0]["p_genuine"] == 0.9
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["data"]["dataset_source"] == "../shared/data/gsm8k/test.jsonl"  # no machine path committed


def test_an_unjudged_turn_is_refused(tmp_path):
    script = load_script("scripts/propensity_evidence.py")
    with pytest.raises(SystemExit, match="no verdict"):
        script.main([str(_run(tmp_path, judged=False)), str(tmp_path / "bundle")])
