"""Steering invariants (repeng-style) on a tiny random-init Llama, plus a few on the real default model.

Oracles: alpha 0 (and a zero vector) == no steering token for token; batch == one-by-one; in every
forward call the residual at the steered index moves by exactly ``alpha * v`` at the positions the
mode names and nowhere else (observed by hooks placed before and after the steering hook, under our
decode loop, HF ``generate`` with and without its KV cache, and one-token prompts); the same edit is
visible in ``output_hidden_states``; hooks are gone after exceptions.
"""

from __future__ import annotations

import pytest
import torch

from mechprobe.lm import chat
from mechprobe.lm.forward import get_blocks, tiny_model
from mechprobe.lm.generation import generate, left_pad
from mechprobe.lm.models import LoadedModel
from mechprobe.steering.vector import (
    STEER_POSITIONS,
    SteeringVector,
    diff_of_means,
    from_direction,
    random_like,
    steer,
)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
ONE_TOKEN = [[9], [42]]
DRIVERS = ("own", "hf", "hf_nocache")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _vec(model, layer=2, scale=3.0, seed=0) -> SteeringVector:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(model.config.hidden_size, generator=g)
    return SteeringVector(v / v.norm() * scale, layer, "random")


def _run(model, prompts, driver: str, n: int = 6) -> list[list[int]]:
    """New tokens per prompt from one of three decoding drivers (no stop tokens, exactly n tokens)."""
    if driver == "own":
        return [g.token_ids for g in generate(model, prompts, stop_ids={}, max_new_tokens=n, pad_id=0)]
    ids, mask, _ = left_pad(prompts, 0, torch.device("cpu"))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None, use_cache=(driver == "hf"))
    assert out.shape[1] == ids.shape[1] + n
    return out[:, ids.shape[1]:].tolist()


class CallRecorder:
    """Residual at index ``layer`` just before and just after the steering hook, for every forward call.

    Enter it *inside* ``steer``: the "before" hook is prepended after the steering hook was, so it runs
    first; the "after" hook is appended, so it runs last.
    """

    def __init__(self, model, layer: int):
        self.model, self.layer = model, layer
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

    def __enter__(self) -> CallRecorder:
        blk = get_blocks(self.model)[max(self.layer - 1, 0)]
        if self.layer == 0:
            def rec(store):
                def fn(_m, args, kwargs):
                    store.append((args[0] if args else kwargs["hidden_states"]).detach().clone())
                return fn
            self.handles = [blk.register_forward_pre_hook(rec(self.before), with_kwargs=True, prepend=True),
                            blk.register_forward_pre_hook(rec(self.after), with_kwargs=True)]
        else:
            def rec(store):
                def fn(_m, _args, out):
                    store.append((out if isinstance(out, torch.Tensor) else out[0]).detach().clone())
                return fn
            self.handles = [blk.register_forward_hook(rec(self.before), prepend=True),
                            blk.register_forward_hook(rec(self.after))]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def diffs(self) -> list[torch.Tensor]:
        return [a - b for a, b in zip(self.after, self.before)]


def _expected_positions(positions: str, driver: str, call: int, prompt_len: int, seq_len: int) -> list[int]:
    """Which positions of forward call ``call`` the mode must steer (call 0 = prefill)."""
    if positions == "all":
        return list(range(seq_len))
    if driver == "hf_nocache":  # the whole sequence every call: prompt [0, P), generated [P, seq_len)
        gen, bnd = list(range(prompt_len, seq_len)), [prompt_len - 1]
    else:
        gen, bnd = ([] if call == 0 else list(range(seq_len))), ([seq_len - 1] if call == 0 else [])
    return {"boundary": bnd, "generated": gen, "boundary+generated": sorted(bnd + gen)}[positions]


