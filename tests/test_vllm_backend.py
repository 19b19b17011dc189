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

from mechprobe.vllm_backend import generate_vllm, load_vllm


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
