"""Truncated answers are counted and left out of headline rates; audit-corrected columns where labels exist.

A tiny run directory (three items, one answer truncated) for the truncation rules of every summary, and the
audit fixture run (tests/audit/run_fixture.py) with planted audit labels for the corrected columns.
"""

from __future__ import annotations

import json
from pathlib import Path

from mechprobe.audit import LabellerLabels, RowLabel, load_or_draw, load_run_table
from mechprobe.io import read_jsonl, write_json
from mechprobe.judges.base import inputs_from_run
from mechprobe.judges.run import summarize_labels
from mechprobe.post_train import evaluate as pt_eval
from mechprobe.records import AssistantRecord, LabelRecord, UserTurnRecord, truncated_item_ids
from mechprobe.steering.evaluate import SteeredTurn, genuine_by_item, summarize
from mechprobe.steering.report import results_md
from mechprobe.steering.statistics import audited_columns
from mechprobe.taxonomy import GENUINE
from mechprobe.turns.pipeline import summarize_run
from tests.audit.run_fixture import build_run


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def tiny_run(root: Path) -> Path:
    """i0 and i1 answered to the end, i2 hit the cap; every item's two user turns are genuine follow-ups."""
    root.mkdir(parents=True, exist_ok=True)
    _jsonl(root / "assistant.jsonl", [AssistantRecord(
        item_id=f"i{k}", dataset="gsm8k", prompt=f"q{k}", response=f"a{k}", n_tokens=10 if k < 2 else 64,
        stop_reason="end_of_turn" if k < 2 else "max_tokens", score=1.0).to_dict() for k in range(3)])
    turns, labels = [], []
    for k in range(3):
        for dec, temp in (("greedy", 0.0), ("sample", 1.0)):
            rid = f"i{k}|{dec}"
            turns.append(UserTurnRecord(record_id=rid, item_id=f"i{k}", dataset="gsm8k", decoding=dec,
                                        temperature=temp, sample_index=0, seed=None, raw_text="why?", text="why?",
                                        stop_reason="end_of_turn", prompt_ids=[1, 2], boundary_index=1,
                                        assistant_span=(0, 1)).to_dict())
            labels.append(LabelRecord(record_id=rid, label=GENUINE if k != 0 else "empty_or_degenerate",
                                      genuine=k != 0, rationale="", judge="offline-test").to_dict())
    _jsonl(root / "user_turns.jsonl", turns)
    _jsonl(root / "labels.jsonl", labels)
    return root


def test_probe_run_summary_counts_truncated_answers_and_excludes_their_turns(tmp_path):
    run = tiny_run(tmp_path / "run")
    out = summarize_run(run)
    assert "1 of 3 answers truncated, excluded" in out
    assert "| greedy | 0 | 2 | 50.0% [" in out  # i0 (not genuine) and i1 (genuine); i2 left out
    assert "judge only" in out and "corrected (n audited)" not in out
    kept = summarize_run(run, include_truncated=True)
    assert "1 of 3 answers truncated, included" in kept
    assert "| greedy | 0 | 3 | 66.7% [" in kept


def test_judge_summary_excludes_turns_after_truncated_answers(tmp_path):
    run = tiny_run(tmp_path / "run")
    inputs = inputs_from_run(run)
    rows = read_jsonl(run / "labels.jsonl")
    cut = truncated_item_ids(read_jsonl(run / "assistant.jsonl"))
    s = summarize_labels(inputs, rows, truncated=cut, n_answers=3)
    assert {g.decoding: g.n for g in s.groups} == {"greedy": 2, "sample": 2}
    assert s.n_truncated == 1 and s.n_truncated_turns == 2
    assert "1 of 3 answers truncated, excluded (2 user turns after them left out of the rates)" in s.table()
    s_in = summarize_labels(inputs, rows, truncated=cut, n_answers=3, include_truncated=True)
    assert {g.decoding: g.n_genuine for g in s_in.groups} == {"greedy": 2, "sample": 2}
    assert "1 of 3 answers truncated, included" in s_in.table()


