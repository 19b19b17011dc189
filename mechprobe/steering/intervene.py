"""Steering a model with a :class:`~mechprobe.steering.steering_vector.SteeringVector`: hooks for the length of a
``with`` block (:func:`steer`) or a bias folded into the weights (:func:`bake`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mechprobe.errors import UsageError
from mechprobe.lm.forward import get_blocks
from mechprobe.steering.hooks import STEER_POSITIONS, _check_target, _hooked, _unwrap
from mechprobe.steering.steering_vector import SteeringVector, in_alpha_units


def _check(model: Any, vector: SteeringVector, alpha: float, positions: str, unit: str
           ) -> tuple[nn.Module, nn.ModuleList, SteeringVector]:
    """The model's module and blocks, and ``vector`` in ``unit`` (so ``alpha * result`` is what is added)."""
    if positions not in STEER_POSITIONS:
        raise UsageError(f"positions={positions!r}: use one of {', '.join(STEER_POSITIONS)}")
    if not isinstance(vector, SteeringVector):
        raise TypeError(f"expected a SteeringVector, got {type(vector).__name__}; wrap a tensor with "
                        "SteeringVector(tensor, layer, kind)")
    vector = in_alpha_units(vector, unit)
    return (*_check_target(model, vector, alpha, positions), vector)


@contextlib.contextmanager
def steer(model: Any, vector: SteeringVector, alpha: float, positions: str = "boundary+generated", *,
          unit: str = "resid") -> Iterator[None]:
    """Add a vector of norm ``alpha`` x the layer's mean residual norm along ``vector`` while the context is open.

    Works for any forward-based decoding: :func:`mechprobe.lm.generation.generate`, HF ``generate`` (with
    or without its KV cache), plain forwards. Hooks are removed on exit, also after an exception.
    ``alpha == 0`` adds nothing, so outputs are token-identical to no steering. ``model`` may be an
    ``nn.Module`` or a :class:`~mechprobe.lm.models.LoadedModel`.

    Args:
        model: an HF causal LM (``nn.Module``) or a :class:`~mechprobe.lm.models.LoadedModel`; for the latter,
            a vector whose ``weight_hash`` names other weights is refused.
        vector: the :class:`SteeringVector`; added at residual index ``vector.layer`` (``r = 0``: input of
            block 0 via a forward pre-hook; ``r >= 1``: output of block ``r - 1`` via a forward hook).
        alpha: the strength in ``unit``; finite, negative pushes away from genuine follow-ups.
        positions: ``"boundary"`` (last position of the prefill call only), ``"generated"`` (every position of
            calls on a non-empty KV cache, never the prefill), ``"boundary+generated"`` (default: both) or
            ``"all"`` (every position of every call, what :func:`bake` does).
        unit: ``"resid"`` (default, the package's unit, as in :meth:`SteeringVector.apply` and ``mechprobe steer``):
            the added vector has norm ``alpha`` x ``vector.metadata["resid_norm"]`` (the layer's mean boundary
            residual norm), whatever ``|vector|`` is. ``"raw"`` (CAA): the residual becomes ``h + alpha * vector``
            (``alpha = 1`` = one class gap for a raw diff-of-means vector).

    Returns:
        A context manager (yields None); the hooks are active inside the ``with`` block and removed on exit,
        also after an exception.

    Raises:
        UsageError: unknown ``positions`` or ``unit``, non-finite ``alpha``, layer outside ``0..n_layers``, a
            vector built for another model (``d_model`` or ``weight_hash`` mismatch), or ``unit="resid"`` on a
            vector without ``resid_norm`` (pass ``unit="raw"``, or build it with :func:`diff_of_means`).
        TypeError: ``vector`` is not a :class:`SteeringVector`.

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector, steer, tiny_model
        >>> model = tiny_model("llama")                   # random weights, d_model 64, 3 blocks
        >>> _ = torch.manual_seed(0)
        >>> vec = SteeringVector(torch.randn(64), layer=2, metadata={"resid_norm": 8.0})
        >>> ids = torch.tensor([[1, 2, 3, 4]])            # a prompt that ends at the boundary
        >>> with torch.no_grad():
        ...     base = model(ids).logits
        ...     with steer(model, vec, alpha=0.5, positions="boundary"):   # adds norm 0.5 x 8
        ...         steered = model(ids).logits
        ...     after = model(ids).logits
        >>> torch.equal(base[:, :-1], steered[:, :-1])  # positions before the boundary untouched
        True
        >>> torch.equal(base[:, -1], steered[:, -1])    # the boundary position is steered
        False
        >>> torch.equal(after, base)                      # hooks are gone after the block
        True
    """
    mod, blocks, vector = _check(model, vector, alpha, positions, unit)
    with _hooked(mod, blocks, vector, alpha, positions):
        yield


