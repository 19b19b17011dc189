"""Reused KV prefixes (``generate(prefix_store=..., keep_kv=...)``, :class:`PrefixStore`): same tokens and the
same boundary state as a whole-prompt prefill, and refused where an intervention or new weights would make
the stored prefix wrong."""

from __future__ import annotations

import pytest
import torch

from mechprobe import LoadedModel, SteeringVector, steer, tiny_model
from mechprobe.errors import UsageError
from mechprobe.lm import chat
from mechprobe.lm.generation import generate
from mechprobe.lm.kv import call_kind
from mechprobe.lm.prefix import PrefixStore


def _lm(arch: str = "llama") -> LoadedModel:
    return LoadedModel(model=tiny_model(arch), tokenizer=None, name=f"tiny-{arch}", weight_hash="0" * 64,
                       device=torch.device("cpu"), dtype=torch.float32)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


def _rows(prompts: list[list[int]], k: int) -> tuple[list[list[int]], list[float], list[int | None]]:
    """Per prompt one greedy row and k sampled rows, as the probe and the study's arms decode them."""
    rows, temps, seeds = [], [], []
    for i, p in enumerate(prompts):
        for j in range(k + 1):
            rows.append(p)
            temps.append(0.0 if j == 0 else 1.0)
            seeds.append(None if j == 0 else 100 * i + j)
    return rows, temps, seeds


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stored_prefixes_give_the_tokens_of_a_whole_prefill(arch):
    """Mixed prefix lengths in one left-padded batch (built, partly built, not built), greedy and sampled rows."""
    lm = _lm(arch)
    prompts = _prompts(1, (5, 40, 12, 70, 33))
    rows, temps, seeds = _rows(prompts, k=2)
    kw = dict(stop_ids={}, max_new_tokens=10, temperatures=temps, seeds=seeds, pad_id=0)
    plain = generate(lm.model, rows, **kw)
    store = PrefixStore(lm, progress=False)
    assert store.build([prompts[1], prompts[3][:50]]) == 2  # one whole prefix, one shorter than the prompt
    # covered(): what the batch sizer reads, the stored length without loading the tensors
    assert store.covered(prompts[1], len(prompts[1]) - 1) == len(prompts[1]) - 1
    assert store.covered(prompts[3], len(prompts[3]) - 1) == 49 and store.covered(prompts[0], 4) == 0
    cold = generate(lm.model, rows, prefix_store=store, **kw)
    warm = generate(lm.model, rows, prefix_store=store, **kw)  # every long prompt is stored by now
    assert [g.token_ids for g in cold] == [g.token_ids for g in plain] == [g.token_ids for g in warm]
    for r, p in zip(rows[::3], prompts):  # batched with the store == each prompt alone with the store
        alone = generate(lm.model, [r], stop_ids={}, max_new_tokens=10, pad_id=0, prefix_store=store)[0]
        assert alone.token_ids == plain[rows.index(p)].token_ids


def _boundary_capture(model, layers: list[int]) -> tuple[list, list[torch.Tensor]]:
    """Forward hooks that keep each block's output at the last position of the first call that ends at the boundary
    (a whole prefill, or a continuation on a stored prefix), as activation capture reads it."""
    seen: list[torch.Tensor] = []
    first: dict[int, bool] = {}

    def hook(i):
        def f(_m, _inp, out):
            h = out if isinstance(out, torch.Tensor) else out[0]
            if i not in first and call_kind() != "prefix":
                first[i] = True
                seen.append(h[:, -1].detach().clone())
        return f
    blocks = model.model.layers
    return [blocks[i].register_forward_hook(hook(i)) for i in layers], seen


def test_boundary_activations_and_steering_see_the_same_state_with_a_store():
    lm = _lm("llama")
    prompts = _prompts(2, (36, 50, 41))
    vec = SteeringVector(torch.randn(64, generator=torch.Generator().manual_seed(0)), layer=2)
    store = PrefixStore(lm, progress=False)
    for positions in ("boundary", "boundary+generated"):
        out = {}
        for use in (False, True):
            handles, seen = _boundary_capture(lm.model, [0, 1, 2])
            try:
                with steer(lm.model, vec, alpha=3.0, positions=positions, unit="raw"):
                    gens = generate(lm.model, prompts, stop_ids={}, max_new_tokens=8, pad_id=0,
                                    prefix_store=store if use else None)
            finally:
                for h in handles:
                    h.remove()
            out[use] = ([g.token_ids for g in gens], seen)
        assert out[True][0] == out[False][0]
        for a, b in zip(out[True][1], out[False][1]):  # blocks 0-2 at the boundary; block 1's output is steered
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plain = generate(lm.model, prompts, stop_ids={}, max_new_tokens=8, pad_id=0)
    assert [g.token_ids for g in plain] != out[True][0]  # the steering did act through the store


