"""Helpers for running a Hugging Face causal LM's forward: its decoder blocks, the KV-cache keyword, a fast LM
head on kept positions, and tiny random-init models of real architectures for tests."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the strides a fresh tensor of its shape has (a copy only when they differ)."""
    want, acc = [], 1
    for n in reversed(x.shape):
        want.append(acc)
        acc *= n
    if tuple(reversed(want)) == x.stride():
        return x
    return x.new_empty(x.shape).copy_(x)


@contextmanager
def compact_lm_head_input(model: nn.Module) -> Iterator[None]:
    """While active, the LM head gets its input with fresh strides (hook removed on exit, even after errors).

    Why: transformers' ``logits_to_keep`` hands the LM head ``hidden[:, -k:, :]``, a view whose batch stride
    still spans the whole sequence. On CPU, torch 2.13's bf16 ``linear`` takes a path ~70x slower for such an
    input (Qwen 1.5B head, one position: 2.9 s vs 41 ms with compact strides; fp32 is unaffected), even
    when ``is_contiguous()`` is True (size-1 dims), so ``.contiguous()`` does not help and ``clone()``
    keeps the strides. Copying k x hidden values is negligible next to the head itself.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return

    def pre(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if args and isinstance(args[0], torch.Tensor):
            x = _compact(args[0])
            if x is not args[0]:
                return (x, *args[1:])
        return None

    h = head.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        h.remove()


def kv_kw(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the KV-cache keyword ``model.forward`` takes.

    Why: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns and is removed in 5.40),
    while older releases only know ``past_key_values``; the signature is the one source that is right for both.
    """
    return {_cache_kw(type(model)): cache}


_CACHE_KW: dict[type, str] = {}


def _cache_kw(cls: type) -> str:
    if cls not in _CACHE_KW:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError, AttributeError):
            params = {}
        _CACHE_KW[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[cls]


def out_cache(out: Any) -> Any:
    """The KV cache a forward returned: ``out.cache`` (transformers >= 5.24) or ``out.past_key_values``."""
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def logits_kept(model: nn.Module, keep: int, **inputs: Any) -> Any:
    """``model(**inputs, logits_to_keep=keep)`` with the LM head on the last ``keep`` positions only, at full
    speed in bf16 on CPU (:func:`compact_lm_head_input`). Returns the model's output object."""
    with compact_lm_head_input(model):
        return model(**inputs, logits_to_keep=keep)


def get_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of any HF causal LM, found structurally, so no per-family code is needed.

    Returns the ``nn.ModuleList`` whose length equals ``config.num_hidden_layers`` (Llama/Qwen/Gemma/
    Mistral: ``model.model.layers``; GPT-2: ``transformer.h``; GPT-NeoX: ``gpt_neox.layers``).

    Args:
        model: an HF causal LM (``nn.Module``); ``config.num_hidden_layers`` (or ``text_config``'s) selects the
            list; without it, the longest non-empty ``ModuleList`` is taken.

    Returns:
        The blocks as an ``nn.ModuleList``: block ``i`` reads residual index ``i`` and writes ``i + 1``.

    Raises:
        ValueError: no candidate ``ModuleList`` was found.

    Example:
        >>> from mechprobe import get_blocks, tiny_model
        >>> blocks = get_blocks(tiny_model("llama"))
        >>> type(blocks).__name__, len(blocks)
        ('ModuleList', 3)
    """
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    text_cfg = getattr(getattr(model, "config", None), "text_config", None)
    if n is None and text_cfg is not None:
        n = getattr(text_cfg, "num_hidden_layers", None)
    best: nn.ModuleList | None = None
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and (n is None or len(mod) == n):
            if best is None or len(mod) > len(best):
                best = mod
            if n is not None:
                return mod
    if best is None:
        raise ValueError(f"could not find the decoder blocks of {type(model).__name__}")
    return best


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A random-init model of a real architecture, for fast tests and GPU throughput checks.

    ``arch`` is one of llama, qwen2, gemma3, mistral. Weights are random (seeded), so outputs mean
    nothing; the module structure, attention and cache code are the real ones.

    Args:
        arch: ``"llama"`` (default), ``"qwen2"`` (or ``"qwen"``), ``"gemma3"`` (or ``"gemma"``) or
            ``"mistral"``.
        seed: ``torch.manual_seed`` used before initialising the weights (default 0): same seed, same model.
        **overrides: config fields replacing the small defaults (``vocab_size=128``, ``hidden_size=64``,
            ``intermediate_size=128``, ``num_hidden_layers=3``, 4 attention heads, 2 KV heads).

    Returns:
        A ``transformers`` causal LM (no tokenizer) in eval mode, float32, eager attention.

    Example:
        >>> from mechprobe import tiny_model
        >>> model = tiny_model("qwen2", num_hidden_layers=2)
        >>> type(model).__name__, model.config.hidden_size, model.config.num_hidden_layers
        ('Qwen2ForCausalLM', 64, 2)
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: slow import, model paths only

    base: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen": "qwen2", "gemma3": "gemma3_text",
                  "gemma": "gemma3_text", "mistral": "mistral"}[arch]
    if model_type == "gemma3_text":
        base.update(head_dim=16, sliding_window=32, query_pre_attn_scalar=16)
    base.update(overrides)
    cfg = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    try:
        model.set_attn_implementation("eager")
    except Exception:  # noqa: BLE001
        model.config._attn_implementation = "eager"
    return model.eval()
