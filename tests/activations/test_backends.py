"""Capture backends against the HF oracle: parity, padding invariance, hook hygiene, no mutation of the model.

Oracle: HF ``output_hidden_states`` of each prompt run alone (unpadded), put in mechprobe's residual
convention. Tiny random-init Llama / Gemma 3 / Qwen 2 models run in well under a second; the real
embedded SmolLM2 runs in the ``slow`` tests on two short probe prompts.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mechprobe.activations.backends import (
    _PREPARED,
    BACKENDS,
    HooksBackend,
    block_output,
    capture,
    make_backend,
    structural_copy,
)
from mechprobe.lm import chat
from mechprobe.lm.forward import get_blocks, tiny_model

ALL_POSITIONS = ["boundary", "assistant_last", "assistant_mean"]
ARCHS = ["llama", "gemma3", "qwen2"]


def make_tiny_tokenizer(directory) -> object:
    """A 128-token word-level tokenizer with a chat template and *no pad token*, saved and re-loaded.

    Saved to disk because TransformerLens re-loads tokenizers from ``name_or_path``; no pad token so
    a backend that sets one (nnsight does) on the caller's tokenizer is caught.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="t1", eos_token="t2", unk_token="t0")
    tok.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t2 {% endfor %}"
    tok.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


def final_norm(model):
    return model.model.norm


def oracle(model, prompt: list[int]) -> torch.Tensor:
    """``[L+1, T, d]`` residuals of one unpadded prompt: HF hidden states, last entry *before* the final norm."""
    ids = torch.tensor([prompt])
    last = {}
    h = get_blocks(model)[-1].register_forward_hook(lambda m, i, o: last.setdefault("x", block_output(o)))
    try:
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        h.remove()
    return torch.stack([x[0] for x in hs[:-1]] + [last["x"][0]])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error per vector, worst over all vectors: max ||a - b|| / ||b|| over the last dim."""
    return ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max().item()


def random_prompts(n_tokens=(7, 12, 4), seed=3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in n_tokens]
    spans = [(1, n - 2) if n > 3 else (0, 1) for n in n_tokens]
    return prompts, [{"boundary": len(p) - 1, "span": s} for p, s in zip(prompts, spans)]


def max_parity_error(model, prompts, token_pos, backend, tokenizer, refs=None) -> dict[str, float]:
    """Worst relative error per position of a batched, left-padded capture vs each prompt run alone."""
    layers = list(range(len(get_blocks(model)) + 1))
    got = capture(model, prompts, token_pos, ALL_POSITIONS, layers, backend=backend, tokenizer=tokenizer)
    errs = dict.fromkeys(ALL_POSITIONS, 0.0)
    for i, (p, tp) in enumerate(zip(prompts, token_pos)):
        ref = refs[i] if refs is not None else oracle(model, p)  # [L+1, T, d]
        s, e = tp["span"]
        want = {"boundary": ref[:, tp["boundary"]], "assistant_last": ref[:, e - 1],
                "assistant_mean": ref[:, s:e].mean(1)}
        for pos in ALL_POSITIONS:
            assert got[pos].shape == (len(prompts), len(layers), ref.shape[-1])
            errs[pos] = max(errs[pos], rel(got[pos][i], want[pos]))
    return errs


# ---------------------------------------------------------------- the convention itself

@pytest.mark.parametrize("arch", ARCHS)
def test_hf_last_hidden_state_is_post_norm(arch):
    """transformers 5.23: hidden_states[L] = final_norm(output of the last block), so resid(L) != hidden_states[L]."""
    model = tiny_model(arch)
    prompt = random_prompts()[0][0]
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        ours = oracle(model, prompt)
        torch.testing.assert_close(final_norm(model)(ours[-1][None])[0], hs[-1][0], rtol=1e-5, atol=1e-5)
    assert len(hs) == len(get_blocks(model)) + 1
    assert rel(ours[-1], hs[-1][0]) > 0.1  # a reader using hidden_states[-1] as "block L-1 output" would be wrong
    torch.testing.assert_close(ours[:-1], torch.stack([h[0] for h in hs[:-1]]))


# ---------------------------------------------------------------- parity with HF

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_parity_with_hidden_states(arch, backend, tiny_tok):
    prompts, tp = random_prompts()
    errs = max_parity_error(tiny_model(arch), prompts, tp, backend, tiny_tok)
    assert max(errs.values()) < 1e-4, errs


@pytest.fixture(scope="module")
def smol_case(smol):
    """Two real probe prompts and their oracle residuals, computed once for all backends."""
    tok = smol.tokenizer
    pps = [chat.build_probe_prompt(tok, q, a) for q, a in
           [("What is 2+2?", "2+2 = 4."), ("Name a primary colour.", "Red is one; blue and yellow are the others.")]]
    assert all(p.boundary_index == len(p.input_ids) - 1 for p in pps)
    tp = [{"boundary": p.boundary_index, "span": p.assistant_span} for p in pps]
    return [p.input_ids for p in pps], tp, [oracle(smol.model, p.input_ids) for p in pps]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_model_parity_at_boundary(smol, smol_case, backend):
    prompts, tp, refs = smol_case
    errs = max_parity_error(smol.model, prompts, tp, backend, smol.tokenizer, refs=refs)
    assert max(errs.values()) < 1e-4, errs


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_row_equals_unpadded_row(backend, tiny_tok):
    """A row's vectors do not depend on what else is in its batch (left padding + mask + position ids)."""
    model = tiny_model("llama")
    prompts, tp = random_prompts((3, 15, 9, 15))
    layers = [0, 1, 3]
    batched = capture(model, prompts, tp, ALL_POSITIONS, layers, backend=backend, tokenizer=tiny_tok)
    for i in range(len(prompts)):
        alone = capture(model, [prompts[i]], [tp[i]], ALL_POSITIONS, layers, backend=backend, tokenizer=tiny_tok)
        for pos in ALL_POSITIONS:
            assert rel(batched[pos][i], alone[pos][0]) < 1e-5, (pos, i)
    # The same prompt twice in one batch gives the same rows. Not bit-exact: a GEMM kernel may treat
    # batch rows in different register blocks / remainder loops (2.2e-8 seen on an AMD EPYC), so the
    # tolerance is fp32 round-off over a few blocks (rel 1e-6), far below any real position mix-up (~1).
    twice = capture(model, [prompts[0], prompts[0]], [tp[0], tp[0]], ["boundary"], layers, backend=backend,
                    tokenizer=tiny_tok)["boundary"]
    assert rel(twice[0], twice[1]) < 1e-6


