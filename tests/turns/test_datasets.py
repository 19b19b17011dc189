"""Dataset loaders: the real shared files, malformed rows, file discovery, and the hub path (fake
``datasets`` module returning rows in the hub schemas)."""

from __future__ import annotations

import ast
import gzip
import json
import logging
import operator
import sys
import types
from pathlib import Path

import pytest

from mechprobe.turns.datasets import NAMES, SPECS, data_dir_candidates, find_data_dir, load_dataset, parse_hh
from tests.conftest import shared_data_dir

SHARED = shared_data_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="no shared/data folder beside the repo (../shared/data)")
FILE_DATASETS = [n for n in NAMES if n != "builtin"]
# Row counts stated in each shared/data/*/SOURCE.md.
ROWS = {"gsm8k": 1319, "math500": 500, "ifeval": 541, "mt_bench": 80, "hh_rlhf": 2312, "topical_chat": 539}


def _raw(name: str) -> list:
    spec = SPECS[name]
    p = SHARED / spec.folder / spec.filename
    if p.suffix == ".json":
        return list(json.loads(p.read_text()).items())
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def no_hub(monkeypatch):
    """Make ``import datasets`` fail, as on a machine without the optional package."""
    monkeypatch.setitem(sys.modules, "datasets", None)


@pytest.fixture
def fake_hub(monkeypatch):
    """A fake ``datasets`` module: ``tables[hub_id]`` are the rows it returns; ``calls`` records requests."""
    mod = types.ModuleType("datasets")
    mod.tables, mod.calls = {}, []

    def load(hub_id, *args, **kwargs):
        mod.calls.append((hub_id, args, kwargs))
        rows = mod.tables[hub_id]
        if isinstance(rows, Exception):
            raise rows
        return iter(rows)

    mod.load_dataset = load
    monkeypatch.setitem(sys.modules, "datasets", mod)
    return mod


# ------------------------------------------------------------------------------------------------
# Real files


@needs_shared
@pytest.mark.parametrize("name", FILE_DATASETS)
def test_real_file_loads_every_row_with_unique_stable_ids(name):
    full = load_dataset(name, path=SHARED)
    assert len(full.items) == ROWS[name] and full.skipped == []
    assert full.source == str(SHARED / SPECS[name].folder / SPECS[name].filename)
    ids = [it.item_id for it in full.items]
    assert len(set(ids)) == len(ids)
    assert ids[0] == f"{name}-0000" and ids[7] == f"{name}-0007"
    assert all(it.dataset == name and it.prompt.strip() for it in full.items)
    again = load_dataset(name, path=SHARED, limit=25)
    assert [it.item_id for it in again.items] == ids[:25]
    assert again.items == full.items[:25]
    assert load_dataset(name, path=SHARED, limit=5).items == full.items[:5]
    assert load_dataset(name, path=SHARED, limit=0).items == []


