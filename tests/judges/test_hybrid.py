"""The hybrid judge (``--judge hybrid:MODEL``): offline form rules + a local model's grounding PMI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mechprobe.errors import UsageError
from mechprobe.io import read_jsonl
from mechprobe.judges.base import JudgeInput, inputs_from_rows
from mechprobe.judges.factory import make_judge
from mechprobe.judges.hybrid import CANDIDATES, NULL_RESPONSE, HybridJudge, turn_logprob
from mechprobe.lm import chat
from mechprobe.lm.choice import ChoiceScorer
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import GENUINE, LABELS
from mechprobe.turns.pipeline import ProbeConfig
from tests.conftest import REPO, requires_smollm2

FIXTURE = REPO / "tests" / "fixtures" / "hand_labels.jsonl"


def test_make_judge_hybrid_needs_a_model():
    with pytest.raises(ValueError, match="hybrid:MODEL needs a model"):
        make_judge("hybrid:")


def _off(label: str) -> LabelRecord:
    return LabelRecord(record_id="r", label=label, genuine=label == GENUINE, rationale="R10: x", judge="offline")


@requires_smollm2
@pytest.mark.slow
def test_decide_keeps_form_labels_and_thresholds_grounding(smol):
    j = HybridJudge(loaded=smol, cache_dir=False, threshold=0.3)
    assert j.decide(_off("prompt_restatement"), None) == ("prompt_restatement", 0.0)
    lab, p = j.decide(_off("new_query"), 0.5)
    assert lab == GENUINE and p > 0.5
    lab, p = j.decide(_off(GENUINE), 0.1)
    assert lab == GENUINE and p >= 0.5  # offline genuine, and the model does not contradict it (PMI >= veto 0)
    lab, p = j.decide(_off(GENUINE), -0.1)
    assert lab == "new_query" and p < 0.5  # the offline rule's genuine is demoted when the answer does not help
    lab, _ = j.decide(_off("generic_followup"), 0.0)
    assert lab == "generic_followup"
    assert "+t0.3" in j.name  # a non-default threshold is part of the judge's name (labels never mix)
    with pytest.raises(ValueError, match="finite"):
        HybridJudge(loaded=smol, cache_dir=False, threshold=float("nan"))
    with pytest.raises(ValueError, match="finite"):
        HybridJudge(loaded=smol, cache_dir=False, veto=float("inf"))


@requires_smollm2
@pytest.mark.slow
def test_turn_logprob_with_reused_prefix_equals_one_full_forward(smol):
    """KV reuse is an optimisation only: same log-probability as scoring the whole sequence at once."""
    tok, model = smol.tokenizer, smol.model
    conv = [{"role": "user", "content": "What is 12 times 7?"},
            {"role": "assistant", "content": "12 times 7 is 84, because 10*7=70 and 2*7=14."}]
    turns = ["Why did you split 12 into 10 and 2?", "Thanks! What about 13 times 7?"]
    store = ChoiceScorer(model, tok, ["x"])
    for turn in turns:  # the second turn reuses the first one's conversation prefix
        got, n = turn_logprob(store, tok, conv, turn, "real")
        pre_text = chat.render(tok, conv) + chat.user_header(tok)
        ids, _ = chat.tokenize_rendered(tok, pre_text + turn)
        pre = chat.ids_up_to(tok, pre_text + turn, len(pre_text))
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        want = sum(float(logp[k - 1, ids[k]]) for k in range(len(pre), len(ids)))
        assert n == len(ids) - len(pre) > 3
        # fp32, same weights, KV from an earlier forward vs one forward: only summation order differs
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-3)
    assert store.stats["turn_tokens"] < 2 * (len(ids))  # the second turn did not recompute the conversation


@requires_smollm2
@pytest.mark.slow
def test_hybrid_labels_are_valid_and_grounded_turns_score_higher(smol, tmp_path):
    """Every row gets a taxonomy label; a reaction to the answer's own content has a higher PMI than a
    new unrelated query on the same conversation (a grounding judge must at least see that)."""
    rows = [r for r in read_jsonl(FIXTURE) if r["split"] == "dev"][:9]
    j = HybridJudge(loaded=smol, cache_dir=tmp_path / "cache")
    recs = list(j.label_many(inputs_from_rows(rows)))
    assert [r.record_id for r in recs] == [r["record_id"] for r in rows]
    for r in recs:
        assert r.label in LABELS and r.genuine == (r.label == GENUINE)
        assert 0.0 <= r.probs[GENUINE] <= 1.0
        assert ("pmi" in r.probs) == ("PMI" in r.rationale)
    runs = j.stats["model_runs"]
    again = list(HybridJudge(loaded=smol, cache_dir=tmp_path / "cache").label_many(inputs_from_rows(rows)))
    assert [r.to_dict() for r in again] == [r.to_dict() for r in recs] and runs > 0  # cached PMIs, same verdicts
    base = JudgeInput(record_id="x", prompt="How do I boil an egg?",
                      response="Put the egg in boiling water for nine minutes, then cool it in ice water.",
                      raw_text="")
    grounded = j.pmi(base, "Why nine minutes and not ten?")
    unrelated = j.pmi(base, "Write a poem about the ocean.")
    assert grounded > unrelated
    assert NULL_RESPONSE not in base.response and GENUINE in CANDIDATES


@requires_smollm2
def test_batched_turn_logprobs_equal_one_turn_at_a_time(smol):
    """Turns of one conversation scored as one right-padded batch == each alone (fp32: summation order only).

    Includes turns of different lengths (padding after the short ones must stay invisible), an empty turn
    and a repeated one."""
    from mechprobe.judges.hybrid import grounding_pmi, grounding_pmi_many, turn_logprobs

    tok, model = smol.tokenizer, smol.model
    conv = [{"role": "user", "content": "What is 12 times 7?"},
            {"role": "assistant", "content": "12 times 7 is 84, because 10*7=70 and 2*7=14."}]
    turns = ["Why did you split 12 into 10 and 2?", "Thanks!", "", "What about 13 times 7, and then 14 times 7?",
             "Thanks!"]
    alone = [turn_logprob(ChoiceScorer(model, tok, ["x"]), tok, conv, t, "real") for t in turns]
    store = ChoiceScorer(model, tok, ["x"])
    together = turn_logprobs(store, tok, conv, turns, "real", max_rows=3)  # two chunks
    assert [n for _, n in together] == [n for _, n in alone]
    for (a, _), (b, _) in zip(alone, together):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-3)
    inp = JudgeInput(record_id="r", prompt=conv[0]["content"], response=conv[1]["content"], raw_text="")
    many = grounding_pmi_many(ChoiceScorer(model, tok, ["x"]), tok, inp, turns[:2])
    one = [grounding_pmi(ChoiceScorer(model, tok, ["x"]), tok, inp, t) for t in turns[:2]]
    assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(many, one))


@requires_smollm2
def test_voice_margin_equals_full_forward_computation(smol):
    """voice = mean log p(turn | user header) - mean log p(turn | assistant header), both after the conversation;
    checked against one full forward per header (fp32: summation order only)."""
    from mechprobe.judges.hybrid import assistant_header, voice_scores

    tok, model = smol.tokenizer, smol.model
    conv = [{"role": "user", "content": "What is 12 times 7?"},
            {"role": "assistant", "content": "12 times 7 is 84, because 10*7=70 and 2*7=14."}]
    head = assistant_header(tok, conv)
    assert "assistant" in head and head != chat.user_header(tok)
    turns = ["Why did you split 12 into 10 and 2?", "Sure! 12 x 7 = 84. Let me explain each step."]
    inp = JudgeInput(record_id="r", prompt=conv[0]["content"], response=conv[1]["content"], raw_text="")
    got = voice_scores(ChoiceScorer(model, tok, ["x"]), tok, inp, turns)

    def mean_lp(pre_text: str, turn: str) -> float:
        ids, _ = chat.tokenize_rendered(tok, pre_text + turn)
        pre = chat.ids_up_to(tok, pre_text + turn, len(pre_text))
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return sum(float(logp[k - 1, ids[k]]) for k in range(len(pre), len(ids))) / (len(ids) - len(pre))

    base = chat.render(tok, conv)
    for g, turn in zip(got, turns):
        want = mean_lp(base + chat.user_header(tok), turn) - mean_lp(base + head, turn)
        assert math.isclose(g, want, rel_tol=1e-4, abs_tol=1e-4)


@requires_smollm2
def test_hybrid_voice_check_only_demotes_genuine_turns(smol):
    """With the voice check, a genuine verdict whose voice margin is below the minimum becomes
    assistant_continuation; nothing else changes. Extreme minimums make the effect certain either way."""
    rows = [r for r in read_jsonl(FIXTURE) if r["split"] == "dev"][:12]
    inputs = inputs_from_rows(rows)
    v1 = {r.record_id: r for r in HybridJudge(loaded=smol, cache_dir=False).label_many(inputs)}
    lax = HybridJudge(loaded=smol, cache_dir=False, voice=-1e6)
    strict = HybridJudge(loaded=smol, cache_dir=False, voice=1e6)
    assert "hybrid-v2+voice" in lax.name and "hybrid-v1" in HybridJudge(loaded=smol, cache_dir=False).name
    lax_l = {r.record_id: r for r in lax.label_many(inputs)}
    strict_l = {r.record_id: r for r in strict.label_many(inputs)}
    assert any(r.label == GENUINE for r in v1.values())  # the check has something to act on
    for rid, r in v1.items():
        assert lax_l[rid].label == r.label
        if r.label == GENUINE:
            assert strict_l[rid].label == "assistant_continuation" and "voice" in strict_l[rid].probs
        else:
            assert strict_l[rid].label == r.label
    with pytest.raises(ValueError, match="voice"):
        HybridJudge(loaded=smol, cache_dir=False, voice=float("nan"))


@requires_smollm2
def test_voice_reuses_the_grounding_pass_user_logprobs(smol):
    """voice_scores with the memo filled by grounding_pmi_many equals voice_scores computed alone (the user-slot
    log-probs are the same quantity; fp32, batches of other shapes: summation order only, 1e-4), and the memo
    spares exactly the user-slot turn forwards."""
    from mechprobe.judges.hybrid import grounding_pmi_many, voice_scores

    tok, model = smol.tokenizer, smol.model
    inp = JudgeInput(record_id="r", prompt="What is 12 times 7?", response="12 times 7 is 84: 10*7=70 and 2*7=14.",
                     raw_text="")
    turns = ["Why did you split 12 into 10 and 2?", "Sure! 12 x 7 = 84. Let me explain.", "And 13 times 7?"]
    alone_store = ChoiceScorer(model, tok, ["x"])
    alone = voice_scores(alone_store, tok, inp, turns[:2])
    memo: dict = {}
    store = ChoiceScorer(model, tok, ["x"])
    grounding_pmi_many(store, tok, inp, turns, memo)
    assert set(memo) == set(turns)
    before = store.stats["turn_tokens"]
    reused = voice_scores(store, tok, inp, turns[:2], memo)
    spent = store.stats["turn_tokens"] - before
    for a, b in zip(alone, reused, strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
    # only the assistant slot ran: fewer turn tokens than voice_scores spends alone on the same two turns (user +
    # assistant slots; the assistant header is longer than the user one, so not exactly half)
    assert 0 < spent < 0.75 * alone_store.stats["turn_tokens"]


@requires_smollm2
def test_prefix_pool_spares_the_prefill_of_a_conversation_judged_again(smol):
    """Steering conditions judge the same conversations once per call. With the pool, a second call over the
    same conversations (other turns, as another condition writes) runs only the few prefix tokens where the null
    and assistant slots differ from the pooled real conversation, and gives the verdicts a pool-less judge gives. Labels exact; P(genuine) to 1e-5 (the pooled tensors are the first prefill's, and
    the pool-less judge repeats the same single-row forward, so only a non-deterministic kernel could move it)."""
    rows = [r for r in read_jsonl(FIXTURE) if r["split"] == "dev"][:12]
    inputs = inputs_from_rows(rows)
    by_conv: dict[str, list[JudgeInput]] = {}
    for inp in inputs:
        by_conv.setdefault(inp.prompt + inp.response, []).append(inp)
    convs = [g for g in by_conv.values()]
    assert len(convs) >= 2
    first = [g[0] for g in convs]
    second = [g[-1] for g in convs]  # the same conversations again (another turn where the fixture has one)
    pooled = HybridJudge(loaded=smol, cache_dir=False)
    plain = HybridJudge(loaded=smol, cache_dir=False, pool_mb=0)

    def spend(j: HybridJudge, inputs: list[JudgeInput]) -> tuple[list[LabelRecord], int]:
        before = j.store.stats["prefix_tokens"]
        return list(j.label_many(inputs)), j.store.stats["prefix_tokens"] - before

    (a1, p1), (b1, q1) = spend(pooled, first), spend(plain, first)
    assert p1 == q1 > 0 and pooled.store.stats["pool_hits"] == 0
    (a2, p2), (b2, q2) = spend(pooled, second), spend(plain, second)
    assert p2 <= q2  # other turns may need slots the first call did not run (voice); never more
    (a3, p3), (b3, q3) = spend(pooled, first), spend(plain, first)
    # the same conversations again: the real conversations come from the pool; only the null and assistant slots
    # rebuild from them (their few differing tokens: 26 of 417 here)
    assert q3 == q1 and p3 < 0.2 * q3
    assert pooled.store.stats["pool_hits"] > 0 and len(pooled.store._pool) <= len(convs)  # real slots only
    for x, y in zip(a1 + a2 + a3, b1 + b2 + b3, strict=True):
        assert x.label == y.label and x.record_id == y.record_id
        assert math.isclose(x.probs[GENUINE], y.probs[GENUINE], abs_tol=1e-5)


@requires_smollm2
def test_prefix_pool_stays_within_its_bytes_least_recently_used_first(smol):
    tok = smol.tokenizer
    ids = [list(tok(f"Conversation number {i} about eggs and boiling water.")["input_ids"]) for i in range(3)]
    probe = ChoiceScorer(smol.model, tok, ["x"])
    probe.remember("s", ids[0])
    one = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in probe._kept["s"][1])
    store = ChoiceScorer(smol.model, tok, ["x"], pool_bytes=int(2.5 * one))  # room for two of these
    for x in ids:
        store.remember("s", x)
        store.forget("s", pool=True)
    assert store._pool_used <= store.pool_bytes and len(store._pool) == 2
    assert tuple(ids[0]) not in store._pool  # the oldest went first
    before = store.stats["prefix_tokens"]
    store.remember("s", ids[2])
    assert store.stats["prefix_tokens"] == before and store.stats["pool_hits"] == 1
    store.forget("s")  # not pooled: dropped
    store.remember("s", ids[0])
    assert store.stats["prefix_tokens"] > before  # evicted, so run again


@pytest.mark.parametrize("native,want", [(True, torch.bfloat16), (False, torch.float32)])
def test_judge_model_dtype_follows_native_bf16(monkeypatch, native, want):
    """A CPU without AVX512-BF16/AMX emulates bf16 ~100x slower than fp32 (docs/gotchas.md): judges load fp32 there."""
    from mechprobe.judges import base

    got = {}
    monkeypatch.setattr(base, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(base, "load_model", lambda model, device, dtype: got.setdefault("dtype", dtype))
    base.load_judge_model("smollm2-135m-instruct", device="cpu")
    assert got["dtype"] == want
    got.clear()
    base.load_judge_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16")  # an explicit dtype wins
    assert got["dtype"] == "bfloat16"


@requires_smollm2
def test_a_judge_of_the_run_model_shares_its_weights(smol, monkeypatch):
    """One copy of the weights per dtype: a hybrid judge of the loaded model gets that object, not a second load;
    another model, another dtype or a rules judge get nothing to share."""
    from mechprobe.judges import factory

    monkeypatch.setattr(factory, "judge_dtype", lambda device: torch.float32)  # smol is fp32
    assert factory.shared_judge_model("hybrid-voice:smollm2-135m-instruct", smol) is smol
    assert factory.shared_judge_model("trained:smollm2-135m-instruct", smol) is smol
    assert factory.shared_judge_model("hybrid-voice:qwen2.5-coder-1.5b-instruct", smol) is None
    assert factory.shared_judge_model("offline", smol) is None
    assert factory.shared_judge_model("auto", smol) is None
    monkeypatch.setattr(factory, "judge_dtype", lambda device: torch.bfloat16)
    assert factory.shared_judge_model("hybrid-voice:smollm2-135m-instruct", smol) is None
    monkeypatch.setattr(factory, "judge_dtype", lambda device: torch.float32)
    j = make_judge("hybrid2:smollm2-135m-instruct", loaded=factory.shared_judge_model("hybrid2:smollm2-135m-instruct",
                                                                                      smol), cache_dir=False)
    assert j.lm is smol and j.store.model is smol.model
    # the older spec kind builds the same judge (same recorded name, so the same caches and reports)
    assert j.name == make_judge("hybrid-voice:smollm2-135m-instruct", loaded=smol, cache_dir=False).name
    assert "+voice" in j.name


@requires_smollm2
def test_after_a_llamacpp_probe_the_judge_and_cache_share_one_load(smol, monkeypatch, tmp_path):
    """A llama.cpp probe stage holds no HF model; the judge stage of the run's own model then loads the stage model
    once and lends it to the judge, so the cache stage after it finds it loaded (one copy, not two). With the cache
    already built nothing is loaded for the judge's sake; another judge model never triggers the load."""
    from mechprobe import stages as stages_mod
    from mechprobe.judges import factory

    monkeypatch.setattr(factory, "judge_dtype", lambda device: torch.float32)  # smol is fp32
    loads, lent = [], []
    monkeypatch.setattr(stages_mod, "load_model", lambda *a, **k: loads.append(a) or smol)
    monkeypatch.setattr(stages_mod, "judge_run", lambda run, judge, **opts: lent.append(
        opts.get("loaded") if isinstance(judge, str) else judge.lm))
    monkeypatch.setattr(stages_mod, "pool_bytes_for", lambda run, model: 0)  # no user_turns.jsonl in tmp_path
    cfg = ProbeConfig(model="smollm2-135m-instruct", engine="llamacpp")
    st = stages_mod.Stages(tmp_path, cfg)
    st.labels("hybrid-voice:smollm2-135m-instruct")
    assert lent == [smol] and len(loads) == 1 and st.model() is smol and len(loads) == 1

    other = stages_mod.Stages(tmp_path, cfg)
    other.labels("hybrid-voice:qwen2.5-coder-1.5b-instruct")
    other.labels("offline")
    assert lent[1:] == [None, None] and len(loads) == 1 and other.lm is None

    monkeypatch.setattr(stages_mod, "cache_complete", lambda run: True)
    done = stages_mod.Stages(tmp_path, cfg)
    done.labels("hybrid-voice:smollm2-135m-instruct")
    assert lent[3] is None and len(loads) == 1