@pytest.mark.parametrize("layers", [[0], [2], [1, 3], [0, 1, 2, 3]])
def test_layer_subsets_match_full_capture(layers, tiny_tok):
    """Early stopping after the last needed block and the r = 0 pre-hook select the right tensors."""
    model = tiny_model("qwen2")
    prompts, tp = random_prompts()
    full = capture(model, prompts, tp, ["boundary"], [0, 1, 2, 3])["boundary"]
    for backend in BACKENDS:
        sub = capture(model, prompts, tp, ["boundary"], layers, backend=backend, tokenizer=tiny_tok)["boundary"]
        assert rel(sub, full[:, layers]) < 1e-6, backend


# ---------------------------------------------------------------- hook hygiene and no mutation

def _hook_counts(model):
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def test_hooks_removed_after_success_and_after_exception():
    model = tiny_model("llama")
    before = _hook_counts(model)
    prompts, tp = random_prompts()
    capture(model, prompts, tp, ALL_POSITIONS, [0, 1, 2, 3])
    assert _hook_counts(model) == before

    def boom(*_a, **_k):
        raise RuntimeError("boom mid-forward")

    h = get_blocks(model)[1].mlp.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom mid-forward"):
        HooksBackend(model).capture(prompts, tp, ["boundary"], [0, 1, 2, 3])
    h.remove()
    assert _hook_counts(model) == before
    # And the model still gives clean results afterwards.
    assert rel(capture(model, prompts[:1], tp[:1], ["boundary"], [3])["boundary"][0, 0], oracle(model, prompts[0])[3, -1]) < 1e-5


@pytest.mark.parametrize("backend", ["nnsight", "transformer-lens"])
def test_wrapping_backends_survive_exception_and_leave_model_untouched(backend, tiny_tok):
    from mechprobe.lm.chat import tokenizer_hash

    model = tiny_model("gemma3")
    state = {"raise": False}

    def maybe_boom(*_a, **_k):
        if state["raise"]:
            raise RuntimeError("boom mid-forward")

    # Registered before wrapping, so the structural copy carries it too: the exception fires inside the wrapper.
    get_blocks(model)[1].mlp.register_forward_hook(maybe_boom)
    types = [type(m) for m in model.modules()]
    counts = _hook_counts(model)
    patched = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    attn, archs = model.config._attn_implementation, model.config.architectures
    tok_state = (tiny_tok.pad_token, tiny_tok.padding_side, tokenizer_hash(tiny_tok))
    prompts, tp = random_prompts()

    be = make_backend(backend, model, tiny_tok)
    ok = be.capture(prompts, tp, ["boundary"], [0, 2, 3])["boundary"]
    state["raise"] = True
    with pytest.raises(RuntimeError, match="boom mid-forward"):
        be.capture(prompts, tp, ["boundary"], [0, 2, 3])
    state["raise"] = False
    again = be.capture(prompts, tp, ["boundary"], [0, 2, 3])["boundary"]
    # Same inputs, same shapes, same process: expected identical, but thread scheduling may reorder
    # reductions, so allow fp32 round-off (rel 1e-6); a leftover hook would change values by O(1).
    assert rel(again, ok) < 1e-6

    assert [type(m) for m in model.modules()] == types
    assert _hook_counts(model) == counts
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == patched == []
    assert (model.config._attn_implementation, model.config.architectures) == (attn, archs)
    assert (tiny_tok.pad_token, tiny_tok.padding_side, tokenizer_hash(tiny_tok)) == tok_state
    # The wrapper reads the very same weights (no copy): an in-place edit is seen by it.
    with torch.no_grad():
        get_blocks(model)[0].mlp.down_proj.weight.mul_(2.0)
    edited = be.capture(prompts, tp, ["boundary"], [2])["boundary"]
    ref = capture(model, prompts, tp, ["boundary"], [2])["boundary"]
    assert rel(edited, ref) < 1e-5 and rel(edited, ok[:, 1:2]) > 1e-3