@needs_shared
def test_default_search_finds_shared_data_from_the_repo(monkeypatch):
    monkeypatch.delenv("MECHPROBE_DATA_DIR", raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert find_data_dir().resolve() == SHARED.resolve()  # ../shared may be a symlink
    assert Path(load_dataset("gsm8k", limit=3).source).resolve() == SHARED.resolve() / "gsm8k" / "test.jsonl"


@needs_shared
def test_gsm8k_gold_is_the_number_after_the_hashes():
    raw = _raw("gsm8k")
    items = load_dataset("gsm8k", path=SHARED).items
    assert items[0].gold == "18"
    for row, it in zip(raw, items):
        assert it.prompt == row["question"]
        assert it.gold == row["answer"].split("####")[-1].strip().replace(",", "")
        assert "," not in it.gold and it.gold.lstrip("-").replace(".", "").isdigit()
    assert any("," in r["answer"].split("####")[-1] for r in raw)  # the comma rule is exercised


@needs_shared
def test_math500_gold_and_meta():
    raw = _raw("math500")
    items = load_dataset("math500", path=SHARED).items
    assert [it.gold for it in items] == [r["answer"] for r in raw]
    assert items[3].meta == {k: raw[3][k] for k in ("subject", "level", "unique_id")}


@needs_shared
def test_ifeval_keeps_instructions_in_meta():
    raw = _raw("ifeval")
    items = load_dataset("ifeval", path=SHARED).items
    for row, it in zip(raw, items):
        assert it.gold is None and it.prompt == row["prompt"]
        assert it.meta == {"key": row["key"], "instruction_id_list": row["instruction_id_list"],
                           "kwargs": row["kwargs"]}


@needs_shared
def test_mt_bench_first_turn_with_the_second_as_reference():
    raw = _raw("mt_bench")
    items = load_dataset("mt_bench", path=SHARED).items
    for row, it in zip(raw, items):
        assert it.prompt == row["turns"][0]
        assert it.reference_next_user == it.meta["turn_2"] == row["turns"][1]
        assert it.meta["question_id"] == row["question_id"] and it.meta["category"] == row["category"]
    assert sum("reference" in it.meta for it in items) == sum(bool(r.get("reference")) for r in raw) > 0


@needs_shared
def test_hh_rlhf_reference_is_the_human_turn_after_the_first_assistant_turn():
    items = load_dataset("hh_rlhf", path=SHARED).items
    first = items[0]
    assert first.prompt == "what are some pranks with a pen i can do?"
    assert first.meta["original_assistant"] == "Are you looking for practical joke ideas?"
    assert first.reference_next_user == "yep"
    # SOURCE.md: 1650 of the 2312 conversations have a human turn after an assistant turn.
    assert sum(it.reference_next_user is not None for it in items) == 1650
    for it in items:
        assert "\n\nHuman:" not in it.prompt and "\n\nAssistant:" not in it.prompt
    raw = _raw("hh_rlhf")
    for row, it in zip(raw[:200], items[:200]):
        chunks = row["chosen"].split("\n\nHuman: ")
        assert it.prompt == chunks[1].split("\n\nAssistant: ")[0].strip()
        if it.reference_next_user is not None:
            assert it.reference_next_user == chunks[2].split("\n\nAssistant: ")[0].strip()


@needs_shared
def test_topical_chat_first_message_and_same_speakers_next_turn():
    raw = _raw("topical_chat")
    items = load_dataset("topical_chat", path=SHARED).items
    for (cid, conv), it in zip(raw, items):
        msgs = conv["content"]
        assert msgs[0]["agent"] == msgs[2]["agent"] != msgs[1]["agent"]  # the data alternates here
        assert it.meta["conversation_id"] == cid and it.meta["user_agent"] == msgs[0]["agent"]
        assert it.prompt == msgs[0]["message"].strip()
        assert it.meta["original_reply"] == msgs[1]["message"].strip()
        assert it.reference_next_user == msgs[2]["message"].strip()
    assert items[0].reference_next_user.startswith("So, it would be")


# ------------------------------------------------------------------------------------------------
# Builtin prompts


def _arith(expr: str) -> float:
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}

    def ev(n: ast.AST) -> float:
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float):
            return n.value
        if isinstance(n, ast.BinOp):
            return ops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp):
            return ops[type(n.op)](ev(n.operand))
        raise ValueError(f"not arithmetic: {ast.dump(n)}")

    return ev(ast.parse(expr, mode="eval").body)


def test_builtin_ships_with_the_package_and_its_golds_are_right():
    d = load_dataset("builtin")
    assert Path(d.source).name == "builtin_prompts.jsonl" and d.skipped == []
    assert 35 <= len(d.items) <= 50
    ids = [it.item_id for it in d.items]
    assert len(set(ids)) == len(ids) and all(it.dataset == "builtin" for it in d.items)
    kinds = {it.meta["kind"] for it in d.items}
    assert {"arithmetic", "explain", "advice", "instruction"} <= kinds
    scored = [it for it in d.items if it.gold is not None]
    assert len(scored) >= 10
    for it in scored:
        assert it.meta["scorer"] == "gsm8k"
        assert _arith(it.meta["calc"]) == pytest.approx(float(it.gold)), it.item_id
    for it in d.items:
        if it.meta.get("scorer") == "ifeval":
            assert len(it.meta["instruction_id_list"]) == len(it.meta["kwargs"]) >= 1
    assert load_dataset("builtin", limit=3).items == d.items[:3]