@requires_smollm2
def test_the_cache_stage_reads_the_judges_kept_conversations(smol, monkeypatch, tmp_path):
    """probe -> hybrid-voice judge of the run's own model -> cache, as ``ensure_stages`` runs them: the cache stage takes
    each conversation the judge prefilled from the judge's KV pool (one token per prompt instead of the whole
    prompt) and writes the same vectors as a cache built from nothing (float16 storage: one ulp, 1e-3)."""
    import shutil

    from mechprobe import stages as stages_mod
    from mechprobe.activations.cache import ActivationCache, cache_run
    from mechprobe.judges import factory

    monkeypatch.setattr(factory, "judge_dtype", lambda device: torch.float32)  # smol is fp32
    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path / "mc"))  # an empty judge cache: the judge runs its model
    monkeypatch.setattr(stages_mod, "load_model", lambda *a, **k: smol)
    cfg = ProbeConfig(model="smollm2-135m-instruct", dataset="builtin", limit=4, samples=2,
                      temperatures=[0.0, 1.0], max_assistant_tokens=24, max_user_tokens=12, batch_size=8)
    run = tmp_path / "run"
    st = stages_mod.Stages(run, cfg)
    stages_mod.ensure_stages(run, cfg, "hybrid-voice:smollm2-135m-instruct", stages=st)
    man = json.loads((run / "activations" / "manifest.json").read_text())
    hybrid_runs = json.loads((run / "labels_manifest.json").read_text())
    assert man["timing"]["prefix_hits"] >= 1, (man["timing"], hybrid_runs["timing"])
    assert st.prefixes is None  # the pool is dropped after the cache stage

    ref = tmp_path / "ref"
    shutil.copytree(run, ref, ignore=shutil.ignore_patterns("activations"))
    cache_run(ref, smol, progress=False)
    assert "prefix_hits" not in json.loads((ref / "activations" / "manifest.json").read_text())["timing"]
    torch.testing.assert_close(ActivationCache.load(run).stack(), ActivationCache.load(ref).stack(),
                               rtol=1e-3, atol=1e-3)


