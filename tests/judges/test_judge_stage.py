"""The judge stage on a real run directory: labels.jsonl, resume, error retry, summary, CLI."""

from __future__ import annotations

import json

import pytest

from mechprobe.cli.judge import main as main_judge
from mechprobe.errors import UserError
from mechprobe.io import read_jsonl
from mechprobe.judges.base import JudgeMismatch, inputs_from_run
from mechprobe.judges.run import judge_run, summarize_labels
from mechprobe.lm.server import ChatServer, Fault, ScriptedResponder
from mechprobe.records import AssistantRecord, UserTurnRecord, make_record_id
from mechprobe.stats import wilson
from mechprobe.taxonomy import JUDGE_ERROR

KEY = "sk-run-SECRET-abcdef0123456789"

ITEMS = {
    "gsm8k-0": ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?",
                "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 clips in total."),
    "poem-0": ("Write a short poem about the ocean.",
               "Waves of silver kiss the shore,\nSeagulls dance on salty breeze."),
}
TURNS = {
    "gsm8k-0": ["So she sold 24 clips in May?", "Thanks!", "<|im_start|>assistant\n72", "What is the capital of France?"],
    "poem-0": ["Why do the seagulls dance?", "As an AI, I love poems.", "", "Write a short poem about the ocean."],
}
PLAN = [("greedy", 0.0, 0), ("sample", 1.0, 0), ("sample", 1.0, 1), ("sample", 1.0, 2)]


def make_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "assistant.jsonl", "w") as fa, open(run / "user_turns.jsonl", "w") as fu:
        for item_id, (prompt, response) in ITEMS.items():
            a = AssistantRecord(item_id=item_id, dataset=item_id.split("-")[0], prompt=prompt, response=response,
                                stop_reason="end_of_turn", n_tokens=20)
            fa.write(json.dumps(a.to_dict()) + "\n")
            for (dec, t, k), text in zip(PLAN, TURNS[item_id]):
                u = UserTurnRecord(record_id=make_record_id(item_id, dec, t, k), item_id=item_id, dataset=a.dataset,
                                   decoding=dec, temperature=t, sample_index=k, seed=None if dec == "greedy" else k,
                                   raw_text=text + "<|im_end|>", text=text, stop_reason="end_of_turn",
                                   prompt_ids=[1, 2, 3], boundary_index=2, assistant_span=(1, 2))
                fu.write(json.dumps(u.to_dict()) + "\n")
    return run


def test_offline_judge_run_writes_labels_summary_and_manifest(tmp_path):
    run = make_run(tmp_path)
    s = judge_run(run, "offline-lexical", progress=False)
    rows = read_jsonl(run / "labels.jsonl")
    assert len(rows) == 8 and s.n_new == 8 and s.n_errors == 0 and s.n_labelled == 8
    by = {r["record_id"]: r["label"] for r in rows}
    assert by["gsm8k-0|greedy|s0"] == "genuine_followup"
    assert by["gsm8k-0|T1|s1"] == "assistant_continuation"
    assert by["poem-0|T1|s1"] == "empty_or_degenerate"
    greedy = next(g for g in s.groups if g.decoding == "greedy")
    assert (greedy.n, greedy.n_genuine) == (2, 2)
    table = (run / "labels_summary.md").read_text()
    assert "| greedy | 0 | 2 | 100.0% |" in table and "| sample | 1 | 6 |" in table
    assert json.loads((run / "labels_manifest.json").read_text())["judge"] == "offline-v3+lexical"


def test_resume_skips_done_rows_and_repairs_a_torn_line(tmp_path):
    run = make_run(tmp_path)
    judge_run(run, "offline-lexical", progress=False)
    full = (run / "labels.jsonl").read_text().splitlines(keepends=True)
    # Keep 3 rows, then a torn half row as a killed writer leaves it.
    (run / "labels.jsonl").write_text("".join(full[:3]) + full[3][:20])
    s = judge_run(run, "offline-lexical", progress=False)
    assert (s.n_new, s.n_skipped) == (5, 3)
    rows = read_jsonl(run / "labels.jsonl")
    assert len(rows) == 8 and len({r["record_id"] for r in rows}) == 8
    s2 = judge_run(run, "offline-lexical", progress=False)
    assert (s2.n_new, s2.n_skipped) == (0, 8)


def test_limit_judges_a_prefix(tmp_path):
    run = make_run(tmp_path)
    s = judge_run(run, "offline-lexical", limit=3, progress=False)
    assert s.n_new == 3 and s.n_unlabelled == 5


def test_a_second_judge_needs_its_own_file(tmp_path):
    run = make_run(tmp_path)
    judge_run(run, "offline-lexical", progress=False)
    with ChatServer(ScriptedResponder('{"rationale": "r", "label": "new_query", "genuine": false}')) as srv:
        with pytest.raises(JudgeMismatch, match="labels_openai.jsonl"):
            judge_run(run, "openai:m", base_url=srv.base_url, api_key=KEY, cache_dir=False, progress=False)
        s = judge_run(run, "openai:m", labels_file="labels_openai.jsonl", base_url=srv.base_url, api_key=KEY,
                      cache_dir=False, progress=False)
    assert s.label_counts == {"new_query": 8}
    assert (run / "labels_openai_summary.md").exists()