@needs_shared
def test_builtin_prompts_are_not_copied_from_gsm8k():
    questions = {r["question"].strip().lower() for r in _raw("gsm8k")}
    assert not any(it.prompt.strip().lower() in questions for it in load_dataset("builtin").items)


def test_builtin_reads_another_prompt_file(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text(json.dumps({"item_id": "q1", "dataset": "builtin", "prompt": "Hi?", "gold": 3}) + "\n"
                 + json.dumps({"item_id": "q1", "prompt": "dup"}) + "\n")
    d = load_dataset("builtin", path=p)
    assert [(it.item_id, it.gold) for it in d.items] == [("q1", "3")]
    assert d.skipped[0].line == 2 and "duplicate item_id" in d.skipped[0].reason


# ------------------------------------------------------------------------------------------------
# Malformed rows


def test_malformed_rows_are_reported_with_file_and_line_and_skipped(tmp_path, caplog):
    p = tmp_path / "test.jsonl"
    good = {"question": "1+1?", "answer": "1+1=2\n#### 2"}
    lines = [json.dumps(good), "{not json", json.dumps({"question": "no answer"}), "",
             json.dumps([1, 2]), json.dumps({"question": "q", "answer": "no final line"}), json.dumps(good)]
    p.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="mechprobe.turns.datasets"):
        d = load_dataset("gsm8k", path=p)
    assert [it.item_id for it in d.items] == ["gsm8k-0000", "gsm8k-0005"]  # ids follow file rows
    assert [(s.file, s.line) for s in d.skipped] == [(str(p), 2), (str(p), 3), (str(p), 5), (str(p), 6)]
    reasons = [s.reason for s in d.skipped]
    assert "invalid JSON" in reasons[0] and "'answer'" in reasons[1]
    assert "JSON object" in reasons[2] and "####" in reasons[3]
    assert sum(f"{p}:2" in r.getMessage() for r in caplog.records) == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 4
    assert load_dataset("gsm8k", path=p, limit=1).skipped == []  # stops before the bad rows


def test_malformed_hh_and_topical_rows(tmp_path):
    hh = tmp_path / "hh.jsonl.gz"
    with gzip.open(hh, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: and?", "rejected": ""}) + "\n")
        f.write(json.dumps({"chosen": "Assistant: no human first", "rejected": ""}) + "\n")
        f.write(json.dumps({"rejected": "x"}) + "\n")
    d = load_dataset("hh_rlhf", path=hh)
    assert [(it.prompt, it.reference_next_user) for it in d.items] == [("hi", "and?")]
    assert [s.line for s in d.skipped] == [2, 3]

    tc = tmp_path / "tc.json"
    conv = {"content": [{"message": "a", "agent": "agent_1"}, {"message": "b", "agent": "agent_2"}]}
    tc.write_text(json.dumps({"c1": conv, "c2": {"config": "A"}, "c3": {"content": [{"agent": "agent_1"}]},
                              "c4": conv}, indent=2))
    d = load_dataset("topical_chat", path=tc)
    assert [it.item_id for it in d.items] == ["topical_chat-0000", "topical_chat-0003"]
    assert d.items[0].reference_next_user is None and d.items[0].meta["original_reply"] == "b"
    text = tc.read_text().splitlines()
    for s, key in zip(d.skipped, ["c2", "c3"]):
        assert s.file == str(tc) and text[s.line - 1].strip().startswith(f'"{key}"')
    assert "'content'" in d.skipped[0].reason and "'message'" in d.skipped[1].reason

    broken = tmp_path / "broken.json"
    broken.write_text('{"c1": {"content": [}')
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        load_dataset("topical_chat", path=broken)


def test_parse_hh_merges_repeated_roles():
    t = "\n\nHuman: hi\n\nAssistant: hello\n\nAssistant: again\n\nHuman: how are you?\n\nAssistant: fine"
    assert parse_hh(t) == [("user", "hi"), ("assistant", "hello\n\nagain"), ("user", "how are you?"),
                           ("assistant", "fine")]


# ------------------------------------------------------------------------------------------------
# Finding files, errors


def test_path_may_be_a_file_or_a_folder_and_env_var_is_used(tmp_path, monkeypatch):
    row = json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n"
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "test.jsonl").write_text(row)
    (tmp_path / "tree" / "gsm8k").mkdir(parents=True)
    (tmp_path / "tree" / "gsm8k" / "test.jsonl").write_text(row)
    for p in (tmp_path / "flat", tmp_path / "flat" / "test.jsonl", tmp_path / "tree"):
        assert load_dataset("gsm8k", path=p).items[0].gold == "4"
    monkeypatch.setenv("MECHPROBE_DATA_DIR", str(tmp_path / "tree"))
    assert find_data_dir() == tmp_path / "tree"
    assert load_dataset("gsm8k").source == str(tmp_path / "tree" / "gsm8k" / "test.jsonl")


