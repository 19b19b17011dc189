"""experiments/study.py end to end on the real embedded 135M model, at tiny settings (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mechprobe.io import read_jsonl
from mechprobe.study.report import labels_file_for
from tests.conftest import REPO, requires_smollm2


@pytest.mark.slow
@requires_smollm2
def test_study_quick_on_the_real_135m_model(tmp_path):
    root, rep, fig = tmp_path / "runs", tmp_path / "rep", tmp_path / "fig"
    common = ["--quick", "--root", str(root), "--report-dir", str(rep), "--figures-dir", str(fig), "--no-progress"]
    cmd = [sys.executable, str(REPO / "experiments" / "study.py"), "--models", "smollm2-135m-instruct",
           "--datasets", "builtin", "--limit", "3", "--samples", "2", "--temperatures", "0", "1.0",
           "--max-assistant-tokens", "24", "--max-user-tokens", "8", "--variants", "no_response", "swap",
           "--judge", "offline-lexical", *common]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MECHPROBE_THREADS": "1"}
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    run = root / "smollm2-135m-instruct" / "builtin"
    assert len(read_jsonl(run / "user_turns.jsonl")) == 3 * 3
    for v in ("no_response", "swap"):
        rows = read_jsonl(run / "variants" / v / "user_turns.jsonl")
        assert len(rows) == 3 * 3 and {r["variant"] for r in rows} == {v}
        assert len(read_jsonl(run / "variants" / v / labels_file_for("offline-lexical"))) == 9
    stages = [json.loads(x)["stage"] for x in (run / "study_stages.jsonl").read_text().splitlines()]
    assert {"probe", "variants", "judge"} <= set(stages)
    rows = [json.loads(x) for x in (run / "study_stages.jsonl").read_text().splitlines()]
    assert all(r["cpu_seconds"] > 0 for r in rows)  # CPU time beside wall time (wall counts pauses and sharing)
    readme = (rep / "README.md").read_text()
    assert "offline-v" in readme and "| smollm2-135m-instruct | swap |" in readme
    # resume: a second identical command does no work and records no new stage rows
    n_stage_rows = len(stages)
    assert subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200).returncode == 0
    assert len((run / "study_stages.jsonl").read_text().splitlines()) == n_stage_rows
    # --report-only twice: the same README byte for byte
    ro = [sys.executable, str(REPO / "experiments" / "study.py"), "--report-only", "--judge", "offline-lexical", *common]
    subprocess.run(ro, env=env, cwd=REPO, check=True, capture_output=True)
    first = (rep / "README.md").read_text()
    subprocess.run(ro, env=env, cwd=REPO, check=True, capture_output=True)
    assert (rep / "README.md").read_text() == first == readme
