"""The committed benchmarks still run against the current stage functions (they call pipeline internals).

A benchmark that silently breaks is how issue 12's numbers went stale once: the stage signatures changed
and `bench_speed.py` failed every option with a TypeError. One tiny option on the real model catches that.
"""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
@requires_smollm2
def test_bench_judge_runs_both_paths_on_a_real_run(tmp_path):
    """bench_judge.py on a two-item run judged by the hybrid judge on the 135M model: both paths run and agree closely."""
    from mechprobe.io import JsonlStore
    from mechprobe.records import UserTurnRecord, make_record_id
    from tests.study_helpers import assistant

    run = tmp_path / "run"
    sa, su = JsonlStore(run / "assistant.jsonl", key="item_id"), JsonlStore(run / "user_turns.jsonl", key="record_id")
    turns = ["Why did you add 3 and 4 to get 7?", "Can you check the 7 again?", "What if Tom buys 5 more apples?"]
    for item in ("a", "b"):
        sa.append(assistant(item, prompt="Tom has 3 apples and buys 4 more. How many apples?",
                            response="Tom has 3 + 4 = 7 apples.").to_dict())
        for k, t in enumerate(turns):
            su.append(UserTurnRecord(record_id=make_record_id(item, "sample", 1.0, k, "full"), item_id=item,
                                     dataset="gsm8k", decoding="sample", temperature=1.0, sample_index=k, seed=k,
                                     raw_text=t + "<|im_end|>", text=t, stop_reason="end_of_turn", prompt_ids=[1, 2],
                                     boundary_index=1, assistant_span=(0, 1), variant="full").to_dict())
    out = tmp_path / "judge.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_judge.py"), str(run), "--model",
                        "smollm2-135m-instruct", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["conversations"] >= 1 and res["turns"] >= 2
    assert res["batched_s"] > 0 and res["one_at_a_time_s"] > 0
    # the judge runs in bf16 on CPUs with native bf16 (fp32 elsewhere): there batch shape moves log-probabilities by
    # bf16 rounding steps (measured max 0.032 on the 1.5B model, 0.037 here); fp32 equality is tested in
    # test_judge_hybrid.py
    assert res["max_abs_pmi_diff"] < 0.1 and 0 <= res["labels_differing"] <= res["turns"]


@pytest.mark.slow
@requires_smollm2
def test_decode_limit_reports_a_fraction_of_its_limit(tmp_path):
    out = tmp_path / "limit.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_limit.py"), "--model", "smollm2-135m-instruct",
                        "--batch-sizes", "1", "2", "--new-tokens", "2", "--dtype", "float32", "--peak-rows", "8",
                        "--bandwidth-gib", "0.05", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["bandwidth_gb_s"] > 0 and res["matmul_gflop_s"] > 0 and res["cpu"]
    assert [x["batch"] for x in res["rows"]] == [1, 2]
    for x in res["rows"]:
        assert x["tok_s"] > 0 and x["limit_tok_s"] > 0 and x["fraction"] == pytest.approx(x["tok_s"] / x["limit_tok_s"],
                                                                                        rel=0.01)


def test_stage_floor_counts_the_forwards_each_stage_needs(tmp_path):
    """Two items of 100-token probe prompts: the judge runs a prefix once per item with a scored turn, two passes
    per scored turn and one more per voiced turn; the cache one prompt per item; floors at the given peaks."""
    run = tmp_path / "run"
    (run / "activations").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"timing": {"assistant_seconds": 10.0, "user_seconds": 20.0}}))
    (run / "labels_manifest.json").write_text(json.dumps({"timing": {"seconds": 30.0}}))
    (run / "activations" / "manifest.json").write_text(json.dumps({"timing": {"forward_seconds": 5.0}}))
    (run / "assistant.jsonl").write_text("".join(json.dumps({"item_id": i, "n_tokens": 60}) + "\n" for i in "ab"))
    turns = [{"record_id": f"{i}{k}", "item_id": i, "prompt_ids": [1] * 100, "generated_ids": [2] * 10}
             for i in "ab" for k in range(3)]
    (run / "user_turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    probs = {"a0": {"genuine_followup": 0.9, "pmi": 0.5, "voice": 0.3}, "a1": {"genuine_followup": 0.1, "pmi": -0.2}}
    (run / "labels.jsonl").write_text("".join(json.dumps({"record_id": t["record_id"], "label": "x",
                                                          "probs": probs.get(t["record_id"], {})}) + "\n"
                                              for t in turns))
    gen, hf = tmp_path / "gen.json", tmp_path / "hf.json"
    gen.write_text(json.dumps({"prefill_tok_s_512": 10.0}))
    hf.write_text(json.dumps({"matmul_gflop_s": 2.0, "params": 100_000_000, "cpu": "test CPU"}))  # 10 tok/s
    out = tmp_path / "floor.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stage_floor.py"), str(run), "--items", "20",
                        "--limit", str(gen), "--hf-limit", str(hf), "--out", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    st = {x["stage"]: x for x in res["stages"]}
    assert st["answers"]["token_forwards"] == 200  # (100 - 60) prompt + 60 answer tokens, per item
    assert st["user turns"]["token_forwards"] == 200 + 60
    assert st["judge"]["token_forwards"] == 100 + 2 * 10 * 2 + 10  # item a only: prefix, 2 scored, 1 voiced
    assert st["boundary cache"]["token_forwards"] == 200
    assert st["judge"]["floor_seconds"] == pytest.approx(15.0) and st["judge"]["projected_minutes"] == pytest.approx(5.0)
    assert res["scored_turns"] == 2 and res["voiced_turns"] == 1 and res["cpu"] == "test CPU"


@pytest.mark.slow
@requires_smollm2
def test_bench_cache_from_judge_reads_the_judges_conversations(tmp_path, smol):
    """A real 135M run (3 builtin items, greedy + 1 sample): the benchmark's judged copy caches from the judge's pool
    (hits, fewer tokens run) and its vectors match the copy cached from nothing."""
    from mechprobe.turns.pipeline import ProbeConfig, run_probe

    cfg = ProbeConfig(model="smollm2-135m-instruct", dataset="builtin", limit=3, samples=1, temperatures=[0.0, 1.0],
                      max_assistant_tokens=24, max_user_tokens=12, batch_size=8)
    run = run_probe(cfg, tmp_path / "run", lm=smol, progress=False)
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_cache_from_judge.py"), str(run),
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO,
                       env={**os.environ, "MECHPROBE_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["prefix_hits"] >= 1 and res["forward_tokens_from_judge"] < res["forward_tokens_from_nothing"]
    assert res["max_rel_l2_diff"] < 1e-2


@pytest.mark.slow
@requires_smollm2
def test_bench_reader_times_each_reader_on_the_same_turns(tmp_path):
    out = tmp_path / "reader.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_reader.py"), "--source", "judge_fresh_test_v5",
                        "--turns", "3", "--repeats", "1", "--readers", "smollm2-135m-instruct:6",
                        "smollm2-135m-instruct:3:answer-contrast", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["layer"], x["shape"]) for x in rows] == [(6, "one_per_answer"), (6, "whole_answers"),
                                                       (3, "one_per_answer"), (3, "whole_answers")]
    one = [x for x in rows if x["shape"] == "one_per_answer"]
    assert all(x["answers"] == x["turns"] == 3 for x in one) and one[0]["ratio_to_baseline"] == 1.0
    assert all(x["seconds"] > 0 for x in rows)
    assert [x["features"] for x in rows] == ["turn", "turn", "answer-contrast", "answer-contrast"]