def _n_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_alpha_zero_and_zero_vector_are_token_identical(model, driver):
    base = _run(model, PROMPTS, driver)
    zero_vec = SteeringVector(torch.zeros(model.config.hidden_size), 2, "random")
    for pos in STEER_POSITIONS:
        with steer(model, _vec(model, scale=40.0), 0.0, pos, unit="raw"):
            assert _run(model, PROMPTS, driver) == base
        with steer(model, zero_vec, 3.0, pos, unit="raw"):  # goes through the add path, adds exact zeros
            assert _run(model, PROMPTS, driver) == base


@pytest.mark.parametrize("positions", STEER_POSITIONS)
def test_batch_equals_one_by_one_and_all_drivers_agree(model, positions):
    v = _vec(model, scale=40.0)
    base = _run(model, PROMPTS, "own")
    with steer(model, v, 1.0, positions, unit="raw"):
        batched = _run(model, PROMPTS, "own")
        single = [_run(model, [p], "own")[0] for p in PROMPTS]
        hf = _run(model, PROMPTS, "hf")
        hf_nocache = _run(model, PROMPTS, "hf_nocache")
    assert batched == single
    assert batched != base  # the vector is strong enough to matter in every mode
    assert hf == batched and hf_nocache == batched


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("positions", STEER_POSITIONS)
@pytest.mark.parametrize("prompts", [PROMPTS, ONE_TOKEN, [[9], [5, 6, 7]]], ids=["padded", "one_token", "mixed"])
def test_each_call_is_steered_exactly_at_the_named_positions(model, driver, positions, prompts):
    alpha, v = 2.0, _vec(model, layer=2)
    prompt_len = max(len(p) for p in prompts)
    with steer(model, v, alpha, positions, unit="raw"), CallRecorder(model, 2) as rec:
        _run(model, prompts, driver, n=4)
    diffs = rec.diffs()
    assert len(diffs) == 4  # one prefill + three decode calls (no-cache: four full forwards)
    for call, d in enumerate(diffs):
        want = _expected_positions(positions, driver, call, prompt_len, d.shape[1])
        other = [i for i in range(d.shape[1]) if i not in want]
        if want:
            torch.testing.assert_close(d[:, want], (alpha * v.vector).expand_as(d[:, want]), rtol=0, atol=1e-5)
        assert d[:, other].abs().max().item() == 0 if other else True, (call, want)


def test_generated_only_cannot_change_the_first_token(model):
    v = _vec(model, scale=40.0)
    base = _run(model, PROMPTS, "own", n=8)
    with steer(model, v, 1.0, "generated", unit="raw"):
        steered = _run(model, PROMPTS, "own", n=8)
    assert all(s[0] == b[0] for s, b in zip(steered, base))  # token 1 comes from the unsteered prefill
    assert steered != base


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_decode_steps_are_recognised_under_either_cache_keyword(name):
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``; HF generate passes the new name
    and older releases (and callers on the old name) the other. A decode step under either name is generated
    text, never a fresh prompt -- the bug that once steered every decode step as if it were the boundary."""
    from transformers import DynamicCache

    from mechprobe.steering.hooks import _CallTracker

    cache = DynamicCache()
    k = torch.zeros(1, 1, 5, 4)
    cache.update(k, k, 0)  # 5 positions already cached
    tr = _CallTracker()
    tr.pre(None, (), {"input_ids": torch.zeros(1, 5, dtype=torch.long), name: None})
    assert (tr.call.boundary, tr.call.gen_start) == (4, 5)  # a prefill: its last position is the boundary
    tr.pre(None, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long), name: cache})
    assert (tr.call.boundary, tr.call.gen_start) == (None, 0)  # a decode step: all generated


@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("positions", ["boundary", "all"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_output_hidden_states_show_exactly_alpha_v_at_the_steered_layer(layer, positions, grad):
    """With grad the hook edits a copy, so this also checks that it runs before HF's recording hooks."""
    model = tiny_model("llama")  # fresh: HF installs its recording hooks on first use, after ours here
    ids, mask, pos = left_pad(PROMPTS, 0, torch.device("cpu"))
    v, alpha = _vec(model, layer=layer), 1.5

    def hidden():
        with torch.set_grad_enabled(grad):
            hs = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states
        return [h.detach() for h in hs]

    with steer(model, v, alpha, positions, unit="raw"):
        steered = hidden()
    base = hidden()
    with steer(model, v, alpha, positions, unit="raw"):  # now HF's hooks were installed before ours: same result
        again = hidden()
    for hs in (steered, again):
        for r in range(layer):
            assert torch.equal(hs[r], base[r])  # upstream of the steered index: untouched
        d = hs[layer] - base[layer]
        cols = slice(None) if positions == "all" else slice(-1, None)
        torch.testing.assert_close(d[:, cols], (alpha * v.vector).expand_as(d[:, cols]), rtol=0, atol=1e-5)
        if positions == "boundary":
            assert d[:, :-1].abs().max() == 0
        assert not torch.equal(hs[layer + 1], base[layer + 1])  # and it propagates downstream