def test_hybrid2_is_an_alias_of_hybrid_voice():
    """``hybrid2:MODEL`` is accepted wherever ``hybrid-voice:MODEL`` is: parsing, the model it loads, the hybrid
    options, the agreement command's judge-or-file choice; resuming a run names the voice judge ``hybrid-voice:``."""
    from mechprobe.judges import factory
    from mechprobe.judges.agreement import is_judge_spec

    m = "smollm2-135m-instruct"
    assert factory.canonical_spec(f"hybrid2:{m}") == f"hybrid-voice:{m}"
    assert factory.canonical_spec(f"hybrid:{m}") == f"hybrid:{m}"
    for kind in ("hybrid2", "hybrid-voice", "hybrid"):
        assert factory.check_judge_spec(f"{kind}:{m}") == f"{kind}:{m}"
        assert factory.judges_model(f"{kind}:{m}") == m
        assert factory.is_hybrid_spec(f"{kind}:{m}") and is_judge_spec(f"{kind}:{m}")
    assert not factory.is_hybrid_spec(f"local:{m}") and not factory.is_hybrid_spec("hybrid2")
    assert factory.spec_of_judge_name(f"hybrid:{m}@hybrid-v2+voice0.1+offline-v3+minilm") == f"hybrid-voice:{m}"
    with pytest.raises(UsageError, match="hybrid-voice:MODEL"):
        factory.check_judge_spec(f"hybrid3:{m}")
