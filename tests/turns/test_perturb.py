"""Perturbed probe prompts (mechprobe.turns.perturb) and the variant stage, on a tiny ChatML tokenizer and model."""

from __future__ import annotations

import pytest
import torch

from mechprobe.errors import UserError
from mechprobe.io import read_jsonl
from mechprobe.lm import chat
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.models import LoadedModel
from mechprobe.records import Item
from mechprobe.stats import mcnemar_exact, paired_bootstrap
from mechprobe.turns.perturb import (
    APPENDED,
    VARIANTS,
    check_variants,
    derangement,
    truncate_response,
    variant_prompt,
    variant_records,
)
from mechprobe.turns.pipeline import ProbeConfig, run_probe, run_variant
from tests.study_helpers import assistant, make_chatml_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_truncate_really_cuts_to_half_the_tokens(tok):
    resp = "the answer is 3 . one plus two equals three"
    cut = truncate_response(tok, resp)
    n, m = len(_ids(tok, resp)), len(_ids(tok, cut))
    assert resp.startswith(cut) and len(cut) < len(resp)
    assert m == n // 2
    assert truncate_response(tok, "") == ""


def test_derangement_has_no_fixed_points_and_is_deterministic():
    ids = [f"gsm8k-{i:04d}" for i in range(9)]
    d = derangement(ids, seed=0, dataset="gsm8k")
    assert sorted(d) == sorted(d.values()) == sorted(ids)  # a permutation
    assert all(k != v for k, v in d.items())  # no item keeps its own response
    assert derangement(list(reversed(ids)), seed=0, dataset="gsm8k") == d  # input order does not matter
    assert derangement(ids, seed=1, dataset="gsm8k") != d  # the seed matters (9 items: 8! cycles)
    assert derangement(["a", "b"]) == {"a": "b", "b": "a"}
    with pytest.raises(UserError):
        derangement(["a"])


def _records():
    return [assistant("it-0", response="cats eat fish"), assistant("it-1", response="dogs eat bones"),
            assistant("it-2", response="the answer is 3")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_ends_with_the_models_own_user_header(tok, variant):
    header = chat.user_header(tok)
    assert header == "<|im_start|>user\n"
    for v in variant_records(tok, _records(), variant):
        pp = variant_prompt(tok, v, variant)
        h = _ids(tok, header)
        assert pp.input_ids[-len(h):] == h
        assert pp.boundary_index == len(pp.input_ids) - 1


def test_variant_conversations(tok):
    recs = _records()
    swap = variant_records(tok, recs, "swap")
    own = {r.item_id: r.response for r in recs}
    assert all(v.response != own[v.item_id] and v.response in own.values() for v in swap)
    assert [v.prompt for v in swap] == [r.prompt for r in recs]  # only the response moves

    appended = variant_records(tok, recs, "append_question")
    assert all(v.response == own[v.item_id] + APPENDED for v in appended)
    ids, q = variant_prompt(tok, appended[0], "append_question").input_ids, _ids(tok, APPENDED)
    assert 0 not in q and sum(ids[i:i + len(q)] == q for i in range(len(ids))) == 1  # in vocab, once

    nr = variant_prompt(tok, variant_records(tok, recs, "no_response")[0], "no_response")
    assert "assistant" not in nr.text  # no assistant turn at all
    tail = _ids(tok, f"<|im_start|>user\n{recs[0].prompt}<|im_end|>\n<|im_start|>user\n")
    assert nr.input_ids[-len(tail):] == tail  # the user header right after the query

    nc = variant_prompt(tok, variant_records(tok, recs, "no_conversation")[0], "no_conversation")
    assert recs[0].prompt not in nc.text and "assistant" not in nc.text  # no query, no response
    assert nc.input_ids == _ids(tok, "<|im_start|>system\nyou are tiny<|im_end|>\n<|im_start|>user\n")  # template's system
    nc_sys = variant_prompt(tok, variant_records(tok, recs, "no_conversation")[0], "no_conversation", system="a b")
    assert nc_sys.input_ids == _ids(tok, "<|im_start|>system\na b<|im_end|>\n<|im_start|>user\n")

    full = chat.build_probe_prompt(tok, recs[0].prompt, recs[0].response)
    tr = variant_prompt(tok, variant_records(tok, recs, "truncate")[0], "truncate")
    assert len(tr.input_ids) < len(full.input_ids)


def test_check_variants():
    assert check_variants(["swap", "truncate"]) == ["truncate", "swap"]
    with pytest.raises(UserError, match="unknown variant"):
        check_variants(["shuffle"])


def test_mcnemar_exact_on_known_tables():
    # b=1, c=6: p = 2 * (C(7,0)+C(7,1)) / 2^7 = 2 * 8/128 = 0.125 (exact, by hand)
    assert mcnemar_exact(1, 6) == pytest.approx(0.125, abs=1e-12)
    assert mcnemar_exact(6, 1) == pytest.approx(0.125, abs=1e-12)
    # b=0, c=10: p = 2 / 1024
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024, abs=1e-12)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_paired_bootstrap_sign_and_determinism():
    a_k, b_k, n = [0] * 20, [2] * 20, [4] * 20
    d, lo, hi, p = paired_bootstrap(a_k, n, b_k, n, n_boot=500)
    assert d == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5) and p == 0.0
    mixed = [i % 3 for i in range(20)]
    r1 = paired_bootstrap(mixed, n, list(reversed(mixed)), n, n_boot=300, seed=3)
    assert r1 == paired_bootstrap(mixed, n, list(reversed(mixed)), n, n_boot=300, seed=3)
    assert r1[1] <= r1[0] <= r1[2] and r1[3] > 0.05