def test_hooks_removed_after_exceptions(model):
    n0 = _n_hooks(model)
    with pytest.raises(RuntimeError, match="inside"):
        with steer(model, _vec(model), 5.0, "all", unit="raw"):
            assert _n_hooks(model) > n0
            raise RuntimeError("inside")
    assert _n_hooks(model) == n0
    with pytest.raises(IndexError):  # the forward itself fails (token id beyond the vocabulary)
        with steer(model, _vec(model), 5.0, "boundary", unit="raw"):
            model(torch.tensor([[5000]]))
    assert _n_hooks(model) == n0
    base = _run(model, PROMPTS, "own")
    assert _run(model, PROMPTS, "own") == base  # nothing left behind changes outputs


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="positions"):
        with steer(model, _vec(model), 1.0, "everywhere", unit="raw"):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with steer(model, _vec(model, layer=4), 1.0, unit="raw"):
            pass
    with pytest.raises(ValueError, match="dims"):
        with steer(model, SteeringVector(torch.ones(10), 1, "random"), 1.0, unit="raw"):
            pass
    with pytest.raises(ValueError, match="kind"):
        SteeringVector(torch.ones(4), 1, "mystery")
    with pytest.raises(ValueError, match="1-D"):
        SteeringVector(torch.ones(2, 4), 1)
    lm = LoadedModel(model, None, "tiny", "a" * 64, torch.device("cpu"), torch.float32)
    v = _vec(model, scale=40.0)
    v.metadata["weight_hash"] = "b" * 64
    with pytest.raises(ValueError, match="rebuild the vector"):
        with steer(lm, v, 1.0, unit="raw"):
            pass
    v.metadata["weight_hash"] = "a" * 64
    base = _run(model, PROMPTS, "own")
    with steer(lm, v, 1.0, unit="raw"):  # a LoadedModel with the matching hash is accepted and steered
        assert _run(model, PROMPTS, "own") != base


