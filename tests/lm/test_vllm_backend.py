"""The vLLM engine's mapping to mechprobe's Generation, against a stand-in with vLLM's interface.

vLLM cannot be installed on these CPU machines; the stand-in follows vLLM's documented semantics (stop
token ids are *excluded* from ``token_ids`` and reported as ``stop_reason``; per-request seeds), so a
mapping bug on our side fails here.
"""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass

import pytest

from mechprobe.lm.vllm import generate_vllm, load_vllm


@dataclass
class _Params:
    temperature: float
    seed: int | None
    max_tokens: int
    stop_token_ids: list[int]
    skip_special_tokens: bool = True


class _LLM:
    def __init__(self):
        self.calls = []

    def generate(self, inputs, sampling_params, use_tqdm=True):
        self.calls.append((inputs, sampling_params))
        outs = []
        for inp, sp in zip(inputs, sampling_params):
            rng = random.Random(sp.seed if sp.seed is not None else sum(inp["prompt_token_ids"]))
            toks, finish, stop = [], "length", None
            for _ in range(sp.max_tokens):
                t = rng.randrange(0, 12)
                if t in sp.stop_token_ids:
                    finish, stop = "stop", t
                    break
                toks.append(t)
            comp = types.SimpleNamespace(token_ids=toks, finish_reason=finish, stop_reason=stop)
            outs.append(types.SimpleNamespace(outputs=[comp]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.SamplingParams = _Params
    mod.LLM = lambda model, **kw: _LLM()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def test_mapping_keeps_stop_token_and_reason(fake_vllm):
    llm = load_vllm("some/model")
    stops = {3: "end_of_turn", 7: "eos"}
    gens = generate_vllm(llm, [[1, 2], [4, 5, 6], [9]], stop_ids=stops, max_new_tokens=30,
                         temperatures=[1.0, 1.0, 0.0], seeds=[1, 2, None])
    assert len(gens) == 3
    for g in gens:
        if g.stop_reason == "max_tokens":
            assert len(g.token_ids) == 30 and not set(g.token_ids) & set(stops)
        else:
            assert g.token_ids[-1] in stops and stops[g.token_ids[-1]] == g.stop_reason
            assert not set(g.token_ids[:-1]) & set(stops)
    params = llm.calls[0][1]
    assert [p.seed for p in params] == [1, 2, None] and all(p.skip_special_tokens is False for p in params)
    assert llm.calls[0][0][1] == {"prompt_token_ids": [4, 5, 6]}
    again = generate_vllm(llm, [[4, 5, 6]], stop_ids=stops, max_new_tokens=30, temperatures=1.0, seeds=[2])
    assert again[0] == gens[1]  # per-row seed: same row alone == in a batch


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="pip install vllm"):
        load_vllm("x")


class _ScriptedEngine:
    """vLLM's ``LLM.generate`` contract, deterministic: a few seeded tokens, then the first stop id
    (reported as ``stop_reason`` and left out of ``token_ids``, as vLLM does)."""

    def __init__(self, model, **kw):
        self.model = model

    def generate(self, inputs, sampling_params, use_tqdm=True):
        outs = []
        for inp, sp in zip(inputs, sampling_params):
            rng = random.Random(sp.seed if sp.seed is not None else len(inp["prompt_token_ids"]))
            toks = [rng.randrange(300, 5000) for _ in range(min(3, sp.max_tokens))]
            comp = types.SimpleNamespace(token_ids=toks, finish_reason="stop", stop_reason=sp.stop_token_ids[0])
            outs.append(types.SimpleNamespace(outputs=[comp]))
        return outs


@pytest.mark.slow
def test_item10_vllm_generated_run_is_cached_by_the_hf_path(smol_tokenizer, tmp_path, monkeypatch):
    """Issue 11 item 10: a run generated with ``--engine vllm`` (vLLM replaced by a scripted engine; the
    identity code is the real one) is accepted by ``mechprobe cache`` on the HF path, which reloads the model
    from the run's manifest and compares weight, tokenizer and template hashes."""
    import copy

    from mechprobe.activations.cache import ActivationCache, cache_run
    from mechprobe.io import read_json
    from mechprobe.lm.forward import tiny_model
    from mechprobe.lm.models import load_model
    from mechprobe.records import Item
    from mechprobe.turns.pipeline import ProbeConfig, run_probe

    # A real HF model directory: random tiny Llama weights with SmolLM2's tokenizer, saved *without* a pad
    # token (the HF loader adds one; the vLLM path used not to, so the tokenizer hashes differed).
    model_dir = tmp_path / "tiny-chat"
    tok = copy.deepcopy(smol_tokenizer)
    tok.pad_token = None
    tok.save_pretrained(model_dir)
    tiny_model("llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
               ).save_pretrained(model_dir)

    mod = types.ModuleType("vllm")
    mod.SamplingParams = _Params
    engines: list[_ScriptedEngine] = []
    mod.LLM = lambda model, **kw: engines.append(_ScriptedEngine(model, **kw)) or engines[-1]
    monkeypatch.setitem(sys.modules, "vllm", mod)

    run = tmp_path / "run"
    cfg = ProbeConfig(model=str(model_dir), dataset="t", limit=None, temperatures=[0.0, 1.0], samples=2,
                      max_assistant_tokens=8, max_user_tokens=6, engine="vllm", batch_size=4)
    items = [Item(item_id=f"t-{i}", dataset="t", prompt=f"What is {i} plus {i}?") for i in range(3)]
    run_probe(cfg, run, items=items, progress=False)
    assert engines and engines[0].model == str(model_dir)  # the vLLM path really ran
    assert len((run / "user_turns.jsonl").read_text().splitlines()) == 9

    hf = load_model(str(model_dir), device="cpu")
    ident = read_json(run / "manifest.json")["identity"]
    for k in ("model", "weight_hash", "tokenizer_hash", "template_hash"):
        assert ident[k] == hf.identity()[k], k

    out = cache_run(run, backend="hooks", layers=[0, 2], progress=False)  # model=None: loaded from the manifest
    cache = ActivationCache.load(run)
    assert out == run / "activations" and len(cache) == 9 and cache.layers == [0, 2]