def tiny_lm(tok) -> LoadedModel:
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=256)
    return LoadedModel(model=model, tokenizer=tok, name="tiny-chatml", weight_hash="tiny-0",
                       device=torch.device("cpu"), dtype=torch.float32)


def test_run_variant_end_to_end_on_a_tiny_model(tok, tmp_path):
    lm = tiny_lm(tok)
    items = [Item(item_id=f"it-{i}", dataset="gsm8k", prompt=p) for i, p in
             enumerate(["what is one plus two ?", "why do cats eat fish ?", "how does that make sense ?"])]
    cfg = ProbeConfig(model="tiny", dataset="gsm8k", limit=3, temperatures=[0.0, 1.0], samples=2,
                      max_assistant_tokens=6, max_user_tokens=4, batch_size=4)
    run = run_probe(cfg, tmp_path / "run", lm=lm, items=items, progress=False)
    plan = [("greedy", 0.0, 0), ("sample", 1.0, 0), ("sample", 1.0, 1)]
    out = run_variant(cfg, run, "swap", plan, lm=lm, progress=False)
    rows = read_jsonl(out / "user_turns.jsonl", key="record_id")
    assert len(rows) == 9 and all(r["variant"] == "swap" and r["record_id"].endswith("|swap") for r in rows)
    base = {r["item_id"]: r["response"] for r in read_jsonl(run / "assistant.jsonl")}
    seen = {r["item_id"]: r["response"] for r in read_jsonl(out / "assistant.jsonl")}
    partner = derangement(list(base), cfg.seed, "gsm8k")
    assert seen == {i: base[partner[i]] for i in base}
    # the parent run is untouched: its user turns are still the plain ones
    assert all(r["variant"] == "full" for r in read_jsonl(run / "user_turns.jsonl"))
    # resume: nothing new
    before = (out / "user_turns.jsonl").read_bytes()
    run_variant(cfg, run, "swap", plan, lm=lm, progress=False)
    assert (out / "user_turns.jsonl").read_bytes() == before
    out2 = run_variant(cfg, run, "no_conversation", plan[:1], lm=lm, progress=False)
    r2 = read_jsonl(out2 / "user_turns.jsonl")
    assert len(r2) == 3 and r2[0]["prompt_ids"][-2:] == _ids(tok, "<|im_start|>user\n")
