"""Steering through nnsight (parity with the hook implementation) and baked into the weights (bake)."""

from __future__ import annotations

import pytest
import torch

from mechprobe.lm import chat
from mechprobe.lm.forward import get_blocks, tiny_model
from mechprobe.lm.generation import generate
from mechprobe.steering.vector import (
    STEER_POSITIONS,
    SteeringVector,
    bake,
    generate_nnsight,
    placeholder_tokenizer,
    steer,
)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _vec(model, layer=2, scale=6.0, seed=3) -> SteeringVector:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(model.config.hidden_size, generator=g)
    return SteeringVector(v / v.norm() * scale, layer, "random")


def _gen(model, prompts=PROMPTS, n=8, stop_ids=None) -> list[list[int]]:
    return [g.token_ids for g in generate(model, prompts, stop_ids=stop_ids or {}, max_new_tokens=n, pad_id=0)]


def _n_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("positions", STEER_POSITIONS)
@pytest.mark.parametrize("layer", [0, 2])
def test_nnsight_steering_equals_hooks(model, positions, layer):
    v = _vec(model, layer=layer)
    base = _gen(model)
    with steer(model, v, 1.0, positions, unit="raw"):
        hooked = _gen(model)
    assert hooked != base  # the vector is strong enough to matter
    assert generate_nnsight(model, PROMPTS, v, 1.0, positions, max_new_tokens=8, unit="raw") == hooked
    assert generate_nnsight(model, PROMPTS, v, 0.0, positions, max_new_tokens=8, unit="raw") == base


def test_nnsight_one_token_prompts_stop_tokens_and_tokenizer_left_alone(model):
    v = _vec(model)
    prompts = [[9], [42]]
    with steer(model, v, 1.0, "boundary", unit="raw"):  # one-token prompt: the prefill is still the boundary
        hooked = _gen(model, prompts)
    assert generate_nnsight(model, prompts, v, 1.0, "boundary", max_new_tokens=8, unit="raw") == hooked
    with steer(model, v, 1.0, "boundary", unit="raw"):
        free = _gen(model)
    # a token some row first emits at step >= 3: rows must be cut right after their first stop token
    r, k = next((r, i) for r in range(len(free)) for i in range(2, len(free[r])) if free[r][i] not in free[r][:i])
    stop = free[r][k]
    with steer(model, v, 1.0, "boundary", unit="raw"):
        hooked = _gen(model, stop_ids={stop: "eos"})
    assert hooked[r] == free[r][:k + 1]
    tok = placeholder_tokenizer(model.config.vocab_size)
    tok.padding_side = "right"
    got = generate_nnsight(model, PROMPTS, v, 1.0, "boundary", max_new_tokens=8, stop_ids=[stop],
                           tokenizer=tok, unit="raw")
    assert got == hooked
    assert tok.padding_side == "right"
    assert _gen(model) == _gen(tiny_model("llama"))  # wrapping left no steering behind on the model


def test_bake_equals_all_positions_steering_and_roundtrips(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    v = _vec(model, layer=2, scale=20.0)
    ids = torch.tensor([PROMPTS[0]])
    base = _gen(model)
    with steer(model, v, 1.5, "all", unit="raw"):
        hooked = _gen(model)
        with torch.no_grad():
            logits_hooked = model(ids).logits
    assert hooked != base
    baked = bake(tiny_model("llama"), v, 1.5, unit="raw")
    assert _n_hooks(baked) == _n_hooks(model)  # weights, not hooks
    assert _gen(baked) == hooked
    with torch.no_grad():
        torch.testing.assert_close(baked(ids).logits, logits_hooked, rtol=1e-5, atol=1e-5)
    baked.save_pretrained(tmp_path / "baked")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "baked", dtype=torch.float32).eval()
    reloaded.set_attn_implementation("eager")
    down = get_blocks(reloaded)[1].mlp.down_proj
    torch.testing.assert_close(down.bias, 1.5 * v.vector)  # the bias survived save/load
    assert get_blocks(reloaded)[0].mlp.down_proj.bias.abs().max() == 0
    assert reloaded.config.mechprobe_steering["alpha"] == 1.5 and reloaded.config.mechprobe_steering["layer"] == 2
    assert _gen(reloaded) == hooked
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, logits_hooked, rtol=1e-5, atol=1e-5)


def test_bake_refuses_what_would_not_survive_save_load(model):
    for arch in ("qwen2", "gemma3"):  # no mlp_bias switch: the bias would be dropped on reload
        with pytest.raises(NotImplementedError, match="mlp_bias"):
            bake(tiny_model(arch), SteeringVector(torch.ones(64), 1, "random"), 1.0, unit="raw")
    with pytest.raises(ValueError, match="layer >= 1"):
        bake(tiny_model("llama"), SteeringVector(torch.ones(64), 0, "random"), 1.0, unit="raw")


@pytest.mark.slow
def test_real_model_nnsight_equals_hooks(smol):
    tok, m = smol.tokenizer, smol.model
    prompts = [chat.build_probe_prompt(tok, q, a).input_ids for q, a in
               [("What is 6*7?", "6*7 = 42."), ("Tell me a fun fact.", "Octopuses have three hearts.")]]
    stops = chat.stop_token_ids(tok, m)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(smol.d_model, generator=g)
    v = SteeringVector(v / v.norm() * 40.0, 12, "random")
    side = tok.padding_side
    with steer(smol, v, 1.0, "boundary+generated", unit="raw"):
        hooked = [x.token_ids for x in generate(m, prompts, stop_ids=stops, max_new_tokens=8,
                                                pad_id=tok.pad_token_id)]
    got = generate_nnsight(smol, prompts, v, 1.0, "boundary+generated", max_new_tokens=8,
                           pad_id=tok.pad_token_id, stop_ids=stops, tokenizer=tok, unit="raw")
    assert got == hooked
    assert tok.padding_side == side