def bake(model: nn.Module, vector: SteeringVector, alpha: float, *, unit: str = "resid") -> nn.Module:
    """Fold the steering push into the weights as the bias of block ``layer - 1``'s MLP ``down_proj``.

    The bias is what :func:`steer` adds with the same ``alpha`` and ``unit``: norm ``alpha`` x the layer's mean
    residual norm along ``vector`` (``unit="resid"``, default), or ``alpha * vector`` (``unit="raw"``, CAA).

    The block's output is ``h + attn + mlp(...)`` and ``down_proj`` is the MLP's last linear, so its bias
    is added to the residual at residual index ``layer`` -- at *every* position of every call, i.e.
    ``steer(..., positions="all")``, not boundary-only steering. The result is a standard HF model:
    ``save_pretrained`` writes ``mlp_bias: true`` in config.json and ``from_pretrained`` rebuilds the
    biases (zero for all other MLP linears). That needs a config with an ``mlp_bias`` switch whose MLP
    adds ``down_proj``'s output straight to the residual (Llama family, SmolLM2 included); others raise
    ``NotImplementedError`` (steer with hooks instead). Modifies the model in place and returns it;
    the provenance is kept in ``config.mechprobe_steering``.

    Args:
        model: an HF causal LM with a ``mlp_bias`` config switch and ``mlp.gate_proj/up_proj/down_proj``
            linears (a :class:`~mechprobe.lm.models.LoadedModel` is unwrapped to its ``model``).
        vector: the :class:`SteeringVector`; its ``layer`` must be >= 1 (residual index 0, the embeddings,
            has no block output to add a bias to).
        alpha: the strength in ``unit``, as in :func:`steer`.
        unit: ``"resid"`` (default) or ``"raw"``, as in :func:`steer`.

    Returns:
        The same ``nn.Module``, modified in place: every MLP linear now has a bias (zero except block
        ``layer - 1``'s ``down_proj``), ``config.mlp_bias = True`` and ``config.mechprobe_steering`` records
        layer, alpha, its unit, kind, the norm alpha multiplies and ``positions="all"``.

    Raises:
        ValueError: ``vector.layer < 1``.
        NotImplementedError: the architecture has no ``mlp_bias`` switch or lacks the three MLP linears.
        UsageError: as in :func:`steer` (layer out of range, vector built for another model, no ``resid_norm``).

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector, bake, steer, tiny_model
        >>> _ = torch.manual_seed(0)
        >>> vec = SteeringVector(torch.randn(64), layer=2)    # no resid_norm: raw (CAA) units
        >>> ids = torch.tensor([[1, 2, 3, 4]])
        >>> hooked = tiny_model("llama", seed=0)
        >>> with torch.no_grad(), steer(hooked, vec, alpha=4.0, positions="all", unit="raw"):
        ...     want = hooked(ids).logits
        >>> baked = bake(tiny_model("llama", seed=0), vec, alpha=4.0, unit="raw")
        >>> with torch.no_grad():
        ...     got = baked(ids).logits
        >>> torch.allclose(got, want, atol=1e-5), baked.config.mlp_bias
        (True, True)
        >>> baked.save_pretrained("steered-model")                          # doctest: +SKIP
    """
    mod, _ = _unwrap(model)
    _, _, vector = _check(mod, vector, alpha, "all", unit)
    if vector.layer < 1:
        raise ValueError("baking needs a block output (layer >= 1); residual index 0 would need the embedding, "
                         "which SmolLM2 ties to the LM head")
    cfg = mod.config
    blocks = get_blocks(mod)
    if not hasattr(cfg, "mlp_bias"):
        raise NotImplementedError(f"{type(mod).__name__}'s config has no mlp_bias switch, so a bias would not "
                                  "survive save/load; steer with hooks (positions='all') instead")
    if any(not isinstance(getattr(getattr(b, "mlp", None), n, None), nn.Linear)
           for b in blocks for n in ("gate_proj", "up_proj", "down_proj")):
        raise NotImplementedError(f"{type(mod).__name__} blocks lack mlp.gate_proj/up_proj/down_proj linears")
    for i, blk in enumerate(blocks):
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin: nn.Linear = getattr(blk.mlp, name)
            if lin.bias is None:
                new = nn.Linear(lin.in_features, lin.out_features, bias=True, device=lin.weight.device,
                                dtype=lin.weight.dtype)
                new.weight = lin.weight
                with torch.no_grad():
                    new.bias.zero_()
                new.requires_grad_(lin.weight.requires_grad)
                setattr(blk.mlp, name, new)
        if i == vector.layer - 1:
            with torch.no_grad():
                blk.mlp.down_proj.bias += vector.scaled(alpha).to(blk.mlp.down_proj.bias)
    cfg.mlp_bias = True
    cfg.mechprobe_steering = {"layer": vector.layer, "alpha": float(alpha), "alpha_unit": unit, "kind": vector.kind,
                              "norm": vector.norm, "positions": "all",
                              **{k: vector.metadata[k] for k in ("weight_hash", "source_run") if k in vector.metadata}}
    return mod