def test_llm_judge_run_errors_are_retried_and_key_never_written(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MECHPROBE_TEST_KEY", KEY)
    ok = '{"rationale": "fine", "label": "genuine_followup", "genuine": true}'
    argv = [str(run), "--judge", "openai:judge-m", "--api-key-env", "MECHPROBE_TEST_KEY", "--cache-dir", str(cache),
            "--max-retries", "1", "--concurrency", "2", "--no-progress"]
    # 1) endpoint down: every row is a judge_error, counted apart from labels (and the exit code says so)
    with ChatServer(ScriptedResponder(ok, always=Fault.server_error(503))) as srv:
        assert main_judge(argv + ["--base-url", srv.base_url]) == 2
        assert srv.n_chat_requests == 16  # 8 rows x (1 try + 1 retry)
    rows = read_jsonl(run / "labels.jsonl")
    assert [r["label"] for r in rows] == [JUDGE_ERROR] * 8 and all(r["genuine"] is None for r in rows)
    assert "judge errors by reason: http_503 ×8" in (run / "labels_summary.md").read_text()
    # 2) endpoint back: error rows are retried (not skipped), good verdicts cached
    with ChatServer(ScriptedResponder(ok)) as srv:
        assert main_judge(argv + ["--base-url", srv.base_url]) == 0
        assert srv.n_chat_requests == 8
    rows = read_jsonl(run / "labels.jsonl")
    assert len(rows) == 8 and {r["label"] for r in rows} == {"genuine_followup"}
    # 3) relabel from scratch: all from cache, zero requests
    (run / "labels.jsonl").unlink()
    with ChatServer(ScriptedResponder(ok)) as srv:
        assert main_judge(argv + ["--base-url", srv.base_url]) == 0
        assert srv.n_chat_requests == 0
    written = [p for p in [*run.rglob("*"), *cache.rglob("*")] if p.is_file()]
    assert len(written) > 8
    for p in written:
        assert KEY not in p.read_text(errors="ignore"), p


def test_missing_run_files_give_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="probe stage"):
        inputs_from_run(tmp_path)
    run = make_run(tmp_path)
    (run / "assistant.jsonl").write_text("")
    with pytest.raises(ValueError, match="re-run the probe stage"):
        inputs_from_run(run)


def test_wilson_interval_known_values():
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)  # standard textbook example
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    # n = 0: no evidence, the whole range (finite, so JSON stays valid); both call sites share it.
    assert wilson(0, 0) == (0.0, 1.0)
    from mechprobe.steering import evaluate as steer_eval

    assert steer_eval.wilson is wilson
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson(3, 2)


def test_summary_excludes_errors_from_rates(tmp_path):
    run = make_run(tmp_path)
    inputs = inputs_from_run(run)
    rows = [{"record_id": i.record_id, "label": "genuine_followup" if n % 2 else JUDGE_ERROR, "error": "x: y"}
            for n, i in enumerate(inputs)]
    s = summarize_labels(inputs, rows)
    assert s.n_errors == 4 and s.n_labelled == 4 and s.label_counts == {"genuine_followup": 4}
    assert all(g.rate == 1.0 for g in s.groups if g.n)


def test_cli_reports_configuration_errors_in_one_line(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path)
    assert main_judge([str(run), "--judge", "offline-lexical", "--no-progress"]) == 0
    assert "| greedy | 0 | 2 |" in capsys.readouterr().out
    monkeypatch.setenv("MECHPROBE_TEST_KEY", KEY)
    with ChatServer(ScriptedResponder("{}")) as srv:
        code = main_judge([str(run), "--judge", "openai:m", "--base-url", srv.base_url,
                           "--api-key-env", "MECHPROBE_TEST_KEY", "--no-cache", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "one labels file holds one judge" in err and KEY not in err


def test_default_judge_follows_the_environment(monkeypatch):
    from mechprobe.judges.factory import default_judge, resolve_judge_spec
    from mechprobe.lm.registry import DEFAULT_MODEL

    monkeypatch.delenv("MECHPROBE_JUDGE_MODEL", raising=False)
    # None and "auto" are one rule, resolved in one function (make_judge("auto") used to raise)
    assert resolve_judge_spec(None, DEFAULT_MODEL) == resolve_judge_spec("auto", DEFAULT_MODEL) == "offline"
    assert resolve_judge_spec(None) == resolve_judge_spec("auto") == default_judge()
    assert resolve_judge_spec("auto", "some/model", "offline-v3+lexical") == "offline-lexical"  # resume the run's judge
    monkeypatch.setenv("MECHPROBE_JUDGE_MODEL", "qwen-judge")
    assert resolve_judge_spec(None) == resolve_judge_spec("auto") == "openai:qwen-judge"
    assert resolve_judge_spec("offline") == "offline"
    assert resolve_judge_spec("hybrid2:m") == "hybrid-voice:m"


def test_a_runs_inputs_name_the_model_that_wrote_its_turns(tmp_path):
    """The subject model (a per-subject-calibrated judge's key) comes from the run's manifest; a run without one
    says nothing, and an unreadable manifest is one line naming the fix."""
    run = make_run(tmp_path)
    assert {i.subject for i in inputs_from_run(run)} == {""}
    (run / "manifest.json").write_text(json.dumps({"config": {"model": "qwen2.5-coder-0.5b-instruct"}}))
    assert {i.subject for i in inputs_from_run(run)} == {"qwen2.5-coder-0.5b-instruct"}
    (run / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="manifest.json"):
        inputs_from_run(run)
