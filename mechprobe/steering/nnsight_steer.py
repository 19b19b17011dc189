"""Steered generation through nnsight (the path for models served remotely by NDIF), with :func:`steer`'s
position semantics."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mechprobe.activations.backends import blocks_path
from mechprobe.lm.generation import input_device, left_pad
from mechprobe.steering.hooks import _Call
from mechprobe.steering.intervene import _check
from mechprobe.steering.steering_vector import SteeringVector


def placeholder_tokenizer(vocab_size: int, pad_id: int = 0) -> Any:
    """A word-level tokenizer over ``t0..t{V-1}``: nnsight's wrapper insists on a tokenizer even when it
    is only given token ids (tiny test models have none)."""
    from tokenizers import Tokenizer  # lazy: with transformers
    from tokenizers.models import WordLevel  # lazy: with transformers
    from transformers import PreTrainedTokenizerFast  # lazy: slow import, model paths only

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=f"t{pad_id}")),
                                   pad_token=f"t{pad_id}")


def _nnsight_wrap(model: nn.Module, tokenizer: Any) -> Any:
    try:
        from nnsight.modeling.transformers import TransformersModel  # lazy: extra [backends]

        return TransformersModel(model, tokenizer=tokenizer, task="text-generation")
    except ImportError:  # nnsight < 0.8
        from nnsight import LanguageModel  # lazy: extra [backends]

        return LanguageModel(model, tokenizer=tokenizer)


def generate_nnsight(model: Any, prompts: Sequence[Sequence[int]], vector: SteeringVector, alpha: float,
                     positions: str = "boundary+generated", *, max_new_tokens: int = 32, pad_id: int = 0,
                     stop_ids: Sequence[int] | dict[int, str] | None = None, tokenizer: Any = None,
                     unit: str = "resid") -> list[list[int]]:
    """Greedy steered generation through nnsight, with the semantics of :func:`steer` (``alpha`` in ``unit``:
    ``"resid"``, default, x the layer's mean residual norm; ``"raw"``, CAA, x the vector as stored).

    The path for models served remotely by NDIF (same intervention code, ``remote=True``). nnsight
    0.8 specifics: every generate step needs ``for step in tracer.all()``; ``step == 0`` is the
    prefill (so a one-token prompt is handled like :func:`steer` does); code after that open-ended
    loop never runs in the same invoke, so the ids are read in a second invoke. Returns the new
    tokens per prompt, cut after the first stop token (included), like
    :func:`mechprobe.lm.generation.generate`. ``tokenizer`` defaults to a placeholder (ids are passed
    directly); the caller's tokenizer is left as it was (nnsight sets left padding and a pad token).
    """

    mod, blocks, vector = _check(model, vector, alpha, positions, unit)
    stops = sorted(stop_ids) if stop_ids else []
    tok = tokenizer if tokenizer is not None else placeholder_tokenizer(int(mod.config.vocab_size), pad_id)
    saved = {k: getattr(tok, k, None) for k in ("padding_side", "pad_token")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nm = _nnsight_wrap(mod, tok)
            ids, mask, _ = left_pad(prompts, pad_id, input_device(mod))
            delta = vector.scaled(alpha).to(device=input_device(mod))
            env: Any = nm
            for part in blocks_path(mod).split("."):
                env = getattr(env, part)
            with nm.generate(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                             eos_token_id=stops or None) as tracer:
                with tracer.invoke({"input_ids": ids, "attention_mask": mask}):
                    # alpha 0: no loop at all (a tracer.all() body that touches no module never ends).
                    for step in (tracer.all() if alpha != 0 else ()):
                        if vector.layer == 0:
                            h = env[0].input
                        else:
                            h = env[vector.layer - 1].output
                            h = h if isinstance(h, torch.Tensor) else h[0]
                        call = _Call(h.shape[1] - 1, h.shape[1]) if step == 0 else _Call(None, 0)
                        span = call.span(positions, h.shape[1])
                        if span is not None:
                            h[:, span[0]:span[1]] += delta.to(h.dtype)
                with tracer.invoke():
                    out = nm.generator.output.save()
    finally:
        for k, val in saved.items():
            if val is not None or k == "pad_token":
                with contextlib.suppress(Exception):
                    setattr(tok, k, val)
    new = out[:, ids.shape[1]:].tolist()
    result = []
    for row in new:
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        result.append(row if cut is None else row[: cut + 1])
    return result