def test_an_intervention_before_the_boundary_refuses_the_store():
    lm = _lm("llama")
    prompts = _prompts(3, (40, 45))
    store = PrefixStore(lm, progress=False)
    store.build(prompts)
    vec = SteeringVector(torch.ones(64), layer=1)
    with steer(lm.model, vec, alpha=2.0, positions="all", unit="raw"):
        with pytest.raises(UsageError, match="before the user-role boundary"):
            generate(lm.model, prompts, stop_ids={}, max_new_tokens=4, pad_id=0, prefix_store=store)
        generate(lm.model, prompts, stop_ids={}, max_new_tokens=4, pad_id=0)  # without the store: fine
    with steer(lm.model, vec, alpha=0.0, positions="all", unit="raw"):  # alpha 0 changes nothing: allowed
        generate(lm.model, prompts, stop_ids={}, max_new_tokens=4, pad_id=0, prefix_store=store)
    with steer(lm.model, vec, alpha=2.0, positions="boundary", unit="raw"):
        with pytest.raises(UsageError, match="keep_kv"):  # generated positions would carry the steering
            generate(lm.model, prompts, stop_ids={}, max_new_tokens=4, pad_id=0, keep_kv=store)
    generate(lm.model, prompts, stop_ids={}, max_new_tokens=4, pad_id=0, prefix_store=store)  # hooks gone


def test_changed_weights_or_another_model_refuse_the_store():
    lm = _lm("llama")
    prompts = _prompts(4, (40,))
    store = PrefixStore(lm, progress=False)
    store.build(prompts)
    with pytest.raises(UsageError, match="another model"):
        generate(tiny_model("llama"), prompts, stop_ids={}, max_new_tokens=2, pad_id=0, prefix_store=store)
    with torch.no_grad():
        lm.model.model.layers[0].mlp.down_proj.weight.mul_(1.01)  # an in-place edit, as training or bake make
    with pytest.raises(UsageError, match="weights changed"):
        generate(lm.model, prompts, stop_ids={}, max_new_tokens=2, pad_id=0, prefix_store=store)


def test_sliding_window_models_are_refused_with_a_reason():
    lm = _lm("gemma3")
    with pytest.raises(UsageError, match="sliding-window"):
        generate(lm.model, [[1, 2, 3]], stop_ids={}, max_new_tokens=2, pad_id=0,
                 prefix_store=PrefixStore(lm, progress=False))


def test_memory_limit_spills_to_disk_and_a_later_store_reuses_the_files(tmp_path):
    lm = _lm("llama")
    prompts = _prompts(5, (40, 60, 80, 50))
    plain = generate(lm.model, prompts, stop_ids={}, max_new_tokens=6, pad_id=0)
    store = PrefixStore(lm, max_bytes=60_000, disk_dir=tmp_path, progress=False)
    assert store.build(prompts) == 4
    assert store.nbytes <= 60_000 and len(list(tmp_path.rglob("*.safetensors"))) >= 2
    again = generate(lm.model, prompts, stop_ids={}, max_new_tokens=6, pad_id=0, prefix_store=store)
    assert [g.token_ids for g in again] == [g.token_ids for g in plain]
    later = PrefixStore(lm, max_bytes=0, disk_dir=tmp_path, progress=False)  # e.g. the next arm's process
    assert len(later) == len(list(tmp_path.rglob("*.safetensors")))
    calls: list[int] = []
    h = lm.model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    try:
        reused = generate(lm.model, prompts, stop_ids={}, max_new_tokens=6, pad_id=0, prefix_store=later)
    finally:
        h.remove()
    assert [g.token_ids for g in reused] == [g.token_ids for g in plain]
    assert set(calls) == {1}  # no prefix computed again: only the boundary token, then decode steps
    torch.testing.assert_close(store.lookup(prompts[2], 79)[1][0][0], later.lookup(prompts[2], 79)[1][0][0])