def test_constructors_metadata_describe_and_save_load(tmp_path):
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(10, 8, generator=g) + 1.0, torch.randn(12, 8, generator=g)
    v = diff_of_means(pos, neg, layer=3, weight_hash="h" * 64, source_run="runs/x")
    torch.testing.assert_close(v.vector, pos.mean(0) - neg.mean(0))
    resid = float(torch.cat([pos, neg]).norm(dim=-1).mean())
    assert v.metadata == {"n_pos": 10, "n_neg": 12, "resid_norm": pytest.approx(resid), "position": "boundary",
                          "weight_hash": "h" * 64, "source_run": "runs/x"}
    text = v.describe(alpha=4, unit="raw")
    assert f"{v.norm / resid:.3f} x mean boundary residual norm" in text
    assert f"{4 * v.norm / resid:.3f} x residual norm" in text and "output of block 2" in text
    assert "(4.000 x residual norm)" in v.describe(alpha=4)  # the package's unit: alpha x the residual norm

    r = random_like(v, seed=1)
    assert r.kind == "random" and r.layer == 3 and abs(r.norm - v.norm) < 1e-5
    assert abs(float(r.vector @ v.vector)) < 1e-4 * v.norm ** 2  # orthogonal control
    assert torch.equal(r.vector, v.random_like(1).vector) and not torch.equal(r.vector, random_like(v, 2).vector)
    n = v.negated()
    assert n.kind == "negative" and torch.equal(n.vector, -v.vector) and n.metadata["source_kind"] == "diff_means"

    w = torch.randn(8, generator=g)
    p = from_direction(w, v)
    assert p.kind == "probe" and p.layer == 3 and abs(p.norm - v.norm) < 1e-5
    assert p.metadata["resid_norm"] == v.metadata["resid_norm"] and p.metadata["weight_hash"] == "h" * 64
    assert p.metadata["cos_with_reference"] == pytest.approx(float(torch.cosine_similarity(w, v.vector, dim=0)))
    torch.testing.assert_close(from_direction(torch.tensor([3.0, 4.0]), 10.0, layer=1).vector, torch.tensor([6.0, 8.0]))
    with pytest.raises(TypeError):
        from_direction(w, 3, v.norm)  # the old (direction, layer, scale) order must fail loudly
    with pytest.raises(ValueError, match="layer"):
        from_direction(w, 2.0)
    with pytest.raises(ValueError, match="both classes"):
        diff_of_means(pos[:0], neg, layer=1)

    for name in ("vec_alpha_1.5", "sub/dir/v"):  # a dot in the name must not be taken for a suffix
        path = p.save(tmp_path / name)
        assert path.name == name.split("/")[-1] + ".safetensors" and path.with_name(path.name[:-12] + ".json").exists()
        for ref in (tmp_path / name, path, path.with_name(path.name[:-12] + ".json")):
            q = SteeringVector.load(ref)
            assert torch.equal(q.vector, p.vector) and (q.layer, q.kind) == (3, "probe") and q.metadata == p.metadata
    with pytest.raises(FileNotFoundError, match="missing"):
        SteeringVector.load(tmp_path / "nothing_here")


# ----------------------------------------------------------------------------------------------------------
# The real default model (SmolLM2-135M-Instruct): probe prompts, short generations.


def _probe_prompts(tok):
    return [chat.build_probe_prompt(tok, q, a).input_ids for q, a in
            [("What is 6*7?", "6*7 = 42."), ("Tell me a fun fact.", "Octopuses have three hearts.")]]


@pytest.mark.slow
def test_real_model_alpha_zero_batch_and_boundary(smol):
    tok, m = smol.tokenizer, smol.model
    prompts = _probe_prompts(tok)
    stops = chat.stop_token_ids(tok, m)

    def own(ps):
        return [g.token_ids for g in generate(m, ps, stop_ids=stops, max_new_tokens=8, pad_id=tok.pad_token_id)]

    def hf(ps):  # HF generate, left-padded batch, its own KV cache
        ids, mask, _ = left_pad(ps, tok.pad_token_id, torch.device("cpu"))
        out = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=sorted(stops))
        rows = out[:, ids.shape[1]:].tolist()
        return [r[: next((i + 1 for i, t in enumerate(r) if t in stops), len(r))] for r in rows]

    base = own(prompts)
    v = random_like(SteeringVector(torch.ones(smol.d_model), 12, "random"), seed=0)
    with steer(smol, v, 0.0, "boundary+generated", unit="raw"):
        assert own(prompts) == base
        assert hf(prompts) == base
    v = SteeringVector(v.vector / v.norm * 40.0, 12, "random")
    with steer(smol, v, 1.0, "boundary+generated", unit="raw"), CallRecorder(m, 12) as rec:
        batched = own(prompts)
    with steer(smol, v, 1.0, "boundary+generated", unit="raw"):
        single = [own([p])[0] for p in prompts]
    assert batched == single
    assert batched != base
    prefill = rec.diffs()[0]  # the boundary (last position of the probe prompt) moved by exactly v
    torch.testing.assert_close(prefill[:, -1], v.vector.expand_as(prefill[:, -1]), rtol=0, atol=1e-4)
    assert prefill[:, :-1].abs().max() == 0
