"""Three ways to read the residual stream, one interface: :func:`capture`.

* ``hooks`` (default, fastest): plain torch forward hooks on the decoder blocks. Each hook keeps only
  the few rows it needs (``.clone()`` of a gathered slice, never a view of the full sequence), and the
  forward stops right after the last needed block, so the final norm and the LM head (for SmolLM2 the
  LM head costs more than seven blocks) are never computed.
* ``nnsight``: the same model wrapped by nnsight's ``LanguageModel``. The same code runs on NDIF for
  models no single machine holds: ``LanguageModel("meta-llama/Llama-3.1-405B-Instruct")`` and
  ``trace(..., remote=True)`` with an NDIF API key (not testable offline; see docs/activations.md).
* ``transformer-lens``: TransformerLens 4's ``TransformerBridge`` booted from the already-loaded HF
  model (no hub access). ``boot_transformers`` rewrites the model in place (block wrappers, eager
  attention), so it runs on a deep copy. Rows run one at a time, unpadded, to stay exact.

All three return, per requested position, ``[batch, n_layers, d_model]`` in residual-index order
(0 = input to block 0; r = output of block r-1).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .generation import input_device, left_pad
from .models import get_blocks

BACKENDS = ("hooks", "nnsight", "transformer-lens")


class _StopForward(Exception):
    """Raised by the last needed hook to skip the rest of the forward pass."""


def _block_output(out: Any) -> torch.Tensor:
    # transformers 5 decoder layers return a Tensor; older versions and other models a tuple whose
    # first element is the hidden state. `out[0]` on a Tensor would silently take batch row 0.
    return out if isinstance(out, torch.Tensor) else out[0]


def _select(h: torch.Tensor, positions: list[str], idx: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Gather the requested positions from a padded ``[B, T, d]`` hidden state."""
    out: dict[str, torch.Tensor] = {}
    b = torch.arange(h.shape[0], device=h.device)
    if "boundary" in positions:
        out["boundary"] = h[b, idx["boundary"]].detach().clone()
    if "assistant_last" in positions:
        out["assistant_last"] = h[b, idx["span_end"] - 1].detach().clone()
    if "assistant_mean" in positions:
        m = idx["span_mask"].to(h.dtype)
        out["assistant_mean"] = ((h * m[..., None]).sum(1) / m.sum(1, keepdim=True)).detach().clone()
    return out


def _padded_indices(prompts: Sequence[Sequence[int]], token_pos: Sequence[dict[str, Any]], device: torch.device
                    ) -> dict[str, torch.Tensor]:
    t = max(len(p) for p in prompts)
    pads = [t - len(p) for p in prompts]
    boundary = torch.tensor([pad + tp["boundary"] for pad, tp in zip(pads, token_pos)], device=device)
    s = torch.tensor([pad + tp["span"][0] for pad, tp in zip(pads, token_pos)], device=device)
    e = torch.tensor([pad + tp["span"][1] for pad, tp in zip(pads, token_pos)], device=device)
    ar = torch.arange(t, device=device)
    span_mask = (ar[None] >= s[:, None]) & (ar[None] < e[:, None])
    return {"boundary": boundary, "span_end": e, "span_mask": span_mask}


def capture(model: nn.Module, prompts: Sequence[Sequence[int]], token_pos: Sequence[dict[str, Any]],
            positions: Sequence[str], layers: Sequence[int], *, backend: str = "hooks", tokenizer: Any = None
            ) -> dict[str, torch.Tensor]:
    """Residual vectors at ``positions`` for residual indices ``layers``; see module docstring.

    ``token_pos[i]`` gives ``{"boundary": int, "span": (start, end)}`` in unpadded token indices.
    """
    positions, layers = list(positions), list(layers)
    if backend == "hooks":
        return _capture_hooks(model, prompts, token_pos, positions, layers)
    if backend == "nnsight":
        return _capture_nnsight(model, prompts, token_pos, positions, layers, tokenizer)
    if backend == "transformer-lens":
        return _capture_tl(model, prompts, token_pos, positions, layers, tokenizer)
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def _stack(per_layer: dict[int, dict[str, torch.Tensor]], positions: list[str], layers: list[int]
           ) -> dict[str, torch.Tensor]:
    return {p: torch.stack([per_layer[r][p] for r in layers], dim=1) for p in positions}


