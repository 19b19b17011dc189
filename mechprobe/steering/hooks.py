"""Steering hooks: which positions of a forward get the vector, and the hooks that add it to the residual stream.

This module knows nothing of :class:`~mechprobe.steering.steering_vector.SteeringVector` beyond its ``layer``,
``d_model``, ``metadata`` and :meth:`scaled`, so the vector class (whose :meth:`apply` runs these hooks) and the
public :func:`~mechprobe.steering.intervene.steer` can both sit above it.

**Where it is added** (residual index ``r``, the convention of :mod:`mechprobe.activations.cache`: ``r = 0``
is the embedding output = the input of block 0, ``r = i`` is the output of block ``i - 1``). Steering
at ``r >= 1`` edits the output of block ``r - 1`` (a forward hook); at ``r = 0`` it edits the input of
block 0 (a forward pre-hook). Both hooks are registered *first* (``prepend=True``), so every other
observer of that residual -- ``output_hidden_states[r]``, activation-capture hooks, the next block --
sees the steered value.

**Which positions** (with a KV cache; see docs/steering.md). A forward whose KV cache is empty is a
*prefill*: it holds the whole prompt, left-padded, and the probe prompt ends at the user-role boundary,
so the boundary is its last position in every row. A forward on a non-empty cache feeds *generated*
tokens (one per call in greedy decoding). ``positions`` selects:

* ``boundary``: the last position of the prefill call only;
* ``generated``: every position of every call on a non-empty cache (never the prefill, so the first
  generated token, which the prefill produces, cannot change);
* ``boundary+generated``: both; ``all``: every position of every call (prompt included), which is what a
  baked bias does (:func:`~mechprobe.steering.intervene.bake`).

The prefill/decode split is read from the cache length, not from ``seq_len``, so a one-token prompt is
still a prefill. A call that :func:`~mechprobe.lm.generation.generate` runs on a reused prefix
(``prefix_store=``) holds a non-empty cache and still ends at the boundary: ``generate`` marks it
(:func:`mechprobe.lm.kv.call_kind` ``"continue"``), and its last position is taken as the boundary; a call
that computes a prefix for the store (``"prefix"``) has no boundary and no generated position. While a
non-zero vector is active, the hooks record it on the model (:func:`mechprobe.lm.kv.intervention`), so
``generate`` refuses stored prefixes under ``positions="all"``, the one mode that edits earlier positions. HF ``generate(use_cache=False)`` re-runs the whole sequence every step; a no-cache
call whose ``input_ids`` extend the previous no-cache call's by exactly one token is recognised as such
a step, and the boundary and generated positions are then found inside the full sequence, giving the
same result as the cached run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mechprobe.errors import UsageError
from mechprobe.lm.forward import get_blocks
from mechprobe.lm.kv import call_kind, intervention

STEER_POSITIONS = ("boundary", "generated", "boundary+generated", "all")


class _Vector(Protocol):
    """What the hooks read from a steering vector."""

    layer: int
    metadata: dict[str, Any]

    @property
    def d_model(self) -> int: ...

    def scaled(self, alpha: float) -> torch.Tensor: ...


@dataclass
class _Call:
    """Where, in the current forward's positions, the boundary and the generated tokens are."""

    boundary: int | None  # index into this call's seq dim, or None
    gen_start: int  # positions >= gen_start are generated tokens (== seq_len: none)

    def span(self, positions: str, seq_len: int) -> tuple[int, int] | None:
        if positions == "all":
            return (0, seq_len)
        b = self.boundary if "boundary" in positions else None
        g = self.gen_start if "generated" in positions and self.gen_start < seq_len else None
        if b is not None and g is not None:
            return (b, seq_len)  # the boundary is the position just before the first generated one
        if b is not None:
            return (b, b + 1)
        if g is not None:
            return (g, seq_len)
        return None


def _fallback_call(seq_len: int) -> _Call:
    # Blocks called without their parent model (no cache information): seq_len > 1 is a prompt.
    return _Call(seq_len - 1, seq_len) if seq_len > 1 else _Call(None, 0)


def _cached_len(cache: Any) -> int | None:
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001 - unknown cache type: fall back to the seq_len rule
        return None