def test_structural_copy_shares_weights_not_modules():
    model = tiny_model("llama")
    twin = structural_copy(model)
    assert all(a is b for a, b in zip(model.parameters(), twin.parameters()))
    assert all(a is b for a, b in zip(model.buffers(), twin.buffers()))
    assert get_blocks(twin)[0] is not get_blocks(model)[0] and twin.config is not model.config


def test_prepared_wrappers_are_freed_with_their_model(tiny_tok):
    model = tiny_model("llama")
    prompts, tp = random_prompts()
    capture(model, prompts, tp, ["boundary"], [1], backend="nnsight", tokenizer=tiny_tok)
    assert model in _PREPARED
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None  # the cached wrapper did not keep the model (or a copy of its weights) alive


# ---------------------------------------------------------------- tuple outputs

class _TupleBlock(torch.nn.Module):
    """A block returning a tuple, the way transformers 4.x decoder layers (and many custom models) do."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None, **_k):
        # Causal mixing (cumulative mean over real tokens) so padding *could* leak if the mask were ignored.
        m = attention_mask[..., None].to(hidden_states.dtype)
        mixed = (hidden_states * m).cumsum(1) / m.cumsum(1).clamp(min=1)
        return (hidden_states + torch.tanh(self.lin(mixed)), None)


class _ToyTupleLM(torch.nn.Module):
    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.config = type("C", (), {"num_hidden_layers": n})()
        self.embed = torch.nn.Embedding(50, d)
        self.layers = torch.nn.ModuleList([_TupleBlock(d) for _ in range(n)])

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, **_k):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        h = self.embed(input_ids)
        trace = [h]
        for blk in self.layers:
            h = blk(h, attention_mask=attention_mask)[0]
            trace.append(h)
        return trace


def test_block_output_handles_tensors_and_tuples():
    x = torch.randn(2, 5, 4)
    assert block_output(x) is x  # not x[0], which would be batch row 0
    assert block_output((x, None)) is x


def test_tuple_block_outputs_are_handled():
    model = _ToyTupleLM()
    prompts = [[5, 6, 7, 8], [9, 10]]
    tp = [{"boundary": 3, "span": (0, 2)}, {"boundary": 1, "span": (0, 1)}]
    got = capture(model, prompts, tp, ["boundary", "assistant_mean"], [0, 1, 2, 3])
    for i, p in enumerate(prompts):
        with torch.no_grad():
            trace = model(torch.tensor([p]))
        ref = torch.stack([h[0] for h in trace])  # [L+1, T, d]
        torch.testing.assert_close(got["boundary"][i], ref[:, -1])
        s, e = tp[i]["span"]
        torch.testing.assert_close(got["assistant_mean"][i], ref[:, s:e].mean(1))


# ---------------------------------------------------------------- bad input

def test_bad_requests_fail_with_clear_messages(tiny_tok):
    model = tiny_model("llama")
    prompts, tp = random_prompts()
    with pytest.raises(ValueError, match="unknown backend"):
        capture(model, prompts, tp, ["boundary"], [1], backend="pyvene")
    with pytest.raises(ValueError, match="unknown positions"):
        capture(model, prompts, tp, ["last"], [1])
    with pytest.raises(ValueError, match=r"residual indices run 0\.\.3"):
        capture(model, prompts, tp, ["boundary"], [4])
    with pytest.raises(ValueError, match="outside its"):
        capture(model, prompts[:1], [{"boundary": 99, "span": (0, 1)}], ["boundary"], [1])
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        make_backend("nnsight", model, None)