def test_search_walks_up_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MECHPROBE_DATA_DIR", raising=False)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "main" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "main" / "sub")
    assert data_dir_candidates()[:3] == [tmp_path.resolve() / p / "shared" / "data"
                                         for p in ("main/sub", "main", ".")]
    assert find_data_dir() == tmp_path.resolve() / "shared" / "data"


def test_missing_data_is_a_clear_error(tmp_path, monkeypatch, no_hub):
    monkeypatch.setenv("MECHPROBE_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="data_path=") as e:
        load_dataset("gsm8k")
    assert "MECHPROBE_DATA_DIR" in str(e.value) and "gsm8k/test.jsonl" in str(e.value)
    assert "datasets" in str(e.value)
    with pytest.raises(FileNotFoundError, match="nothing at"):
        load_dataset("math500", path=tmp_path / "nope.jsonl")
    with pytest.raises(ImportError, match=r"mechprobe\[hub\]"):
        load_dataset("gsm8k", source="hf")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_dataset("gsm9k")
    with pytest.raises(ValueError, match="unknown source"):
        load_dataset("gsm8k", source="web")
    with pytest.raises(ValueError, match="limit"):
        load_dataset("builtin", limit=-1)


# ------------------------------------------------------------------------------------------------
# Hugging Face hub path (fake module, hub schemas)


def test_hub_rows_are_mapped_and_bad_rows_skipped(fake_hub):
    fake_hub.tables["openai/gsm8k"] = [{"question": "What is 3*4?", "answer": "3*4=<<3*4=12>>12\n#### 12"},
                                       {"question": "bad"},
                                       {"question": "Big?", "answer": "#### 1,000"}]
    d = load_dataset("gsm8k", source="hf")
    assert fake_hub.calls == [("openai/gsm8k", ("main",), {"split": "test"})]
    assert [(it.item_id, it.gold) for it in d.items] == [("gsm8k-0000", "12"), ("gsm8k-0002", "1000")]
    assert d.source == "hf:openai/gsm8k"
    assert [(s.file, s.line) for s in d.skipped] == [("hf:openai/gsm8k", 2)]
    assert len(load_dataset("gsm8k", source="hf", limit=1).items) == 1


def test_hub_ids_splits_and_schemas(fake_hub):
    fake_hub.tables.update({
        "HuggingFaceH4/MATH-500": [{"problem": "1/2+1/2?", "solution": "$\\boxed{1}$", "answer": "1",
                                    "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}],
        "google/IFEval": [{"key": 7, "prompt": "No commas please.", "instruction_id_list": ["punctuation:no_comma"],
                           "kwargs": [{"num_words": None, "relation": None}]}],
        "HuggingFaceH4/mt_bench_prompts": [{"prompt": ["Write a haiku.", "Now make it rhyme."],
                                            "prompt_id": 12345678, "category": "writing", "reference": []}],
        "Anthropic/hh-rlhf": [{"chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: thanks", "rejected": "x"}],
    })
    m = load_dataset("math500", source="hf").items[0]
    ife = load_dataset("ifeval", source="hf").items[0]
    mt = load_dataset("mt_bench", source="hf").items[0]
    hh = load_dataset("hh_rlhf", source="hf", split="test").items[0]
    assert [(c[0], c[1], c[2]) for c in fake_hub.calls] == [
        ("HuggingFaceH4/MATH-500", (), {"split": "test"}),
        ("google/IFEval", (), {"split": "train"}),
        ("HuggingFaceH4/mt_bench_prompts", (), {"split": "train"}),
        ("Anthropic/hh-rlhf", (), {"data_dir": "harmless-base", "split": "test"}),
    ]
    assert m.gold == "1" and m.meta["unique_id"] == "test/algebra/1.json"
    assert ife.meta["kwargs"] == [{}] and ife.meta["key"] == 7
    assert (mt.prompt, mt.reference_next_user, mt.meta["category"]) == ("Write a haiku.", "Now make it rhyme.",
                                                                        "writing")
    assert (hh.prompt, hh.reference_next_user, hh.meta["original_assistant"]) == ("hi", "thanks", "hello")
    with pytest.raises(ValueError, match="no canonical Hugging Face hub copy"):
        load_dataset("topical_chat", source="hf")


@needs_shared
@pytest.mark.parametrize("name", ["gsm8k", "math500", "ifeval", "mt_bench", "hh_rlhf"])
def test_hub_schema_rows_give_the_same_items_as_the_local_file(name, fake_hub):
    """Real rows rewritten into the hub schema map to the same items (so ids and fields agree)."""
    raw = _raw(name)[:20]
    if name == "mt_bench":
        hub_rows = [{"prompt": r["turns"], "prompt_id": 1, "category": r["category"],
                     "reference": r.get("reference", [])} for r in raw]
    elif name == "ifeval":
        arg_names = sorted({k for r in _raw(name) for d in r["kwargs"] for k in d})
        hub_rows = [{**r, "kwargs": [{k: d.get(k) for k in arg_names} for d in r["kwargs"]]} for r in raw]
    else:
        hub_rows = raw
    fake_hub.tables[SPECS[name].hub_id] = hub_rows
    local, hub = load_dataset(name, path=SHARED, limit=20).items, load_dataset(name, source="hf", limit=20).items
    if name == "mt_bench":
        for it in local:
            it.meta["question_id"] = None
    assert hub == local


def test_auto_falls_back_to_the_hub_and_explains_a_failed_hub(tmp_path, monkeypatch, fake_hub):
    monkeypatch.setenv("MECHPROBE_DATA_DIR", str(tmp_path))
    fake_hub.tables["openai/gsm8k"] = [{"question": "q", "answer": "#### 3"}]
    assert load_dataset("gsm8k").source == "hf:openai/gsm8k"
    fake_hub.tables["HuggingFaceH4/MATH-500"] = ConnectionError("no route to host")
    with pytest.raises(FileNotFoundError, match="hub failed: could not load.*no route to host"):
        load_dataset("math500")
    with pytest.raises(RuntimeError, match="could not load HuggingFaceH4/MATH-500"):
        load_dataset("math500", source="hf")
    with pytest.raises(FileNotFoundError, match="data_path="):
        load_dataset("gsm8k", source="local")
    n_calls = len(fake_hub.calls)
    with pytest.raises(FileNotFoundError, match="has no Hugging Face hub copy"):
        load_dataset("topical_chat")
    assert len(fake_hub.calls) == n_calls
