"""A mistyped embedded model name and an impossible device are refused at once, before any hub lookup or load."""

from __future__ import annotations

import time

import pytest
import torch

from mechprobe.errors import UserError
from mechprobe.lm.device import check_device
from mechprobe.lm.models import check_model_source, load_model
from mechprobe.lm.registry import close_embedded_name


@pytest.fixture
def no_hub(monkeypatch):
    """Any hub access fails the test: the typo must be caught without the network."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("typo, meant", [("smollm2-135m-instruc", "smollm2-135m-instruct"),
                                         ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
                                         ("qwen2.5-coder-05b-instruct", "qwen2.5-coder-0.5b-instruct"),
                                         ("gemma3-207m", "gemma3-270m")])
def test_close_typo_names_the_embedded_model_without_the_hub(no_hub, typo, meant):
    t = time.monotonic()
    with pytest.raises(UserError, match=f"did you mean the embedded '{meant}'"):
        load_model(typo, device="cpu")
    with pytest.raises(UserError, match=meant):
        check_model_source(typo)
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("name", ["gpt2", "org/smollm2-135m-instruc", "smollm2-135m-instruct", "x.gguf"])
def test_hub_ids_and_real_names_are_not_second_guessed(name):
    assert close_embedded_name(name) is None


@pytest.mark.parametrize("device", ["nope", "cuda:abc", "tpu"])
def test_unknown_device_is_one_line(device):
    with pytest.raises(UserError, match="device=") as e:
        check_device(device)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_loading(no_hub):
    with pytest.raises(UserError, match="no CUDA GPU"):
        load_model("smollm2-135m-instruct", device="cuda")


def test_valid_devices_pass():
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(None).type in ("cpu", "cuda")