def test_keep_kv_continues_the_next_turn_from_the_answer():
    """The user turn continues from the answer's KV cache: only the longest common token prefix is reused, even
    when the rendered conversation tokenises the answer otherwise (a differing token mid-answer)."""
    lm = _lm("qwen2")
    prompts = _prompts(6, (7, 15, 11))
    store = PrefixStore(lm, progress=False)
    answers = generate(lm.model, prompts, stop_ids={}, max_new_tokens=9, pad_id=0, keep_kv=store)
    assert len(store) == 3
    header = [5, 6, 7]
    nxt = [p + a.token_ids + header for p, a in zip(prompts, answers)]
    nxt[1] = nxt[1][:18] + [99] + nxt[1][19:]  # retokenised answer: the common prefix stops at token 18
    rows, temps, seeds = _rows(nxt, k=1)
    kw = dict(stop_ids={}, max_new_tokens=8, temperatures=temps, seeds=seeds, pad_id=0)
    assert store.lookup(nxt[0], len(nxt[0]) - 1)[0] == len(prompts[0]) + 8  # the answer's last token has no KV yet
    assert store.lookup(nxt[1], len(nxt[1]) - 1)[0] == 18
    with_kv = generate(lm.model, rows, prefix_store=store, **kw)
    plain = generate(lm.model, rows, **kw)
    assert [g.token_ids for g in with_kv] == [g.token_ids for g in plain]


@pytest.mark.slow
def test_real_model_user_turns_and_boundary_from_stored_prefixes_fp32(smol):
    tok = smol.tokenizer
    pps = [chat.build_probe_prompt(tok, q, a) for q, a in
           [("What is 7*8?", "7*8 = 56."), ("Name a fruit.", "An apple is a fruit; so is a pear."),
            ("Hi", "Hello! How can I help you today?")]]
    stops = chat.stop_token_ids(tok, smol.model)
    store = PrefixStore(smol, progress=False)
    assert store.build(pps) == 3
    rows, temps, seeds = _rows([p.input_ids for p in pps], k=2)
    kw = dict(stop_ids=stops, max_new_tokens=24, temperatures=temps, seeds=seeds, pad_id=tok.pad_token_id)
    layers = [0, 15, 29]
    res = {}
    for use in (False, True):
        handles, seen = _boundary_capture(smol.model, layers)
        try:
            gens = generate(smol, rows, prefix_store=store if use else None, **kw)
        finally:
            for h in handles:
                h.remove()
        res[use] = ([g.token_ids for g in gens], seen)
    assert res[True][0] == res[False][0]
    for a, b in zip(res[True][1], res[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drop_finished", [True, False])
def test_keep_kv_stores_each_row_as_it_ends(drop_finished):
    """Rows ending at different steps (a stop token) are stored with exactly their prompt + answer-but-last tokens,
    whether finished rows leave the batch or keep decoding."""
    lm = _lm("llama")
    prompts = _prompts(7, (6, 13, 9, 4))
    free = generate(lm.model, prompts, stop_ids={}, max_new_tokens=10, pad_id=0)
    stop = next(t for t in free[0].token_ids[2:] if any(t not in f.token_ids for f in free[1:]))
    store = PrefixStore(lm, progress=False)
    gens = generate(lm.model, prompts, stop_ids={stop: "end_of_turn"}, max_new_tokens=10, pad_id=0, keep_kv=store,
                    drop_finished=drop_finished)
    assert {g.stop_reason for g in gens} == {"end_of_turn", "max_tokens"}
    for p, g in zip(prompts, gens):
        full = p + g.token_ids
        assert store.lookup(full, len(full))[0] == len(full) - 1  # every token but the last, whose KV is not made
        nxt = full + [3, 4]
        a = generate(lm.model, [nxt], stop_ids={}, max_new_tokens=5, pad_id=0, prefix_store=store)[0]
        assert a.token_ids == generate(lm.model, [nxt], stop_ids={}, max_new_tokens=5, pad_id=0)[0].token_ids