@torch.inference_mode()
def _capture_hooks(model: nn.Module, prompts: Sequence[Sequence[int]], token_pos: Sequence[dict[str, Any]],
                   positions: list[str], layers: list[int]) -> dict[str, torch.Tensor]:
    dev = input_device(model)
    ids, mask, pos = left_pad(prompts, 0, dev)
    idx = _padded_indices(prompts, token_pos, dev)
    blocks = get_blocks(model)
    got: dict[int, dict[str, torch.Tensor]] = {}
    last = max(layers)
    handles = []

    def post_hook(r: int):
        def fn(_m: nn.Module, _inp: Any, out: Any) -> None:
            got[r] = _select(_block_output(out), positions, idx)
            if r == last:
                raise _StopForward
        return fn

    def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        got[0] = _select(h, positions, idx)
        if last == 0:
            raise _StopForward

    try:
        if 0 in layers:
            handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for r in layers:
            if r > 0:
                handles.append(blocks[r - 1].register_forward_hook(post_hook(r)))
        try:
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        except _StopForward:
            pass
    finally:
        for h in handles:
            h.remove()
    return _stack(got, positions, layers)


_NNSIGHT_CACHE: dict[int, Any] = {}


def _blocks_path(model: nn.Module) -> str:
    blocks = get_blocks(model)
    for name, mod in model.named_modules():
        if mod is blocks:
            return name
    raise ValueError("decoder blocks not found")


def _capture_nnsight(model: nn.Module, prompts: Sequence[Sequence[int]], token_pos: Sequence[dict[str, Any]],
                     positions: list[str], layers: list[int], tokenizer: Any) -> dict[str, torch.Tensor]:
    import warnings

    from nnsight import LanguageModel

    key = id(model)
    if key not in _NNSIGHT_CACHE:
        side = getattr(tokenizer, "padding_side", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _NNSIGHT_CACHE[key] = LanguageModel(model, tokenizer=tokenizer)
        if tokenizer is not None and side is not None:
            tokenizer.padding_side = side  # nnsight sets "left"; leave the caller's tokenizer as it was
    nm = _NNSIGHT_CACHE[key]
    dev = input_device(model)
    ids, mask, pos = left_pad(prompts, 0, dev)
    idx = _padded_indices(prompts, token_pos, dev)
    env = nm
    for part in _blocks_path(model).split("."):
        env = getattr(env, part)
    saved: dict[int, Any] = {}
    # nnsight requires modules to be touched in forward order: block 0's input, then outputs ascending.
    with torch.inference_mode(), nm.trace({"input_ids": ids, "attention_mask": mask, "position_ids": pos}):
        for r in sorted(layers):
            saved[r] = (env[0].input if r == 0 else env[r - 1].output).save()
    got = {r: _select(_block_output(v), positions, idx) for r, v in saved.items()}
    return _stack(got, positions, layers)


_TL_CACHE: dict[int, Any] = {}


def _capture_tl(model: nn.Module, prompts: Sequence[Sequence[int]], token_pos: Sequence[dict[str, Any]],
                positions: list[str], layers: list[int], tokenizer: Any) -> dict[str, torch.Tensor]:
    from transformer_lens.model_bridge import TransformerBridge

    key = id(model)
    if key not in _TL_CACHE:
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        _TL_CACHE[key] = TransformerBridge.boot_transformers(
            type(model).__name__, hf_model=copy.deepcopy(model), tokenizer=tokenizer,
            device=str(input_device(model)))
    br = _TL_CACHE[key]
    names = {r: ("blocks.0.hook_resid_pre" if r == 0 else f"blocks.{r - 1}.hook_resid_post") for r in layers}
    wanted = set(names.values())
    rows: list[dict[str, torch.Tensor]] = []
    dev = input_device(model)
    for p, tp in zip(prompts, token_pos):
        # Tokens, not text: to_tokens on templated text would prepend a second BOS.
        ids = torch.tensor([list(p)], device=dev)
        with torch.inference_mode():
            _, cache = br.run_with_cache(ids, names_filter=lambda n: n in wanted)
        idx = _padded_indices([p], [tp], dev)
        per = {r: _select(cache[names[r]], positions, idx) for r in layers}
        rows.append({q: torch.stack([per[r][q][0] for r in layers]) for q in positions})
    return {q: torch.stack([row[q] for row in rows]) for q in positions}
