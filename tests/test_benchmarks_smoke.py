"""The committed benchmarks still run against the current stage functions (they call pipeline internals).

A benchmark that silently breaks is how issue 12's numbers went stale once: the stage signatures changed
and `bench_speed.py` failed every option with a TypeError. One tiny option on the real model catches that.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, requires_smollm2, skip_without_working_llamacpp


@pytest.mark.slow
@requires_smollm2
def test_bench_speed_child_generates_tokens(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_speed.py"), "--child",
                        "smollm2-135m-instruct", "hf-bf16", str(tmp_path / "run"), "--dataset", "builtin",
                        "--items", "1", "--samples", "1", "--max-assistant-tokens", "4", "--max-user-tokens", "4"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["n_items"] == 1 and res["n_user_turns"] == 2  # 1 greedy + 1 sample
    assert res["assistant_tokens"] > 0 and res["user_tokens"] > 0


@pytest.mark.slow
@requires_smollm2
def test_bench_llamacpp_rows_runs_and_counts_prefills(tmp_path):
    skip_without_working_llamacpp()
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_llamacpp_rows.py"), "--model",
                        "smollm2-135m-instruct", "--rows", "1", "3", "--items", "1", "--per-item", "3", "--new", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    assert [x["rows"] for x in res] == [1, 3]
    assert all(x["tokens"] == 6 and x["prefills"] == 1 for x in res)  # one item's prompt is prefilled once
