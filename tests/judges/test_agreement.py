"""Agreement metrics against worked examples and sklearn, sources and the report command."""

from __future__ import annotations

import json
import math
import random

import pytest

from mechprobe.cli import main as cli_main
from mechprobe.judges.agreement import (
    LabelSource,
    cohen_kappa,
    compare,
    confusion_matrix,
    load_labels,
    per_label_scores,
    report_markdown,
)
from mechprobe.taxonomy import LABELS


def main(argv: list[str]) -> int:
    return cli_main(["agreement", *argv])


def test_kappa_worked_example():
    # 50 items; both "yes" 20, A yes/B no 5, A no/B yes 10, both "no" 15.
    # p_o = 35/50 = 0.7; p_e = 0.5*0.6 + 0.5*0.4 = 0.5; kappa = (0.7 - 0.5) / 0.5 = 0.4
    a = ["yes"] * 25 + ["no"] * 25
    b = ["yes"] * 20 + ["no"] * 5 + ["yes"] * 10 + ["no"] * 15
    assert cohen_kappa(a, b) == pytest.approx(0.4)


def test_kappa_matches_sklearn_on_random_multiclass():
    from sklearn.metrics import cohen_kappa_score

    rng = random.Random(0)
    for _ in range(20):
        a = [rng.choice(LABELS[:5]) for _ in range(60)]
        b = [x if rng.random() < 0.6 else rng.choice(LABELS[:5]) for x in a]
        assert cohen_kappa(a, b, LABELS) == pytest.approx(cohen_kappa_score(a, b))


def test_kappa_edge_cases():
    assert cohen_kappa(["a"] * 5, ["b"] * 5, ["a", "b"]) == pytest.approx(0.0)
    assert math.isnan(cohen_kappa(["a"] * 5, ["a"] * 5))  # chance agreement is 1: undefined
    assert cohen_kappa(["a", "b"], ["a", "b"]) == 1.0
    with pytest.raises(ValueError, match="paired"):
        cohen_kappa(["a"], [])


def test_per_label_precision_recall_and_confusion():
    a = ["x", "x", "x", "y", "y", "z"]
    b = ["x", "x", "y", "y", "x", "x"]
    scores = {s.label: s for s in per_label_scores(a, b, ["x", "y", "z"])}
    assert (scores["x"].precision, scores["x"].recall) == (pytest.approx(2 / 4), pytest.approx(2 / 3))
    assert (scores["y"].precision, scores["y"].recall) == (0.5, 0.5)
    assert math.isnan(scores["z"].precision) and scores["z"].recall == 0.0
    assert confusion_matrix(a, b, ["x", "y", "z"]) == [[2, 1, 0], [1, 1, 0], [1, 0, 0]]


def fixture_rows():
    P = "Natalia sold 48 clips in April and half as many in May. How many in total?"
    R = "In May she sold 24 clips, so 48 + 24 = 72 clips in total."
    turns = [("So she sold 24 in May?", "genuine_followup", "dev"), ("Thanks!", "generic_followup", "dev"),
             ("What is the capital of France?", "new_query", "test"), ("<|im_end|>", "empty_or_degenerate", "test"),
             ("Why did you add 24?", "genuine_followup", "test"), ("We need to add them.", "meta_planning", "test")]
    return [{"record_id": f"gsm8k-0|T1|s{i}", "item_id": "gsm8k-0", "dataset": "gsm8k", "decoding": "sample",
             "temperature": 1.0, "prompt": P, "response": R, "raw_text": t + "<|im_end|>", "label": lab,
             "rationale": "hand", "split": split} for i, (t, lab, split) in enumerate(turns)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_fixture_split_and_judge_errors(tmp_path):
    fx = write_jsonl(tmp_path / "hand.jsonl", fixture_rows())
    assert len(load_labels(fx).labels) == 6
    assert len(load_labels(fx, split="test").labels) == 4
    with pytest.raises(ValueError, match="splits present"):
        load_labels(fx, split="tset")
    write_jsonl(tmp_path / "labels.jsonl", [
        {"record_id": "a", "label": "new_query", "genuine": False, "rationale": "", "judge": "j", "error": None},
        {"record_id": "b", "label": "judge_error", "genuine": None, "rationale": "", "judge": "j", "error": "x"}])
    src = load_labels(tmp_path)  # a run directory
    assert src.labels == {"a": "new_query"} and src.n_errors == 1
    write_jsonl(tmp_path / "bad.jsonl", [{"record_id": "a", "label": "nonsense"}])
    with pytest.raises(ValueError, match="not in the taxonomy"):
        load_labels(tmp_path / "bad.jsonl")


def test_compare_joins_on_record_id_and_reports():
    a = LabelSource("hand", {"1": "genuine_followup", "2": "new_query", "3": "new_query", "4": "generic_followup"})
    b = LabelSource("judge", {"1": "genuine_followup", "2": "new_query", "3": "generic_followup", "9": "new_query"},
                    n_errors=2)
    ag = compare(a, b)
    assert (ag.n, ag.n_only_a, ag.n_only_b, ag.n_errors_b) == (3, 1, 1, 2)
    assert ag.kappa_binary == pytest.approx(1.0) and ag.accuracy == pytest.approx(2 / 3)
    md = report_markdown(ag, "T")
    assert md.startswith("# T") and "| Cohen's κ, binary (genuine vs not) | 1.000 |" in md
    assert "| new | 0 | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in md  # confusion row of new_query: one kept, one -> generic


def test_cli_runs_the_offline_judge_on_the_fixture(tmp_path, capsys):
    fx = write_jsonl(tmp_path / "hand.jsonl", fixture_rows())
    out = tmp_path / "report.md"
    saved = tmp_path / "offline_labels.jsonl"
    assert main([str(fx), "offline-lexical", "--split", "test", "--out", str(out), "--save-labels", str(saved)]) == 0
    text = out.read_text()
    assert "`offline-v3+lexical`" in text and "split: test" in text and "4 user turns labelled by both" in text
    assert len(saved.read_text().splitlines()) == 4
    # A labels file as B (the saved judge labels) gives the same numbers.
    assert main([str(fx), str(saved), "--split", "test", "--out", str(tmp_path / "r2.md")]) == 0
    assert (tmp_path / "r2.md").read_text().split("## Per label")[1] == text.split("## Per label")[1]


def test_cli_refuses_a_judge_on_non_self_contained_rows(tmp_path):
    labels = write_jsonl(tmp_path / "labels.jsonl", [{"record_id": "a", "label": "new_query"}])
    assert main([str(labels), "offline"]) == 2  # a UserError: one line, exit 2 (was argparse's SystemExit)
