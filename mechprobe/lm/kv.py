"""KV-cache rows reused across calls, and what forward hooks need to know about such calls.

A user turn, a steering arm or a second sample of a fixed conversation reads the same conversation again;
its keys and values up to the user-role boundary do not change as long as nothing edits the positions before
the boundary (causal attention: position ``t``'s keys and values depend on tokens ``<= t`` only). This module
holds the low-level pieces that :func:`mechprobe.lm.generation.generate` and
:class:`mechprobe.lm.prefix.PrefixStore` share:

* one row's keys and values cut out of a batch cache (:func:`take_row`), and a left-padded batch cache
  assembled from rows of different lengths (:func:`assemble`) with the inputs of the tokens that follow
  (:func:`continuation_inputs`: each row is ``[pad][its prefix][pad][its tail]``, the tail right-aligned so
  the boundary is the last position of every row, the gap masked out);
* the *kind* of the forward now running (:func:`forward_kind`, :func:`call_kind`): a hook that classifies
  calls by their KV-cache length (a non-empty cache = generated tokens) would take a continuation, which runs
  on a non-empty cache and ends at the boundary, for a decode step;
* a registry of the interventions active on a model (:func:`intervention`), so ``generate`` can refuse to
  reuse a prefix that an intervention would have changed (one that edits positions before the boundary).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from mechprobe.lm.choice import kv_of

__all__ = [
    "KV", "KVSource", "active_interventions", "assemble", "call_kind", "continuation_inputs",
    "forward_kind", "intervention", "kv_nbytes", "reuse_problem", "take_row",
]

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""One row's keys and values, per layer: ``(keys, values)`` each ``(kv_heads, n_tokens, head_dim)`` (no batch
dimension, unlike :data:`mechprobe.lm.choice.KV`, whose entries are one-row batches)."""

CALL_KINDS = ("prefix", "continue")
_CALL_KIND: ContextVar[str | None] = ContextVar("mechprobe_call_kind", default=None)
_ATTR = "_mechprobe_interventions"


class KVSource(Protocol):
    """What :func:`~mechprobe.lm.generation.generate` asks of a prefix store (:class:`~mechprobe.lm.prefix.PrefixStore`)."""

    max_tail: int

    def check(self, model: Any) -> None: ...

    def lookup(self, ids: Sequence[int], limit: int) -> tuple[int, KV | None]: ...

    def add(self, ids: Sequence[int], kv: KV) -> None: ...


@contextlib.contextmanager
def forward_kind(kind: str | None) -> Iterator[None]:
    """Mark the forwards run inside as ``"prefix"`` (positions before the boundary only: no boundary, nothing
    generated) or ``"continue"`` (a continuation on a reused prefix whose last position is the boundary)."""
    if kind is not None and kind not in CALL_KINDS:
        raise ValueError(f"forward kind {kind!r}: use one of {CALL_KINDS}")
    token = _CALL_KIND.set(kind)
    try:
        yield
    finally:
        _CALL_KIND.reset(token)


def call_kind() -> str | None:
    """The kind set by :func:`forward_kind` for the forward now running (None: an ordinary prefill or decode)."""
    return _CALL_KIND.get()


@contextlib.contextmanager
def intervention(model: Any, what: str, *, before_boundary: bool) -> Iterator[None]:
    """Record on ``model`` that an intervention is active while the context is open.

    ``before_boundary``: it edits positions before the user-role boundary (a vector at every position), so a
    prefix computed without it is not the prefix it would compute: :func:`generate` then refuses a prefix store.
    """
    entry = (what, before_boundary)
    active = getattr(model, _ATTR, None)
    if active is None:
        active = []
        object.__setattr__(model, _ATTR, active)  # nn.Module.__setattr__ would treat a list specially
    active.append(entry)
    try:
        yield
    finally:
        active.remove(entry)


def active_interventions(model: Any, *, before_boundary_only: bool = False) -> list[str]:
    """Descriptions of the interventions :func:`intervention` recorded as active on ``model``."""
    return [w for w, before in getattr(model, _ATTR, None) or [] if before or not before_boundary_only]


def reuse_problem(model: Any) -> str | None:
    """Why this model's KV cache cannot be cut into rows and reassembled (None: it can).

    Sliding-window layers keep only the last window of keys, so a row's cache is not its whole prefix.
    """
    try:
        from transformers import DynamicCache  # lazy: slow import, model paths only

        layers = getattr(DynamicCache(config=model.config), "layers", None) or []
    except Exception:  # noqa: BLE001 - an unknown config: the plain layout below is what generate builds too
        return None
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return f"{type(model).__name__} has sliding-window attention layers, whose KV cache is not a whole prefix"
    return None


def take_row(cache: Any, row: int, cols: torch.Tensor) -> KV:
    """Copy row ``row``'s keys and values at cache columns ``cols`` (an index tensor), every layer."""
    return [(k[row][:, cols].clone(), v[row][:, cols].clone()) for k, v in kv_of(cache)]


def kv_nbytes(kv: KV) -> int:
    """Bytes held by one row's keys and values."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def assemble(kvs: Sequence[KV | None], lengths: Sequence[int], device: torch.device | None = None
             ) -> tuple[Any, int]:
    """A batch cache on ``device`` (default: the first row's) holding row ``i``'s first ``lengths[i]`` positions of
    ``kvs[i]``, right-aligned.

    Returns ``(cache, width)``: an HF ``DynamicCache`` of ``width = max(lengths)`` columns (empty when every
    length is 0); columns left of a row's prefix are zeros, masked out by :func:`continuation_inputs`.
    """
    from transformers import DynamicCache  # lazy: slow import, model paths only

    width = max(lengths, default=0)
    ref = next((kv for kv, n in zip(kvs, lengths) if kv is not None and n > 0), None)
    if width == 0 or ref is None:
        return DynamicCache(), 0
    data = []
    for layer, (k0, v0) in enumerate(ref):
        k = k0.new_zeros((len(kvs), k0.shape[0], width, k0.shape[2]), device=device)
        v = v0.new_zeros((len(kvs), v0.shape[0], width, v0.shape[2]), device=device)
        for i, (kv, n) in enumerate(zip(kvs, lengths)):
            if kv is not None and n > 0:
                k[i, :, width - n:] = kv[layer][0][:, :n].to(k.device)
                v[i, :, width - n:] = kv[layer][1][:, :n].to(v.device)
        data.append((k, v))
    return DynamicCache(data), width


def continuation_inputs(tails: Sequence[Sequence[int]], starts: Sequence[int], width: int, pad_id: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask (cache columns + new columns) and position ids of the tokens that follow
    each row's reused prefix of ``starts[i]`` tokens (right-aligned in a cache of ``width`` columns).

    Each tail is right-aligned, so the last position is the last prompt token of every row; the columns
    between a short prefix and its tail are masked out, and explicit positions ``starts[i] + j`` make the
    result the same as a prefill of the whole row (up to floating-point rounding).
    """
    n = max(len(t) for t in tails)
    ids = torch.full((len(tails), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(tails), width + n), dtype=torch.long)
    pos = torch.zeros((len(tails), n), dtype=torch.long)
    for i, (t, s) in enumerate(zip(tails, starts)):
        if len(t) == 0:
            raise ValueError(f"row {i} has no token after its reused prefix")
        ids[i, n - len(t):] = torch.tensor(list(t), dtype=torch.long)
        mask[i, width - s:width] = 1
        mask[i, width + n - len(t):] = 1
        pos[i, n - len(t):] = torch.arange(s, s + len(t))
        pos[i, :n - len(t)] = s
    return ids.to(device), mask.to(device), pos.to(device)
