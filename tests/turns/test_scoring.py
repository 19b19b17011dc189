"""Task scorers: GSM8K final-number rule, MATH boxed answers, IFEval checker glue, unscored datasets."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest

from mechprobe.turns import scoring
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.scoring import (
    extract_gsm8k,
    last_boxed,
    math_equal,
    normalize_math,
    normalize_number,
    score,
)
from tests.conftest import shared_data_dir

SHARED = shared_data_dir()


@pytest.mark.parametrize("text,want", [
    ("So she makes 9 * 2 = $18 every day.", "18"),
    ("The answer is 72", "72"),
    ("The answer is 1,234.", "1234"),
    ("Total: $1,234.00", "1234"),
    ("#### 72", "72"),
    ("Work: 3 + 4 = 7\n#### 7\nThanks for 2 questions", "7"),        # '####' beats the last number
    ("First 5, then \\boxed{42} and a footnote 3", "42"),          # a box beats the last number
    ("$\\boxed{\\$1,000}$", "1000"),
    ("The answer is 18. I hope these 2 tips help!", "18"),         # answer phrase beats the last number
    ("The answer is: **250**.", "250"),
    ("The answer is 5 + 3 = 8", "8"),                              # phrase followed by an operator: last number
    ("She has 18 eggs, then eats 2", "2"),                         # the documented cost of the last-number rule
    ("It is -3.5 degrees", "-3.5"),
    ("open between 10-18", "18"),                                  # range dash is not a sign
    ("items 1,8", "8"),                                            # not a thousands group: two numbers
    ("18.50 dollars.", "18.5"),
    ("no numbers here", None),
    ("", None),
])
def test_gsm8k_extraction(text, want):
    assert extract_gsm8k(text) == want


@pytest.mark.parametrize("response,gold,want", [
    ("so the total is 18.", "18", 1.0),
    ("The answer is $1,234.00", "1234", 1.0),
    ("#### 1,000,000", "1000000", 1.0),
    ("It costs 18.5 dollars", "18", 0.0),       # no truncation
    ("The total is 180", "18", 0.0),            # no substring match
    ("The total is -18", "18", 0.0),
    ("17, not 18? no: 17", "18", 0.0),          # the last number counts
    ("The answer is 18 apples and 2 pears", "2", 0.0),
    ("I cannot solve this.", "18", 0.0),
])
def test_gsm8k_score(response, gold, want):
    s, extracted = score("gsm8k", response, gold, {})
    assert s == want
    assert extracted == extract_gsm8k(response)


def test_normalize_number():
    assert normalize_number("$1,234.00") == "1234"
    assert normalize_number("-0.50") == "-0.5"
    assert normalize_number("72.") == "72"
    assert normalize_number("abc") is None and normalize_number("") is None
    assert normalize_number("nan") is None


@pytest.mark.skipif(SHARED is None, reason="no shared/data folder beside the repo (../shared/data)")
def test_gsm8k_reference_solutions_score_one_and_shuffled_ones_zero():
    items = load_dataset("gsm8k", path=SHARED).items
    assert all(score("gsm8k", it.meta["solution"], it.gold, it.meta)[0] == 1.0 for it in items)
    shifted = [score("gsm8k", b.meta["solution"], a.gold, a.meta)[0] for a, b in zip(items, items[1:])]
    assert sum(shifted) / len(shifted) < 0.02  # a neighbour's solution is (almost) never right


def test_builtin_items_are_scored_like_gsm8k():
    assert score("builtin", "She pays 5 dollars", "5", {"scorer": "gsm8k"}) == (1.0, "5")
    assert score("builtin", "She pays 5 dollars", "5", {}) == (1.0, "5")  # records without meta
    assert score("builtin", "She pays 6 dollars", "5", {"scorer": "gsm8k"}) == (0.0, "6")
    assert score("builtin", "Sure, here are 3 tips", None, {"kind": "advice"}) == (None, None)


# ------------------------------------------------------------------------------------------------
# MATH-500


def test_last_boxed():
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("so \\fbox{7}") == "7"
    assert last_boxed("thus $\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{\\text{(B)}}") == "\\text{(B)}"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize("pred,gold", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("0.5", "\\frac12"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}"),
    ("90", "90^\\circ"),
    ("5.4", "5.4 \\text{ cents}"),
    ("5", "x=5"),
    ("y=2x+3", "y = 2x + 3"),
    ("C", "\\text{(C)}"),
    ("Evelyn", "\\text{Evelyn}"),
    ("10080", "10,\\!080"),
    ("\\sqrt{2}", "\\sqrt2"),
    ("15", "15\\mbox{ cm}^2"),
    ("36", "\\$36"),
    ("0.25", ".25"),
    ("3.", "3"),
])
def test_math_equivalent_answers(pred, gold):
    assert math_equal(pred, gold)
    assert score("math500", f"Thus the answer is $\\boxed{{{pred}}}$.", gold, {}) == (1.0, pred)


@pytest.mark.parametrize("pred,gold", [
    ("3", "4"),
    ("\\frac{1}{3}", "0.33"),
    ("12", "1,2"),                    # a list is not a thousands-separated number
    ("(1,2)", "(2,1)"),
    ("2\\sqrt{3}", "\\sqrt{12}"),     # equal values, but no symbolic algebra: documented limitation
    ("x+1", "x-1"),
    ("\\frac{1}{2}", "\\frac{2}{1}"),
    ("-5", "5"),
])
def test_math_different_answers(pred, gold):
    assert not math_equal(pred, gold)
    assert score("math500", f"\\boxed{{{pred}}}", gold, {})[0] == 0.0


def test_math_without_a_box_scores_zero():
    assert score("math500", "The answer is 4", "4", {}) == (0.0, None)
    assert score("math500", "\\boxed{3} then corrected: \\boxed{4}", "4", {}) == (1.0, "4")
    assert normalize_math(" x = 90^\\circ. ") == "90"


@pytest.mark.skipif(SHARED is None, reason="no shared/data folder beside the repo (../shared/data)")
def test_math500_reference_solutions_score_one():
    items = load_dataset("math500", path=SHARED).items
    raw = [json.loads(line) for line in (SHARED / "math500" / "test.jsonl").open()]
    assert all(score("math500", r["solution"], it.gold, it.meta) == (1.0, last_boxed(r["solution"]))
               for r, it in zip(raw, items))
    wrong = [score("math500", r["solution"], it.gold, it.meta)[0] for r, it in zip(raw[1:], items)]
    assert sum(wrong) / len(wrong) < 0.05


# ------------------------------------------------------------------------------------------------
# IFEval


@pytest.fixture
def fake_checker(monkeypatch):
    """A stand-in for ``if_verifiable`` whose checkers pass when the instruction id is in the response."""
    calls = []

    class Result:
        def __init__(self, iid, ok):
            self.instruction_id, self.strict_pass, self.loose_pass = iid, ok, ok

    def evaluate_instructions(response, ids, kwargs, prompt, registry):
        calls.append((response, ids, kwargs))
        if "boom" in response:
            raise LookupError("Resource punkt not found.")
        results = [Result(i, i in response) for i in ids if i in registry]
        return results, types.SimpleNamespace(binary_strict=float(bool(results) and all(r.strict_pass
                                                                                       for r in results)))

    pkg = types.ModuleType("if_verifiable")
    common = types.ModuleType("if_verifiable.common")
    common.evaluate_instructions = evaluate_instructions
    sub = types.ModuleType("if_verifiable.ifeval")
    reg = types.ModuleType("if_verifiable.ifeval.instructions_registry")
    reg.INSTRUCTION_DICT = {"a:x": object, "b:y": object}
    for name, mod in [("if_verifiable", pkg), ("if_verifiable.common", common), ("if_verifiable.ifeval", sub),
                      ("if_verifiable.ifeval.instructions_registry", reg)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(scoring, "_warned", set())
    return calls


def test_ifeval_glue(fake_checker, caplog):
    meta = {"instruction_id_list": ["a:x", "b:y"], "kwargs": [{}, {"n": 2}]}
    assert score("ifeval", "a:x and b:y", None, meta) == (1.0, "2/2 strict")
    assert score("ifeval", "only a:x", None, meta) == (0.0, "1/2 strict")
    assert fake_checker[-1] == ("only a:x", ["a:x", "b:y"], [{}, {"n": 2}])
    assert score("ifeval", "   ", None, meta) == (0.0, "0/2 strict")
    assert score("ifeval", "boom", None, meta) == (None, None)              # missing nltk data: unscored
    assert score("ifeval", "boom again", None, meta) == (None, None)
    assert sum("nltk" in r.getMessage() for r in caplog.records) == 1       # warned once
    assert score("ifeval", "x", None, {"instruction_id_list": ["zz:unknown"], "kwargs": [{}]}) == (None, None)
    assert score("ifeval", "x", None, {}) == (None, None)
    assert score("builtin", "b:y", None, {"scorer": "ifeval", "instruction_id_list": ["b:y"],
                                          "kwargs": [{}]}) == (1.0, "1/1 strict")


def test_ifeval_without_the_package_is_unscored(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "if_verifiable", None)
    monkeypatch.setattr(scoring, "_warned", set())
    meta = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    assert score("ifeval", "no commas here", None, meta) == (None, None)
    assert score("ifeval", "again", None, meta) == (None, None)
    assert [r.getMessage() for r in caplog.records].count(
        "IFEval items are unscored: pip install 'mechprobe[ifeval]' (if-verifiable) to check them") == 1


@pytest.mark.skipif(importlib.util.find_spec("if_verifiable") is None,
                    reason="optional extra not installed: pip install 'mechprobe[ifeval]'")
def test_ifeval_real_checkers():
    no_comma = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    assert score("ifeval", "No commas in this reply.", None, no_comma) == (1.0, "1/1 strict")
    assert score("ifeval", "One, two.", None, no_comma) == (0.0, "0/1 strict")
    both = {"instruction_id_list": ["change_case:english_lowercase", "detectable_format:title"],
            "kwargs": [{}, {}]}
    assert score("ifeval", "<<a title>>\nall of this text is lowercase english prose.", None, both)[0] == 1.0
    assert score("ifeval", "<<A Title>>\nThis Text Is Not Lowercase.", None, both) == (0.0, "1/2 strict")


# ------------------------------------------------------------------------------------------------


def test_unscored_datasets():
    for ds in ("mt_bench", "hh_rlhf", "topical_chat"):
        assert score(ds, "The answer is 4", "4" if ds == "mt_bench" else None, {}) == (None, None)
    assert score("gsm8k", "4", None, {}) == (None, None)