def test_steering_summary_and_paired_items_leave_truncated_items_out():
    turns = [SteeredTurn(f"i{k}", "none", 0.0, -1, "boundary", "why?", "why?", "end_of_turn", 1.0) for k in range(3)]
    labels = {f"k|i{k}": GENUINE for k in range(3)}
    s = summarize(turns, labels, "k", {"i2"})
    assert (s["n"], s["genuine"], s["n_truncated_excluded"]) == (2, 2, 1)
    assert summarize(turns, labels, "k")["n"] == 3
    assert set(genuine_by_item(turns, labels, "k", {"i2"})) == {"i0", "i1"}


def test_post_train_rates_and_pairs_leave_truncated_items_out(tmp_path):
    run = tiny_run(tmp_path / "run")
    assert pt_eval.followup_rates(run)["greedy"].n == 2
    assert pt_eval.followup_rates(run, include_truncated=True)["greedy"].n == 3
    assert {p.decoding: p.n for p in pt_eval.paired_arm_test(run, run)} == {"greedy": 2, "sample": 2}
    summ = pt_eval.arm_summary({"gsm8k": run})
    assert summ["gsm8k"]["truncated"] == {"k": 1, "n": 3, "excluded": True}
    md = pt_eval.report_markdown({"judge": "offline-test", "arms": {"base": summ}, "paired": {}}, {}, {}, [])
    assert "1 of 3 answers truncated, excluded" in md


def _audited_run(root: Path) -> Path:
    """The audit fixture run with its answers un-truncated, a drawn sample and labeller E's labels planted."""
    truth = build_run(root)
    rows = read_jsonl(root / "assistant.jsonl")
    _jsonl(root / "assistant.jsonl", [{**r, "stop_reason": "end_of_turn"} for r in rows])
    sample, _ = load_or_draw(root, load_run_table(root), n=60, by="condition", seed=0)
    lab = LabellerLabels("E", "person", sample.sample_id, tuple(
        RowLabel(sample.row_key(rid), truth["E"].get(rid) or truth["C"][rid]) for rid in sample.record_ids
        if rid in truth["E"] or rid in truth["C"]))
    write_json(root / "audit" / "labels" / "E.json", lab.to_dict())
    return root


def test_corrected_columns_appear_where_audit_labels_exist(tmp_path):
    run = _audited_run(tmp_path / "run")
    out = summarize_run(run)
    assert "corrected (n audited)" in out and "corrected by the audit" in out
    assert "(n=" in out.split("| decoding |")[-1]

    from mechprobe.audit.rates import audit_truth

    audit = audit_truth(run)
    assert audit is not None and len(audit) > 0

    def g_of(path: Path) -> dict[str, bool]:
        return {r["item_id"]: r["label"] == GENUINE for r in read_jsonl(path)}

    base_p = run / "steering" / "alpha_0_none.jsonl"
    dm_p = run / "steering" / "L14_boundary+generated_resid" / "alpha_0.8_diff_means.jsonl"
    cols = audited_columns(run, audit, dm_p, g_of(dm_p), base_p, g_of(base_p), seed=0)
    assert cols["followup_corrected"]["n_audited"] > 0
    assert cols["diff_vs_alpha0_corrected"]["n_audited"] > 0
    assert cols["diff_vs_alpha0_judge_only"]["n_total"] == len(g_of(base_p))
    base_cols = audited_columns(run, audit, base_p, g_of(base_p), base_p, g_of(base_p), seed=0)
    assert base_cols["diff_vs_alpha0_judge_only"] is None
    row = {"kind": "diff_means", "alpha": 0.8, "delta_norm": 1.0, "delta_over_resid": 0.8, "followup_rate": 0.5,
           "ci": [0.1, 0.9], "mcnemar": {"b": 1, "c": 0, "p": 1.0}, "degenerate_rate": 0.0,
           "degenerate_ci": [0.0, 0.1], "nll_unsteered_text": None, "mean_nll": None, "task_accuracy": None,
           "labels": {GENUINE: 1}, **cols}
    md = results_md([row], "header", "resid", audited=True)
    head = md.splitlines()[2]
    assert "genuine follow-up, judge only [95% CI]" in head and "genuine follow-up, corrected (n audited)" in head
    assert "difference vs alpha 0 (same items), corrected (n audited)" in head
    assert "(n=" in md.splitlines()[-1]
    plain = results_md([{**row, **audited_columns(run, None, dm_p, g_of(dm_p), base_p, g_of(base_p), 0)}],
                       "header", "resid")
    assert "judge only" in plain.splitlines()[2] and "corrected" not in plain.splitlines()[2]


