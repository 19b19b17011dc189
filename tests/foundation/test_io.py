"""Files between stages: torn-line repair, no duplicates, manifest refusal, secret redaction."""

from __future__ import annotations

import json

import pytest

from mechprobe.io import JsonlStore, ManifestMismatch, check_or_write_manifest, read_jsonl, redact, write_json
from mechprobe.records import UserTurnRecord, make_record_id


def test_store_repairs_torn_line_and_refuses_duplicates(tmp_path):
    p = tmp_path / "rows.jsonl"
    s = JsonlStore(p, key="id")
    s.append({"id": "a", "v": 1})
    s.append({"id": "b", "v": 2})
    with open(p, "a") as f:
        f.write('{"id": "c", "v"')  # what kill -9 mid-write leaves
    s2 = JsonlStore(p, key="id")
    assert s2.keys() == {"a", "b"}
    assert p.read_text().endswith("\n")
    s2.append({"id": "c", "v": 3})
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="duplicate"):
        s2.append({"id": "a", "v": 9})


def test_manifest_mismatch_is_refused_with_the_differing_keys(tmp_path):
    check_or_write_manifest(tmp_path, {"model": "m1", "template_hash": "t"}, {"n": 1})
    check_or_write_manifest(tmp_path, {"model": "m1", "template_hash": "t"}, {"n": 2})  # same identity: ok
    with pytest.raises(ManifestMismatch, match="model: run has 'm1', command has 'm2'"):
        check_or_write_manifest(tmp_path, {"model": "m2", "template_hash": "t"}, {})


def test_secrets_never_written(tmp_path):
    cfg = {"judge": {"model": "x", "api_key": "sk-SECRET123"}, "OPENAI_API_KEY": "sk-SECRET123"}
    assert "sk-SECRET123" not in json.dumps(redact(cfg))
    write_json(tmp_path / "m.json", cfg)
    check_or_write_manifest(tmp_path / "run", {"api_key": "sk-SECRET123"}, {"token": "sk-SECRET123"})
    for f in tmp_path.rglob("*.json"):
        assert "sk-SECRET123" not in f.read_text()


def test_redaction_keeps_data_that_only_looks_like_a_secret_name(tmp_path):
    """A number in a ``*_per_token`` field and a row ``key`` are data; the text of ``hf_token`` is a secret."""
    row = {"error_rms_per_token": 0.046, "key": "r6a85", "n_tokens": 467, "hf_token": "hf_SECRETVALUE"}
    write_json(tmp_path / "r.json", row)
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["error_rms_per_token"] == 0.046 and got["key"] == "r6a85" and got["n_tokens"] == 467
    assert "hf_SECRETVALUE" not in json.dumps(got)


def test_user_turn_record_roundtrip():
    r = UserTurnRecord(record_id=make_record_id("gsm8k-0001", "sample", 1.0, 2), item_id="gsm8k-0001",
                       dataset="gsm8k", decoding="sample", temperature=1.0, sample_index=2, seed=5,
                       raw_text="Why?<|im_end|>", text="Why?", stop_reason="end_of_turn", prompt_ids=[1, 2, 3],
                       boundary_index=2, assistant_span=(1, 2), generated_ids=[7, 2])
    d = json.loads(json.dumps(r.to_dict()))
    assert UserTurnRecord.from_dict(d) == r
    assert r.record_id == "gsm8k-0001|T1|s2"
    assert make_record_id("x", "greedy", 0.0, 0) == "x|greedy|s0"
    with pytest.raises(ValueError, match="unknown fields"):
        UserTurnRecord.from_dict({**d, "extra": 1})
