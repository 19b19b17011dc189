"""The llama.cpp engine's guarantees on the real embedded model (skipped when llama-cpp-python is missing).

What is checked against the HF engine: the run identity and stop ids are the same; prompts are fed as the
HF tokenizer's ids; generation stops at the template's end-of-turn with the stop token kept raw; sampled rows
are reproducible from their seed alone; greedy agrees with HF greedy on the first tokens (not bit-exact:
llama.cpp multiplies Q4 weights with 8-bit-quantised activations, HF the dequantised weights in fp32).
"""

from __future__ import annotations

import sys

import pytest
import torch

from mechprobe.errors import UserError
from mechprobe.lm import chat
from mechprobe.lm.generation import generate

CONVS = [("What is 7*8?", "7*8 = 56."), ("Name a fruit.", "An apple."),
         ("Hi", "Hello! How can I help you today?"),
         ("Give me a tip for sleeping better.", "Keep a regular schedule and avoid screens before bed.")]


def test_hf_ids_and_dirs_are_refused_with_the_fix():
    from mechprobe.lm.llamacpp import resolve_gguf

    with pytest.raises(UserError, match="engine=hf"):
        resolve_gguf("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(UserError, match="does not exist"):
        resolve_gguf("/nonexistent/model.gguf")


def test_missing_llama_cpp_names_the_install_command(monkeypatch):
    from mechprobe.lm.llamacpp import load_llamacpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(UserError, match="pip install llama-cpp-python"):
        load_llamacpp("model.gguf")


@pytest.fixture(scope="module")
def lc(smol):
    pytest.importorskip("llama_cpp")
    from mechprobe.lm.llamacpp import LlamaCppBroken, load_engine

    try:
        return load_engine("smollm2-135m-instruct")
    except LlamaCppBroken as e:  # a build that segfaults here would take the whole test session down
        pytest.skip(str(e))


def test_a_crashing_build_is_a_clear_error_not_a_segfault(tmp_path, monkeypatch):
    """The smoke check runs llama.cpp in a child: a child that dies becomes LlamaCppBroken naming the rebuild."""
    pytest.importorskip("llama_cpp")
    from mechprobe.lm import llamacpp as lb

    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path))
    monkeypatch.setattr(lb, "_SMOKE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(lb.LlamaCppBroken, match="GGML_AMX_INT8=OFF"):
        lb.smoke_check(tmp_path / "m.gguf")
    monkeypatch.setattr(lb, "_SMOKE", "print('ok')")
    lb.smoke_check(tmp_path / "m.gguf")  # a healthy build passes, and the verdict is remembered
    assert list((tmp_path / "llamacpp_ok").iterdir())


@pytest.fixture(scope="module")
def probe_prompts(smol):
    return [chat.build_probe_prompt(smol.tokenizer, q, a).input_ids for q, a in CONVS]


@pytest.mark.slow
def test_identity_and_stop_ids_equal_the_hf_path(smol, lc):
    lm, _ = lc
    assert lm.identity() == smol.identity()  # so `mechprobe cache` accepts a llamacpp run with the HF model
    assert chat.stop_token_ids(lm.tokenizer, lm.model) == chat.stop_token_ids(smol.tokenizer, smol.model)
    assert chat.assistant_stop_token_ids(lm.tokenizer, lm.model) == \
        chat.assistant_stop_token_ids(smol.tokenizer, smol.model)


@pytest.mark.slow
def test_prompts_are_fed_as_token_ids(smol, lc, probe_prompts):
    lm, eng = lc
    stops = chat.stop_token_ids(smol.tokenizer, smol.model)
    for p in probe_prompts[:2]:
        eng.decode_batch([p], stop_ids=stops, max_new_tokens=4, temperatures=0.0, pad_id=0)
        # The ids llama.cpp decoded for the row are exactly the HF tokenizer's (BOS and specials included).
        assert eng.fed == [p]


@pytest.mark.slow
def test_stops_at_end_of_turn_and_keeps_special_tokens_raw(smol, lc, probe_prompts):
    lm, eng = lc
    tok = smol.tokenizer
    stops = chat.stop_token_ids(tok, smol.model)
    eot = [i for i, r in stops.items() if r == "end_of_turn"]
    gens = eng.decode_batch(probe_prompts, stop_ids=stops, max_new_tokens=64,
                            temperatures=[1.0] * len(probe_prompts), seeds=[1, 2, 3, 4], pad_id=0)
    ended = [g for g in gens if g.stop_reason == "end_of_turn"]
    assert ended, [g.stop_reason for g in gens]
    for g in gens:
        assert not any(t in stops for t in g.token_ids[:-1])  # stopped at the first stop id
        if g.stop_reason == "end_of_turn":
            assert g.token_ids[-1] in eot
            assert tok.decode(g.token_ids, skip_special_tokens=False).endswith(tok.decode([g.token_ids[-1]]))
            assert tok.decode([g.token_ids[-1]]) == "<|im_end|>"
        else:
            assert len(g.token_ids) == 64


@pytest.mark.slow
def test_sampled_rows_are_reproducible_from_their_seed_alone(smol, lc, probe_prompts):
    _, eng = lc
    stops = chat.stop_token_ids(smol.tokenizer, smol.model)
    kw = dict(stop_ids=stops, max_new_tokens=24, pad_id=0)
    rows = [probe_prompts[0], probe_prompts[1], probe_prompts[0]]
    a = eng.decode_batch(rows, temperatures=[1.0, 1.0, 1.0], seeds=[7, 8, 9], **kw)
    # Same row, alone and after other work (another KV state): same tokens.
    eng.decode_batch([probe_prompts[3]], temperatures=0.0, **kw)
    b = eng.decode_batch([probe_prompts[0]], temperatures=1.0, seeds=[9], **kw)[0]
    assert b.token_ids == a[2].token_ids
    c = eng.decode_batch([probe_prompts[0]], temperatures=1.0, seeds=[7], **kw)[0]
    assert c.token_ids == a[0].token_ids
    assert a[0].token_ids != a[2].token_ids  # the seed matters (same prompt, different seeds)
    with pytest.raises(ValueError, match="seed"):
        eng.decode_batch([probe_prompts[0]], temperatures=1.0, **kw)


@pytest.mark.slow
def test_greedy_agrees_with_hf_greedy_on_the_first_tokens(smol, lc, probe_prompts):
    """Not bit-exact (Q4 x Q8 dot products vs fp32): the first N greedy tokens agree except at HF near-ties.

    Measured: where this test was written the common prefix was 12..32 tokens (of 32) on these 8 prompts; on a 2-core AMD
    EPYC (AVX2, other ggml kernels) two assistant prompts flipped at tokens 1 and 5, where HF's top two logits
    were 0.03 and 0.12 apart. So a token may differ only where HF's own top-two margin is under 0.25 (about the
    logit error of 8-bit activations here); a prompt fed wrong or an id mismatch differs at a clear argmax.
    """
    _, eng = lc
    tok = smol.tokenizer
    stops = chat.stop_token_ids(tok, smol.model)
    prompts = probe_prompts + [chat.build_assistant_prompt(tok, q) for q, _ in CONVS]
    n = 8
    ours = eng.decode_batch(prompts, stop_ids=stops, max_new_tokens=n, temperatures=0.0, pad_id=0)
    hf = generate(smol.model, prompts, stop_ids=stops, max_new_tokens=n, pad_id=tok.pad_token_id)
    same = 0
    for p, a, b in zip(prompts, ours, hf):
        a, b = a.token_ids, b.token_ids
        if a == b:
            same += 1
            continue
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        assert k < min(len(a), len(b)), (a, b)  # one stopped early without a differing token: not a near-tie
        with torch.inference_mode():
            top = torch.topk(smol.model(torch.tensor([list(p) + b[:k]])).logits[0, -1].float(), 2).values
        assert float(top[0] - top[1]) < 0.25, (k, a, b, float(top[0] - top[1]))
    assert same >= len(prompts) // 2


@pytest.mark.slow
def test_llamacpp_run_is_cached_by_the_hf_path(smol, lc, tmp_path):
    from mechprobe.activations.cache import ActivationCache, cache_run
    from mechprobe.io import read_jsonl
    from mechprobe.turns.pipeline import ProbeConfig, run_probe

    cfg = ProbeConfig(model="smollm2-135m-instruct", dataset="builtin", limit=2, temperatures=[0.0, 1.0], samples=2,
                      max_assistant_tokens=24, max_user_tokens=12, engine="llamacpp")
    run_probe(cfg, tmp_path, progress=False)
    recs = list(read_jsonl(tmp_path / "user_turns.jsonl"))
    assert len(recs) == 2 * 3
    by_item: dict[str, list[dict]] = {}
    for r in recs:
        by_item.setdefault(r["item_id"], []).append(r)
    asst = {r["item_id"]: r for r in read_jsonl(tmp_path / "assistant.jsonl")}
    for item, rs in by_item.items():
        a = asst[item]
        want = chat.build_probe_prompt(smol.tokenizer, a["prompt"], a["response"]).input_ids
        assert all(r["prompt_ids"] == want for r in rs)  # the HF tokenizer's ids, one prompt per item
    out = cache_run(tmp_path, smol, progress=False, layers=[0, 5])  # identity check passes with the HF model
    assert len(ActivationCache.load(out)) == len(recs)


@pytest.mark.slow
def test_rows_decoded_together_equal_rows_decoded_alone(smol, lc, probe_prompts):
    """Batched == unbatched under greedy, and a sampled row depends on its seed, not on its batch.

    Not bit-exact by construction (ggml may use another matmul kernel for a multi-row batch), so a greedy
    flip is allowed only where the row alone had its top two logits within 0.05 (a near-tie); none seen.
    """
    _, eng = lc
    stops = chat.stop_token_ids(smol.tokenizer, smol.model)
    kw = dict(stop_ids=stops, max_new_tokens=24, pad_id=0)
    # Identical prompts in one batch share their prefill (the greedy row and the samples of one item).
    rows = [probe_prompts[0]] * 3 + [probe_prompts[1], probe_prompts[2], probe_prompts[2], probe_prompts[3]]
    temps = [0.0, 1.0, 1.0, 0.0, 0.0, 1.3, 0.0]
    seeds = [None, 11, 12, None, None, 13, None]
    together = eng.decode_batch(rows, temperatures=temps, seeds=seeds, **kw)
    eng.record_margins = True
    try:
        for i, (p, t, s) in enumerate(zip(rows, temps, seeds)):
            alone = eng.decode_batch([p], temperatures=[t], seeds=[s], **kw)[0]
            a, b = alone.token_ids, together[i].token_ids
            if a != b:
                k = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
                assert t == 0.0 and eng.margins[0][k] < 0.05, (i, k, eng.margins[0][k])
            else:
                assert alone.stop_reason == together[i].stop_reason
    finally:
        eng.record_margins = False
    assert together[1].token_ids != together[2].token_ids  # same prompt, different seeds


@pytest.mark.slow
def test_groups_split_by_rows(smol, lc, probe_prompts):
    """More rows than max_rows run in several groups with the same tokens; a row longer than n_ctx is refused."""
    from mechprobe.lm.llamacpp import LlamaCppEngine

    _, eng = lc
    stops = chat.stop_token_ids(smol.tokenizer, smol.model)
    kw = dict(stop_ids=stops, max_new_tokens=12, pad_id=0, temperatures=0.0)
    full = eng.decode_batch(probe_prompts, **kw)
    small = LlamaCppEngine(eng.llm, max_rows=2)
    try:
        assert [g.token_ids for g in small.decode_batch(probe_prompts, **kw)] == [g.token_ids for g in full]
        # An item's rows straddling groups (or max_rows=1) reuse the prompt's cells: one prefill per prompt.
        one = LlamaCppEngine(eng.llm, max_rows=1)
        rows = [probe_prompts[0]] * 3 + [probe_prompts[1]] * 2
        got = one.decode_batch(rows, **kw)
        assert one.multi().n_prefills == 2
        assert [g.token_ids for g in got] == [full[0].token_ids] * 3 + [full[1].token_ids] * 2
        one.close()
    finally:
        small.close()
    with pytest.raises(UserError, match="context"):
        LlamaCppEngine(eng.llm, max_rows=2, n_ctx=8).decode_batch(probe_prompts[:1], **kw)


@pytest.mark.slow
def test_steering_with_a_zero_vector_is_no_steering_token_for_token(smol, lc, probe_prompts):
    """repeng's invariant on the llama.cpp control-vector path, for every positions mode.

    A zero vector takes the unsteered path (exact by construction). It did not hold through the steered path on a
    2-core AMD EPYC: decoding the last prompt token apart (boundary modes) changed a sampled row there."""
    import numpy as np

    _, eng = lc
    stops = chat.stop_token_ids(smol.tokenizer, smol.model)
    kw = dict(stop_ids=stops, max_new_tokens=16, pad_id=0, temperatures=[0.0, 1.0, 0.0, 1.0], seeds=[None, 5, None, 6])
    base = [g.token_ids for g in eng.decode_batch(probe_prompts, **kw)]
    zero = np.zeros(smol.model.config.hidden_size, dtype=np.float32)
    for pos in ("all", "generated", "boundary+generated", "boundary"):
        assert [g.token_ids for g in eng.decode_batch(probe_prompts, steer=(zero, 10, pos), **kw)] == base, pos
    # ... and an unsteered call after a steered one is unsteered again (the vector and its KV cells are gone).
    eng.decode_batch(probe_prompts, steer=(zero + 50.0, 10, "all"), **kw)
    assert [g.token_ids for g in eng.decode_batch(probe_prompts, **kw)] == base
    with pytest.raises(UserError, match="residual indices 2"):
        eng.decode_batch(probe_prompts[:1], steer=(zero, 1, "all"), **kw | {"temperatures": 0.0, "seeds": None})


@pytest.mark.slow
def test_steering_adds_the_vector_where_the_hf_hook_does(smol, lc, probe_prompts):
    """Steered llama.cpp logits match HF's steered logits at the *same* residual index, not at index +-1.

    Not bit-exact (Q4 weights x 8-bit activations vs fp32): measured correlation 0.9991-0.9996 at the same
    index vs 0.87-0.99 one index off (135M, |v| = half the residual norm); the test asks > 0.995 and better
    than both neighbours, which an off-by-one layer mapping fails.
    """
    import numpy as np
    import torch

    from mechprobe.steering.vector import SteeringVector, steer

    _, eng = lc
    p = probe_prompts[0]
    g = torch.Generator().manual_seed(1)
    v = torch.randn(smol.model.config.hidden_size, generator=g)
    v = v / v.norm()
    with torch.no_grad():
        hs = smol.model(torch.tensor([p]), output_hidden_states=True).hidden_states
    ms = eng.multi(len(p) + 4)
    for layer in (5, 15):
        vec = v * 0.5 * float(hs[layer][0, -1].norm())
        ms.clear()
        ms.set_cvec(vec.numpy(), layer)
        ours = ms.prefill(p, 0)
        ms.set_cvec(None)
        ms.clear()
        corr = {}
        for hl in (layer - 1, layer, layer + 1):
            with steer(smol.model, SteeringVector(vector=vec, layer=hl, kind="random"), 1.0, "all", unit="raw"), torch.no_grad():
                theirs = smol.model(torch.tensor([p])).logits[0, -1].float().numpy()
            corr[hl] = float(np.corrcoef(ours, theirs)[0, 1])
        assert corr[layer] > 0.995 and corr[layer] > max(corr[layer - 1], corr[layer + 1]), corr


@pytest.mark.slow
def test_prefix_cache_gives_the_logits_of_a_fresh_prefill(smol, lc, probe_prompts):
    """A prompt restored from the cache == a fresh prefill, bit for bit; tokens equal with the cache off.

    Only whole prompts are reused: a saved *prefix* + the rest decoded is not exact (another kernel for
    the remainder; one greedy token changed in the zero-vector steering test when that was tried), so a
    prefix of a saved prompt, or an extension of one, is prefilled fresh. Steered calls prefill the
    unsteered body of each prompt through the cache and must give the same tokens as with it off.
    """
    import numpy as np

    from mechprobe.lm.llamacpp import LlamaCppEngine

    _, eng = lc
    p = list(probe_prompts[3])
    fresh = LlamaCppEngine(eng.llm, max_rows=4, cache_mb=None)
    cached = LlamaCppEngine(eng.llm, max_rows=4)
    try:
        want = fresh.multi(len(p) + 8).prefill(p, 0)
        ms = cached.multi(len(p) + 8)
        assert np.array_equal(ms.prefill(p, 1), want) and cached.cache.misses == 1
        assert np.array_equal(ms.prefill(p, 2), want) and cached.cache.hits == 1  # restored, not decoded
        ms.prefill(p[:-3], 3)  # a prefix of a saved prompt is not served from it
        assert cached.cache.hits == 1 and cached.cache.misses == 2
        stops = chat.stop_token_ids(smol.tokenizer, smol.model)
        kw = dict(stop_ids=stops, max_new_tokens=16, pad_id=0, temperatures=[0.0, 1.0, 0.0, 1.0],
                  seeds=[None, 5, None, 6])
        for _ in range(2):  # the second round restores every prompt
            assert ([g.token_ids for g in cached.decode_batch(probe_prompts, **kw)]
                    == [g.token_ids for g in fresh.decode_batch(probe_prompts, **kw)])
        vec = np.random.default_rng(0).standard_normal(smol.model.config.hidden_size).astype(np.float32)
        for pos in ("boundary+generated", "boundary+generated", "all"):
            a = [g.token_ids for g in cached.decode_batch(probe_prompts, steer=(vec, 10, pos), **kw)]
            b = [g.token_ids for g in fresh.decode_batch(probe_prompts, steer=(vec, 10, pos), **kw)]
            assert a == b, pos
        assert cached.cache.hits >= 1 + len(probe_prompts)  # the second steered round restored every body
    finally:
        fresh.close()
        cached.close()


def test_prefix_cache_serves_exact_prompts_and_evicts_least_recently_used():
    """Pure bookkeeping (no llama.cpp): exact keys only, short keys ignored, the byte budget holds (LRU)."""
    import numpy as np

    from mechprobe.lm.llamacpp import PrefixCache

    c = PrefixCache(max_bytes=250, min_tokens=2)
    lg = np.zeros(3, dtype=np.float32)
    c.put((1, 2), b"x" * 100, lg)
    c.put((1, 2, 3, 4), b"y" * 100, lg)
    c.put((9,), b"z" * 10, lg)  # shorter than min_tokens: not kept
    assert c.get([1, 2, 3, 4])[0] == b"y" * 100 and c.get((1, 2, 3)) is None and c.get([9]) is None
    assert c.get([1, 2]) is not None  # now (1, 2) is the most recently used
    c.put((5, 6), b"w" * 100, lg)  # over budget: (1, 2, 3, 4) goes
    assert c.nbytes <= 250 and (1, 2, 3, 4) not in c.entries and (1, 2) in c.entries and (5, 6) in c.entries


@pytest.mark.slow
def test_a_state_llama_cpp_refuses_is_prefilled_again(smol, lc, probe_prompts):
    """States only restore into a context of the same shape: another shape clears the cache, and a refused
    restore falls back to a fresh prefill with the same logits (it once raised mid-benchmark)."""
    import numpy as np

    from mechprobe.lm.llamacpp import LlamaCppEngine

    _, eng = lc
    p = list(probe_prompts[0])
    two, four = LlamaCppEngine(eng.llm, max_rows=2), LlamaCppEngine(eng.llm, max_rows=4, cache_mb=None)
    try:
        want = four.multi().prefill(p, 0)
        two.multi().prefill(p, 0)
        four.cache = two.cache  # a cache holding states of a 2-row context, forced into a 4-row one
        four.cache.context = (4, four.multi().row_ctx)
        four.multi().cache = four.cache
        four.multi().clear()
        got = four.multi().prefill(p, 1)
        assert four.cache.hits == 0 and four.cache.misses >= 1 and np.array_equal(got, want)
        two.max_rows = 3
        two.close()
        two.multi()  # rebuilt with another shape: the saved states are dropped
        assert not two.cache.entries and two.cache.context == (3, two.multi().row_ctx)
    finally:
        two.close()
        four.close()