def test_post_train_report_carries_corrected_rates_where_an_eval_run_is_audited(tmp_path):
    run = _audited_run(tmp_path / "run")
    # The fixture's stand-in judge wrote labels without the genuine flag a judge run writes: set it from the label.
    _jsonl(run / "labels.jsonl", [{**r, "genuine": r["label"] == GENUINE} for r in read_jsonl(run / "labels.jsonl")])
    plain = tiny_run(tmp_path / "plain")
    summ = pt_eval.arm_summary({"gsm8k": run})
    c = summ["gsm8k"]["corrected"]
    assert c is not None and c["labellers"] == ["E"] and c["n_audited"] > 0
    assert any(c[d] and c[d]["n_audited"] > 0 for d in ("greedy", "sample"))
    assert pt_eval.arm_summary({"gsm8k": plain})["gsm8k"]["corrected"] is None  # no audit: judge only
    d = pt_eval.corrected_difference(run, run, "greedy")
    assert d is not None and d["corrected"] is not None and abs(d["corrected"]["point"]) < 1e-12
    assert pt_eval.corrected_difference(run, plain, "greedy") is None
    md = pt_eval.report_markdown({"judge": "offline-test", "arms": {"base": summ}, "paired": {},
                                  "corrected_paired": {"base vs post": {"gsm8k": {"greedy": d}}}}, {}, {}, [])
    assert "corrected by the audit" in md and "| base | gsm8k |" in md and "(n=" in md
    md_plain = pt_eval.report_markdown({"judge": "offline-test", "arms": {"base": pt_eval.arm_summary(
        {"gsm8k": plain})}, "paired": {}}, {}, {}, [])
    assert "every rate above is judge only" in md_plain


def test_dpo_eval_only_refreshes_the_judge_error_on_pairs_from_a_later_audit(tmp_path):
    """The pairs run is audited after training; ``refresh_pair_error`` (what ``--method dpo --eval-only`` calls)
    fills the audited error into the summary and the manifest, and leaves them alone without an audit."""
    from mechprobe.audit.rates import audit_truth
    from mechprobe.post_train.dpo import refresh_pair_error
    from mechprobe.post_train.pairs import PAIRS_MANIFEST, Pair, PairSet, write_pairs

    d = tmp_path / "dpo"
    run = _audited_run(d / "pairs-gsm8k")
    truth = audit_truth(run).truth
    ids = [r for r in truth if "#" not in r]
    yes = [r for r in ids if truth[r] >= 0.5]
    no = [r for r in ids if truth[r] < 0.5]
    assert yes and len(no) >= 2
    pairs = [Pair("i", yes[0], no[0], "new_query", "", "", [1], [2], [3]),   # right order
             Pair("i", no[1], no[0], "new_query", "", "", [1], [2], [3])]    # chosen is not genuine
    write_pairs(d, PairSet(pairs, {"pairs_used": 2}), {"judge": "x"})
    write_json(d / "train_summary.json", {"model": "m"})
    info: dict = {"model": "m"}
    refresh_pair_error(d, info)
    err = info["judge_error_on_pairs"]
    assert err["audited"] and err["pairs_wrong_order"]["k"] == 1 and err["pairs_wrong_order"]["n"] == 2
    assert json.loads((d / PAIRS_MANIFEST).read_text())["judge_error_on_pairs"] == err
    assert json.loads((d / "train_summary.json").read_text())["judge_error_on_pairs"] == err
    bare: dict = {}
    refresh_pair_error(tmp_path / "nothing", bare)
    assert bare == {}
