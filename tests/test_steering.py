"""Steering invariants (repeng-style): v*0 == baseline, batch == one-by-one, positions, layer, hygiene, bake."""

from __future__ import annotations

import pytest
import torch

from mechprobe import chat
from mechprobe.generation import generate, left_pad
from mechprobe.models import get_blocks, tiny_model
from mechprobe.steering import SteeringVector, bake, diff_of_means, from_direction, steer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def _vec(model, layer=2, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(model.config.hidden_size, generator=g)
    return SteeringVector(v / v.norm() * scale, layer, "random")


def _gen(model, prompts=PROMPTS, n=10):
    return [g.token_ids for g in generate(model, prompts, stop_ids={}, max_new_tokens=n, pad_id=0)]


def test_alpha_zero_is_token_identical():
    model = tiny_model("llama")
    base = _gen(model)
    for pos in ("boundary", "generated", "boundary+generated", "all"):
        with steer(model, _vec(model), 0.0, pos):
            assert _gen(model) == base
        with steer(model, _vec(model), 0.0, pos):
            hf = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert hf[0, len(PROMPTS[0]):].tolist() == base[0]


def test_steering_changes_tokens_and_batch_equals_single():
    model = tiny_model("llama")
    v = _vec(model, scale=40.0)
    base = _gen(model)
    with steer(model, v, 1.0, "boundary+generated"):
        batched = _gen(model)
        single = [_gen(model, [p])[0] for p in PROMPTS]
        hf = model.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert batched == single
    assert batched != base
    assert hf[0, len(PROMPTS[2]):].tolist() == batched[2]  # same under HF generate with its KV cache


def _hidden(model, ids, layer, mask=None, pos=None):
    """Residual at index ``layer`` read as the *input* of block ``layer``.

    Not ``output_hidden_states``: transformers 5 records those with its own hooks, registered before
    ours, so a steering hook's edit to a block output is invisible there (see docs/gotchas.md).
    """
    got = {}

    def rec(_m, args, kwargs):
        got["h"] = (args[0] if args else kwargs["hidden_states"]).clone()

    h = get_blocks(model)[layer].register_forward_pre_hook(rec, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
    finally:
        h.remove()
    return got["h"]


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_boundary_only_changes_last_prefill_position_at_the_right_layer(layer):
    model = tiny_model("llama")
    v = _vec(model, layer=layer)
    ids, mask, pos = left_pad(PROMPTS, 0, torch.device("cpu"))
    before = _hidden(model, ids, layer, mask, pos)
    with steer(model, v, 2.0, "boundary"):
        after = _hidden(model, ids, layer, mask, pos)
    diff = after - before
    torch.testing.assert_close(diff[:, -1], (2.0 * v.vector).expand_as(diff[:, -1]), rtol=1e-5, atol=1e-5)
    assert diff[:, :-1].abs().max() == 0  # no other position is touched at the steered layer


def test_generated_leaves_prefill_untouched_and_steers_decode():
    model = tiny_model("llama")
    v = _vec(model, scale=40.0)
    ids = torch.tensor([PROMPTS[2]])
    before = _hidden(model, ids, 2)
    with steer(model, v, 1.0, "generated"):
        after = _hidden(model, ids, 2)
        steered = _gen(model, [PROMPTS[2]])[0]
    torch.testing.assert_close(after, before)
    base = _gen(model, [PROMPTS[2]])[0]
    assert steered[0] == base[0]  # first token comes from the (unsteered) prefill
    assert steered != base


def test_hooks_removed_after_exception():
    model = tiny_model("llama")
    blocks = get_blocks(model)
    with pytest.raises(RuntimeError, match="inside"):
        with steer(model, _vec(model), 5.0, "all"):
            raise RuntimeError("inside")
    assert all(len(b._forward_hooks) == 0 and len(b._forward_pre_hooks) == 0 for b in blocks)
    with pytest.raises(ValueError, match="positions"):
        with steer(model, _vec(model), 1.0, "everywhere"):
            pass


def test_vector_constructors_and_save_load(tmp_path):
    pos, neg = torch.randn(10, 8) + 1.0, torch.randn(12, 8)
    v = diff_of_means(pos, neg, layer=3, source="unit")
    torch.testing.assert_close(v.vector, pos.mean(0) - neg.mean(0))
    assert v.meta["n_pos"] == 10 and v.meta["n_neg"] == 12 and "x mean residual norm" in v.describe()
    r = v.random_like(seed=1)
    assert abs(r.norm - v.norm) < 1e-4 and r.kind == "random" and torch.dot(r.vector, v.vector).abs() < v.norm ** 2
    torch.testing.assert_close(v.negated().vector, -v.vector)
    p = from_direction(torch.tensor([3.0, 4.0]), layer=1, scale=10.0)
    torch.testing.assert_close(p.vector, torch.tensor([6.0, 8.0]))
    v.save(tmp_path / "v")
    w = SteeringVector.load(tmp_path / "v")
    torch.testing.assert_close(w.vector, v.vector)
    assert (w.layer, w.kind, w.meta["source"]) == (3, "diff_means", "unit")
    with pytest.raises(ValueError, match="both classes"):
        diff_of_means(pos[:0], neg, layer=1)


def test_bake_equals_all_positions_steering_and_roundtrips(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    v = _vec(model, layer=2, scale=20.0)
    with steer(model, v, 1.5, "all"):
        hooked = _gen(model)
        ids = torch.tensor([PROMPTS[0]])
        logits_hooked = model(ids).logits
    baked = bake(tiny_model("llama"), v, 1.5)
    assert _gen(baked) == hooked
    torch.testing.assert_close(baked(ids).logits, logits_hooked, rtol=1e-5, atol=1e-5)
    baked.save_pretrained(tmp_path / "baked")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "baked", dtype=torch.float32).eval()
    reloaded.set_attn_implementation("eager")
    assert _gen(reloaded) == hooked
    with pytest.raises(NotImplementedError):
        bake(tiny_model("qwen2"), v, 1.0)


@pytest.mark.slow
def test_real_model_alpha_zero_and_boundary(smol):
    tok = smol.tokenizer
    prompts = [chat.build_probe_prompt(tok, q, a).input_ids for q, a in
               [("What is 6*7?", "6*7 = 42."), ("Tell me a fun fact.", "Octopuses have three hearts.")]]
    stops = chat.stop_token_ids(tok, smol.model)
    base = [g.token_ids for g in generate(smol.model, prompts, stop_ids=stops, max_new_tokens=16, pad_id=tok.pad_token_id)]
    v = SteeringVector(torch.randn(smol.d_model), 12, "random")
    with steer(smol.model, v, 0.0, "boundary+generated"):
        zero = [g.token_ids for g in generate(smol.model, prompts, stop_ids=stops, max_new_tokens=16,
                                              pad_id=tok.pad_token_id)]
    assert zero == base
    with steer(smol.model, v.random_like(0), 8.0, "boundary+generated"):
        batched = [g.token_ids for g in generate(smol.model, prompts, stop_ids=stops, max_new_tokens=16,
                                                 pad_id=tok.pad_token_id)]
        single = [generate(smol.model, [p], stop_ids=stops, max_new_tokens=16, pad_id=tok.pad_token_id)[0].token_ids
                  for p in prompts]
    assert batched == single


@pytest.mark.parametrize("positions", ["boundary", "generated", "boundary+generated"])
def test_nnsight_steering_equals_hooks(smol_tokenizer, positions):
    from mechprobe.steering import generate_nnsight

    model = tiny_model("llama")
    v = _vec(model, scale=6.0, seed=3)
    base = _gen(model, n=8)
    with steer(model, v, 1.0, positions):
        hooked = _gen(model, n=8)
    assert hooked != base  # the vector is strong enough to matter
    got = generate_nnsight(model, smol_tokenizer, PROMPTS, v, 1.0, positions, max_new_tokens=8)
    assert got == hooked
    assert generate_nnsight(model, smol_tokenizer, PROMPTS, v, 0.0, positions, max_new_tokens=8) == base