class _CallTracker:
    """Pre-hook on the module that runs the blocks: classifies each forward as prefill, decode or no-cache step."""

    def __init__(self) -> None:
        self.call: _Call | None = None
        self.prev_ids: torch.Tensor | None = None  # ids of the last no-cache call (for use_cache=False generate)
        self.prompt_len = 0

    def pre(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if ids is not None else kwargs.get("inputs_embeds")
        if x is None or x.dim() < 2:
            self.call = None
            return
        t = int(x.shape[1])
        kind = call_kind()  # set by generate() when it reuses a stored prefix (mechprobe.lm.kv)
        if kind == "prefix":  # positions before the boundary only
            self.call, self.prev_ids = _Call(None, t), None
            return
        if kind == "continue":  # the rest of a prompt on a reused prefix: its last position is the boundary
            self.call, self.prev_ids = _Call(t - 1, t), None
            return
        # transformers >= 5.24 names the KV cache ``cache`` (``past_key_values`` before, still accepted with a
        # deprecation warning): read both, or every decode step would look like a fresh prompt.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = _cached_len(cache)
        if past is None:
            self.call = _fallback_call(t)
        elif past > 0:  # decode step on a KV cache: everything in it is generated
            self.call, self.prev_ids = _Call(None, 0), None
        elif (cache is None and kwargs.get("use_cache") is False and ids is not None and self.prev_ids is not None
              and self.prev_ids.shape[0] == ids.shape[0] and t == self.prev_ids.shape[1] + 1
              and torch.equal(ids[:, :-1], self.prev_ids.to(ids.device))):
            # HF generate(use_cache=False): the whole sequence again, one token longer.
            self.call = _Call(self.prompt_len - 1, self.prompt_len)
            self.prev_ids = ids.detach().clone()
        else:  # prefill: the prompt ends at the boundary
            self.prompt_len = t
            self.call = _Call(t - 1, t)
            self.prev_ids = ids.detach().clone() if (ids is not None and cache is None) else None

    def post(self, _m: nn.Module, _args: Any, _out: Any) -> None:
        self.call = None


def _unwrap(model: Any) -> tuple[nn.Module, str | None]:
    """Accept a :class:`~mechprobe.lm.models.LoadedModel` too (its weight hash is then checked)."""
    if not isinstance(model, nn.Module) and hasattr(model, "model"):
        return model.model, getattr(model, "weight_hash", None)
    return model, None


def _hidden_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None and getattr(c, "hidden_size", None):
            return int(c.hidden_size)
    return None


def _check_target(model: Any, vector: _Vector, alpha: float, positions: str) -> tuple[nn.Module, nn.ModuleList]:
    """Validate positions, alpha and the model against the vector; the model's module and its blocks."""
    if positions not in STEER_POSITIONS:
        raise UsageError(f"positions={positions!r}: use one of {', '.join(STEER_POSITIONS)}")
    if not math.isfinite(float(alpha)):
        raise UsageError(f"alpha must be finite, got {alpha}")
    mod, weight_hash = _unwrap(model)
    blocks = get_blocks(mod)
    if not 0 <= vector.layer <= len(blocks):
        raise UsageError(f"layer {vector.layer} out of range: residual indices of this model are 0..{len(blocks)}")
    d = _hidden_size(mod)
    if d is not None and d != vector.d_model:
        raise UsageError(f"vector has {vector.d_model} dims but the model's residual stream has {d}: it was built "
                         f"for another model (weight_hash {vector.metadata.get('weight_hash', 'unknown')})")
    vh = vector.metadata.get("weight_hash")
    if weight_hash and vh and weight_hash != vh:
        raise UsageError(f"vector was built from model weights {vh[:12]}..., this model is {weight_hash[:12]}...: "
                         "rebuild the vector from this model's activations")
    return mod, blocks


def _blocks_parent(model: nn.Module, blocks: nn.ModuleList) -> nn.Module | None:
    for mod in model.modules():
        if any(child is blocks for child in mod.children()):
            return mod
    return None


@contextlib.contextmanager
def _steered(model: Any, vector: _Vector, alpha: float, positions: str) -> Iterator[None]:
    """Check the target, then add ``alpha * vector`` at ``positions`` while the context is open."""
    mod, blocks = _check_target(model, vector, alpha, positions)
    with _hooked(mod, blocks, vector, alpha, positions):
        yield


@contextlib.contextmanager
def _hooked(mod: nn.Module, blocks: nn.ModuleList, vector: _Vector, alpha: float, positions: str) -> Iterator[None]:
    """Register the residual hooks on a checked model (``mod``, ``blocks``); removed on exit, also after an error."""
    tracker = _CallTracker()
    delta_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    alpha = float(alpha)

    def delta(h: torch.Tensor) -> torch.Tensor:
        key = (h.device, h.dtype)
        if key not in delta_cache:
            delta_cache[key] = vector.scaled(alpha).to(device=h.device, dtype=h.dtype)
        return delta_cache[key]

    def add(h: torch.Tensor, owned: bool) -> torch.Tensor:
        if alpha == 0:
            return h
        t = h.shape[1]
        span = (tracker.call or _fallback_call(t)).span(positions, t)
        if span is None:
            return h
        if not owned or torch.is_grad_enabled():
            # A block input may be the caller's inputs_embeds, and autograd may need the unedited
            # output: copy. Under no_grad/inference a block's fresh output is edited in place (cheaper).
            h = h.clone()
        h[:, span[0]:span[1]] += delta(h)
        return h

    def post_hook(_m: nn.Module, _inp: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):  # transformers 5: decoder layers return a Tensor
            return add(out, owned=True)
        return (add(out[0], owned=True), *out[1:])  # older versions: (hidden, ...) tuples

    def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            return (add(args[0], owned=False), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": add(kwargs["hidden_states"], owned=False)}

    handles = []
    marks = contextlib.ExitStack()
    try:
        if alpha != 0:  # tells generate() whether stored prefixes are still valid (mechprobe.lm.kv)
            marks.enter_context(intervention(mod, f"steering at residual index {vector.layer} (positions="
                                                  f"{positions!r})", before_boundary=positions == "all"))
        parent = _blocks_parent(mod, blocks)
        if parent is not None:
            handles.append(parent.register_forward_pre_hook(tracker.pre, with_kwargs=True, prepend=True))
            handles.append(parent.register_forward_hook(tracker.post, always_call=True))
        if vector.layer == 0:
            handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
        else:
            handles.append(blocks[vector.layer - 1].register_forward_hook(post_hook, prepend=True))
        yield
    finally:
        for h in handles:
            h.remove()
        marks.close()
