"""Loaders on the real shared files, malformed rows, the hub path, and the scorers."""

from __future__ import annotations

import json
import sys
import types

import pytest

from mechprobe.datasets import NAMES, find_data_dir, load_dataset, parse_hh
from mechprobe.scoring import extract_gsm8k, last_boxed, normalize_math, score

from .conftest import shared_data_dir

needs_shared = pytest.mark.skipif(shared_data_dir() is None, reason="../shared/data not beside the repo")


@needs_shared
@pytest.mark.parametrize("name", [n for n in NAMES if n != "builtin"])
def test_real_files_load_with_unique_stable_ids(name):
    a = load_dataset(name, limit=25)
    b = load_dataset(name, limit=25)
    assert len(a.items) == 25 and not a.skipped
    ids = [it.item_id for it in a.items]
    assert len(set(ids)) == 25 and ids == [it.item_id for it in b.items]
    assert all(it.prompt.strip() for it in a.items)
    assert load_dataset(name, limit=5).items == a.items[:5]


@needs_shared
def test_dataset_specific_fields():
    g = load_dataset("gsm8k", limit=1).items[0]
    assert g.gold == "18" and g.item_id == "gsm8k-0000"
    mt = load_dataset("mt_bench", limit=1).items[0]
    assert mt.reference_next_user and mt.reference_next_user == mt.meta["turn_2"]
    hh = load_dataset("hh_rlhf", limit=1).items[0]
    assert hh.prompt == "what are some pranks with a pen i can do?" and hh.reference_next_user == "yep"
    tc = load_dataset("topical_chat", limit=1).items[0]
    assert tc.reference_next_user.startswith("So, it would be")
    ife = load_dataset("ifeval", limit=1).items[0]
    assert ife.meta["instruction_id_list"] and ife.gold is None


def test_builtin_ships_with_the_package():
    d = load_dataset("builtin")
    assert len(d.items) >= 30
    scored = [it for it in d.items if it.gold is not None]
    assert scored and all(it.meta.get("scorer") == "gsm8k" for it in scored)


def test_malformed_rows_are_reported_and_skipped(tmp_path):
    p = tmp_path / "test.jsonl"
    good = {"question": "1+1?", "answer": "2\n#### 2"}
    p.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({"question": "no answer"}) + "\n"
                 + json.dumps(good) + "\n")
    d = load_dataset("gsm8k", path=p)
    assert len(d.items) == 2
    assert [(s.line, s.file) for s in d.skipped] == [(2, str(p)), (3, str(p))]
    assert "invalid JSON" in d.skipped[0].reason and "answer" in d.skipped[1].reason
    assert d.items[1].item_id == "gsm8k-0003"  # ids follow file rows, not surviving rows


def test_missing_data_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHPROBE_DATA_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert find_data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="--data-path"):
        load_dataset("gsm8k")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("gsm9k")


def test_hub_path_maps_rows(monkeypatch):
    calls = []

    def fake_load(hub_id, *args, **kw):
        calls.append((hub_id, args, kw))
        return [{"question": "What is 3*4?", "answer": "3*4=12\n#### 12"}, {"question": "bad"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load))
    d = load_dataset("gsm8k", source="hf")
    assert calls == [("openai/gsm8k", ("main",), {"split": "test"})]
    assert [it.gold for it in d.items] == ["12"] and d.source == "hf:openai/gsm8k"
    assert len(d.skipped) == 1


def test_parse_hh():
    t = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine"
    assert parse_hh(t) == [("user", "hi"), ("assistant", "hello"), ("user", "how are you?"), ("assistant", "fine")]


@pytest.mark.parametrize("text,want", [
    ("So she makes 9 * 2 = $18 every day.", "18"),
    ("The answer is 1,234.", "1234"),
    ("#### 72", "72"),
    ("Total: $1,234.00 dollars", "1234"),
    ("First 5, then \\boxed{42} and a footnote 3", "42"),
    ("no numbers here", None),
    ("It is -3.5 degrees", "-3.5"),
])
def test_gsm8k_extraction(text, want):
    assert extract_gsm8k(text) == want


def test_scores():
    assert score("gsm8k", "so the total is 18.", "18") == (1.0, "18")
    assert score("gsm8k", "so the total is 17, not 18? no: 17", "18")[0] == 0.0
    assert score("builtin", "She pays 5 dollars", "5", {"scorer": "gsm8k"})[0] == 1.0
    assert score("ifeval", "whatever", None) == (None, None)
    assert score("math500", "thus \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}")[0] == 1.0
    assert score("math500", "thus \\boxed{0.5}", "\\frac12")[0] == 1.0
    assert score("math500", "thus \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)")[0] == 1.0
    assert score("math500", "thus \\boxed{3}", "4")[0] == 0.0
    assert score("math500", "no box: 4", "4") == (0.0, None)
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{x^{2}}") == "x^{2}"
    assert normalize_math("x = 90^\\circ") == "90"
    assert normalize_math("\\text{ 5 cm}") == "5"
