"""Answer identification without a browser: distractor choice, number perturbation, the page, scoring, report."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from scipy.stats import beta

from mechprobe.audit import load_run_table, load_sample
from mechprobe.audit.identify import (
    CANT_TELL,
    IDENTIFY_FORMAT,
    choose_distractor,
    identify_pairs,
    load_pairs,
    perturb_numbers,
    same_query_answers,
    score_choices,
)
from mechprobe.cli.audit import add_args, run
from mechprobe.errors import UsageError
from mechprobe.io import read_json, read_jsonl
from mechprobe.records import AssistantRecord

from .run_fixture import build_run


def _ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


def _skeleton(text: str) -> str:
    return re.sub(r"\d+(?:,\d{3})*(?:\.\d+)?", "#", text)


# --- number perturbation -------------------------------------------------------------------------------------

def test_perturb_changes_key_numbers_and_keeps_the_text():
    query = "Tom buys 12 pens at $7 each and pays with a $100 bill. How much change?"
    answer = ("Step 1: the pens cost 12 * 7 = 84 dollars.\n1. He pays 100.\n2) Change: 100 - 84 = 16 dollars.\n"
              "So 16 is the answer, about 1,234.50 cents per 5 pens.")
    out = perturb_numbers(answer, query, "gsm8k-1")
    assert out is not None and out != answer
    assert _skeleton(out) == _skeleton(answer)  # only numbers differ
    got = [m.group() for m in re.finditer(r"\d+(?:,\d{3})*(?:\.\d+)?", out)]
    src = [m.group() for m in re.finditer(r"\d+(?:,\d{3})*(?:\.\d+)?", answer)]
    pairs = list(zip(src, got))
    # numbers copied from the query stay; the answer's own results change, one value to one value
    for a, b in pairs:
        if a in ("12", "7", "100"):
            assert a == b
    assert "Step 1:" in out and "\n1. He" in out and "\n2) Change" in out  # structure kept
    changed = {a: b for a, b in pairs if a not in ("12", "7", "100", "1", "2")}
    assert set(changed) == {"84", "16", "1,234.50", "5"}
    assert all(a != b for a, b in changed.items())
    assert len({b for a, b in pairs if a == "84"}) == 1 and len({b for a, b in pairs if a == "16"}) == 1
    assert re.fullmatch(r"\d{1,3}(?:,\d{3})*\.\d\d", changed["1,234.50"])  # separators and places kept
    assert not set(changed.values()) & {"12", "7", "100", "84", "16", "5"}  # never onto an existing value
    assert perturb_numbers(answer, query, "gsm8k-1") == out  # deterministic


def test_perturb_every_number_when_all_come_from_the_query_and_none_without_numbers():
    out = perturb_numbers("You have 3 apples and 4 pears.", "I have 3 apples and 4 pears", "k")
    assert out is not None and "3" not in out and "4" not in out and _skeleton(out) == "You have # apples and # pears."
    assert perturb_numbers("No numbers at all.", "", "k") is None
    assert perturb_numbers("1. First\n2. Second", "", "k") is None  # list markers only
    assert perturb_numbers("x = 0", "", "k") != "x = 0"


def test_choose_distractor_prefers_another_sample_of_the_item():
    d = choose_distractor("The answer is 84.", ["The answer is 84.", " The answer is 84. ", "I get 90."], "it-1")
    assert d is not None and d.kind == "other_sample" and d.text == "I get 90."
    d = choose_distractor("The answer is 84.", ["The answer is 84."], "it-1", "7 * 12")
    assert d is not None and d.kind == "perturbed" and d.text != "The answer is 84."
    assert _skeleton(d.text) == "The answer is #."
    assert choose_distractor("No numbers.", [], "it-1") is None


def test_distractor_answers_the_same_item_only(tmp_path):
    run_dir = tmp_path / "run"
    build_run(run_dir, n_steer_items=4, n_probe_items=2)
    answers = {r["item_id"]: AssistantRecord.from_dict(r) for r in read_jsonl(run_dir / "assistant.jsonl")}
    items = sorted(answers)
    first, second = items[0], items[1]
    # another sample of the first item (same query) and a record of the first item with another query
    extra = [AssistantRecord(first, "gsm8k", answers[first].prompt, "A second sample: the total is 5.", "end_of_turn", 9),
             AssistantRecord(first + "x", "gsm8k", answers[second].prompt, answers[second].response, "end_of_turn", 9)]
    sp = run_dir / "steering" / "split_answers" / "assistant.jsonl"
    sp.parent.mkdir(parents=True, exist_ok=True)
    sp.write_text("".join(json.dumps(a.to_dict()) + "\n" for a in extra))
    other = AssistantRecord(second, "gsm8k", "another query", "A stray answer to another query: 77.", "end_of_turn", 9)
    with open(sp, "a") as f:
        f.write(json.dumps(other.to_dict()) + "\n")
    assert run(_ns(str(run_dir), "--n", "40", "--by", "condition")) == 0
    sample, table = load_sample(run_dir), load_run_table(run_dir)
    pairs, left_out = identify_pairs(sample, table, same_query_answers(run_dir))
    assert not left_out and len(pairs) == len(sample.record_ids)
    all_answers = {a.response for a in answers.values()}
    for q in pairs:
        t = table.get(q.record_id)
        real, fake = (q.a, q.b) if q.real == "A" else (q.b, q.a)
        assert real == t.answer
        assert fake not in all_answers  # never another item's answer
        if t.item_id == first:
            assert q.kind == "other_sample" and fake == "A second sample: the total is 5."
        else:
            assert q.kind == "perturbed" and _skeleton(fake) == _skeleton(real)
            assert "77" not in fake or "77" in real
    # the same item gets the same distractor in every condition; the order is drawn per turn and recorded
    by_item: dict[str, set[str]] = {}
    for q in pairs:
        by_item.setdefault(table.get(q.record_id).item_id, set()).add(q.b if q.real == "A" else q.a)
    assert all(len(v) == 1 for v in by_item.values())
    assert {q.real for q in pairs} == {"A", "B"}
    assert identify_pairs(sample, table, same_query_answers(run_dir)) == (pairs, left_out)
    assert load_pairs(run_dir, sample) == pairs  # what the command recorded


# --- scoring ----------------------------------------------------------------------------------------------------

def test_score_choices_counts_cant_tell_as_not_identified():
    s = score_choices(["A", "B", "A", CANT_TELL, "B", "A", "A", "B", "A", "B"],
                      ["A", "B", "A", "A", "A", "A", "A", "B", "A", "B"], alpha=0.05)
    assert (s["n"], s["correct"], s["wrong"], s["cant_tell"]) == (10, 8, 1, 1)
    assert s["share"] == pytest.approx(0.8)
    assert s["lo"] == pytest.approx(beta.ppf(0.025, 8, 3), abs=1e-9)
    assert s["hi"] == pytest.approx(beta.ppf(0.975, 9, 2), abs=1e-9)
    assert s["p_above_chance"] == pytest.approx(56 / 1024, rel=1e-6)  # P(X >= 8), X ~ Bin(10, 0.5)
    empty = score_choices([], [])
    assert empty["n"] == 0 and empty["share"] is None
    with pytest.raises(ValueError):
        score_choices(["A"], [])


# --- the page and the import -----------------------------------------------------------------------------------

def test_identify_page_is_blind_and_round_trips_into_the_report(tmp_path, capsys):
    run_dir = tmp_path / "run"
    build_run(run_dir, n_steer_items=6, n_probe_items=2)
    assert run(_ns(str(run_dir), "--n", "8", "--by", "condition")) == 0
    out = capsys.readouterr().out
    page_p = run_dir / "audit" / "identify.html"
    assert str(page_p) in out and "next:" in out and "--labels" in out
    sample, table = load_sample(run_dir), load_run_table(run_dir)
    pairs = load_pairs(run_dir, sample)
    page = page_p.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="sheet-data">(.*?)</script>', page, re.S)
                      .group(1))
    assert data["mode"] == "identify" and data["format"] == IDENTIFY_FORMAT
    assert all(set(r) == {"row", "turn", "a", "b"} for r in data["rows"])
    for secret in ("other_sample", "perturbed", '"real"', "diff_means", "random|L14", "hybrid:test", "hand-D",
                   "genuine_followup", *sample.record_ids, *sample.keys()):
        assert secret not in page
    assert {r["row"] for r in data["rows"]} == {q.row for q in pairs}

    # a reader who gets the first five right, one wrong, and cannot tell on the rest
    real = {q.row: q.real for q in pairs}
    rows = []
    for i, q in enumerate(pairs):
        choice = q.real if i < 5 else ({"A": "B", "B": "A"}[q.real] if i == 5 else CANT_TELL)
        rows.append({"row": q.row, "choice": choice, "note": ""})
    export = {"format": IDENTIFY_FORMAT, "sample_id": sample.sample_id, "labeller": {"name": "ida", "kind": "person"},
              "rows": rows}
    f = tmp_path / "ida.json"
    f.write_text(json.dumps(export))
    assert run(_ns(str(run_dir), "--labels", str(f), "--n-boot", "20")) == 0  # identification alone
    md = capsys.readouterr().out
    assert "Answer identification" in md
    rep = read_json(run_dir / "audit" / "report.json")
    sec = rep["identification"]
    allrow = next(r for r in sec["by_stratum"] if r["labeller"] == "ida" and r["stratum"] == "all")
    assert (allrow["n"], allrow["correct"], allrow["wrong"], allrow["cant_tell"]) == (8, 5, 1, 2)
    per = {r["stratum"]: r for r in sec["by_stratum"] if r["stratum"] != "all"}
    assert set(per) == set(rep["rates"]) and sum(r["correct"] for r in per.values()) == 5
    for s, r in per.items():
        want = sum(1 for i, q in enumerate(pairs)
                   if table.get(q.record_id).stratum("condition") == s and rows[i]["choice"] == real[q.row])
        assert r["correct"] == want
        assert r["genuine_judge_only"]["point"] == pytest.approx(rep["rates"][s]["judge_only"]["point"])
    assert sum(r["n"] for r in sec["by_judge_verdict"]) == 8
    assert read_json(run_dir / "audit" / "identify_labels" / "ida.json")["labeller"]["name"] == "ida"

    # refusals: a choice that is not one, a row of another page, another sample
    bad = dict(export, labeller={"name": "bob", "kind": "person"},
               rows=[{"row": pairs[0].row, "choice": "C", "note": ""}])
    f.write_text(json.dumps(bad))
    with pytest.raises(UsageError, match="not one of"):
        run(_ns(str(run_dir), "--labels", str(f)))
    bad["rows"] = [{"row": "r0000000000", "choice": "A", "note": ""}]
    f.write_text(json.dumps(bad))
    with pytest.raises(UsageError, match="not a pair"):
        run(_ns(str(run_dir), "--labels", str(f)))
    bad["sample_id"], bad["rows"] = "s000", rows
    f.write_text(json.dumps(bad))
    with pytest.raises(UsageError, match="redrawn"):
        run(_ns(str(run_dir), "--labels", str(f)))
    assert not (run_dir / "audit" / "identify_labels" / "bob.json").exists()


def test_recorded_pairs_are_kept_for_the_same_sample(tmp_path, capsys):
    run_dir = tmp_path / "run"
    build_run(run_dir, n_steer_items=4, n_probe_items=2)
    assert run(_ns(str(run_dir), "--n", "6")) == 0
    p = run_dir / "audit" / "identify.json"
    rec = read_json(p)
    rec["pairs"][0]["a"], rec["pairs"][0]["b"] = rec["pairs"][0]["b"], rec["pairs"][0]["a"]
    rec["pairs"][0]["real"] = {"A": "B", "B": "A"}[rec["pairs"][0]["real"]]
    p.write_text(json.dumps(rec))
    assert run(_ns(str(run_dir), "--n", "6")) == 0  # same sample: the recorded pairs stand
    assert read_json(p) == rec
    assert run(_ns(str(run_dir), "--n", "6", "--seed", "1", "--redraw")) == 0
    assert read_json(p)["sample_id"] != rec["sample_id"]


def test_perturbing_an_answer_dense_with_small_numbers_still_changes_them():
    """An answer holding every small value (code, a numbered table) leaves no free value near each number; the
    perturbation must still find one rather than fail."""
    answer = "values: " + ", ".join(str(i) for i in range(0, 60)) + " and the total is 2"
    out = perturb_numbers(answer, "list the values", "mt_bench-1")
    assert out is not None and out != answer
