"""The Python API refuses nonsense arguments with an error naming the argument (a ValueError).

Why: ``generate(..., max_new_tokens=0)`` returned empty text, ``apply(alpha=True)`` steered at 1, ``"0.2"`` was
accepted, ``alpha=1e30`` produced ''; ``generate(lm, [])``, ``fit_probe(None)``, ``build_probe_prompt(tok, "q",
None)``, a truncated vector file and a re-entered ``apply`` raised errors that named nothing
("max() arg is an empty sequence", AttributeError, SafetensorError); ``load_model(None)`` asked the hub for a minute.
"""

from __future__ import annotations

import time

import pytest
import torch

from mechprobe import SteeringVector, build_probe_prompt, fit_probe, generate, load_model, tiny_model
from tests.e2e.test_research_api import POS_TOKEN
from tests.e2e.test_research_api import tiny_run as research_run  # noqa: F401 - a fixture, used by name
from tests.lm.test_server import tiny_chat_tokenizer


@pytest.fixture(scope="module")
def api_run(research_run):  # noqa: F811 - the imported fixture, requested by name
    """The research-loop test's tiny run: (LoadedModel, ActivationCache)."""
    return research_run


@pytest.mark.parametrize("n", [0, -3, True, 2.5, "8"])
def test_generate_refuses_a_bad_max_new_tokens(n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_model("llama"), [[1, 2, 3]], stop_ids={}, max_new_tokens=n)


@pytest.mark.parametrize("prompts, needle", [([], "prompts"), ("hello", "prompts"), (None, "prompts"),
                                             ([[]], "prompt 0")])
def test_generate_refuses_empty_or_unlisted_prompts(prompts, needle):
    with pytest.raises(ValueError, match=needle):
        generate(tiny_model("llama"), prompts, stop_ids={}, max_new_tokens=2)


@pytest.mark.parametrize("t", [-1.0, float("nan"), float("inf")])
def test_generate_refuses_a_bad_temperature(t):
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny_model("llama"), [[1, 2]], stop_ids={}, max_new_tokens=2, temperatures=t, seeds=[1])


def test_generate_still_decodes_with_good_arguments():
    gens = generate(tiny_model("llama"), [[1, 2, 3]], stop_ids={}, max_new_tokens=2)
    assert len(gens[0].token_ids) == 2


@pytest.mark.parametrize("response, needle", [(None, "response"), (42, "response")])
def test_build_probe_prompt_names_a_missing_response(response, needle):
    with pytest.raises(ValueError, match=needle):
        build_probe_prompt(tiny_chat_tokenizer(), "what is two plus three", response)


def test_build_probe_prompt_names_a_bad_prompt():
    with pytest.raises(ValueError, match="prompt"):
        build_probe_prompt(tiny_chat_tokenizer(), None, "five")


@pytest.mark.parametrize("cache", [None, "runs/smol-gsm8k", 3])
def test_fit_probe_names_a_cache_that_is_not_one(cache):
    with pytest.raises(ValueError, match="ActivationCache"):
        fit_probe(cache, layer=2)


@pytest.mark.parametrize("layer", ["2", 2.0, True, None])
def test_fit_probe_names_a_layer_that_is_not_an_int(api_run, layer):
    _, cache = api_run
    with pytest.raises(ValueError, match="layer must be"):
        fit_probe(cache, layer=layer, folds=0)


@pytest.mark.parametrize("alpha", [True, "0.2", None, float("nan"), 1e30, -1e30])
def test_apply_refuses_a_bad_alpha_at_once(api_run, alpha):
    lm, cache = api_run
    vec = SteeringVector.from_probe(fit_probe(cache, layer=2, folds=0))
    with pytest.raises(ValueError, match="alpha"):
        vec.apply(lm, alpha=alpha)  # refused when called, not only on entering the with block


def test_apply_accepts_numpy_and_int_alphas(api_run):
    import numpy as np

    lm, cache = api_run
    vec = SteeringVector.from_probe(fit_probe(cache, layer=2, folds=0))
    for a in (np.float32(0.5), 1, -2):
        with vec.apply(lm, alpha=a):
            pass


def test_an_apply_context_can_be_entered_again(api_run):
    lm, cache = api_run
    vec = SteeringVector.from_probe(fit_probe(cache, layer=2, folds=0))
    ids = torch.tensor([[11, 12, 13, POS_TOKEN]])
    ctx = vec.apply(lm, alpha=2.0)
    outs = []
    with torch.no_grad():
        base = lm.model(ids).logits
        for _ in range(2):
            with ctx:
                outs.append(lm.model(ids).logits)
        assert torch.equal(lm.model(ids).logits, base)  # hooks off again
    assert torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], base)
    with ctx, pytest.raises(ValueError, match="already"), ctx:
        pass


def test_a_truncated_vector_file_is_named(tmp_path):
    vec = SteeringVector(torch.ones(8), layer=1)
    st = vec.save(tmp_path / "v")
    st.write_bytes(st.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"v\.safetensors") as ei:
        SteeringVector.load(tmp_path / "v")
    assert "save" in str(ei.value) and "\n" not in str(ei.value)
    (tmp_path / "v.json").write_text("{not json")
    vec.save(tmp_path / "w")
    (tmp_path / "w.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"w\.json"):
        SteeringVector.load(tmp_path / "w")


@pytest.mark.parametrize("name", [None, 3, ""])
def test_load_model_refuses_a_missing_name_at_once(name):
    t = time.monotonic()
    with pytest.raises(ValueError, match="name_or_path"):
        load_model(name)
    assert time.monotonic() - t < 5  # no hub retries
