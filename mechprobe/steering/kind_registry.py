"""The registry of steering-vector kinds: how each way of building a vector is named, found and built.

A kind is one function ``build(ctx: VectorContext) -> SteeringVector`` in its own module under
:mod:`mechprobe.steering.kinds`, decorated with :func:`register_vector_kind`. Every module in that package is
imported when it loads, so adding a kind touches that one module (and its test): the experiment runs every kind
in ``SteerConfig.kinds`` through :func:`build_vector`, the CLI's ``--kinds`` default and help come from
:func:`default_kinds` and :func:`vector_kinds`, and :class:`~mechprobe.steering.steering_vector.SteeringVector`
accepts every registered name as its ``kind``.

Why a registry and not a chain of ifs: the intervention study adds several kinds (an audited difference of
means, a reading contrast, a post-training direction); each should be one reviewable file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mechprobe.errors import UsageError

__all__ = ["VectorContext", "VectorKind", "build_vector", "check_kinds", "default_kinds", "register_vector_kind",
           "vector_kind", "vector_kinds"]


@dataclass(frozen=True)
class VectorContext:
    """Everything a kind's builder may use, at one residual index of one run (all rows are the run's cache rows).

    Args:
        cache: the run's :class:`~mechprobe.activations.cache.ActivationCache` (``cache.resid(layer)``: boundary
            residuals ``[rows, d_model]``; ``cache.labels("genuine")``; ``cache.item_ids``).
        layer: the residual index the vector is added at (``r = 0``: embeddings; ``r``: output of block ``r - 1``).
        train_rows: boolean mask over the cache rows a vector may be built from (train items, labelled); held-out
            rows must never feed a vector.
        pos_rows: ``train_rows`` whose user turn is a genuine follow-up.
        neg_rows: ``train_rows`` whose user turn is not.
        reference: the raw difference of means at ``layer`` over ``pos_rows`` / ``neg_rows``
            (a :class:`~mechprobe.steering.steering_vector.SteeringVector` with ``resid_norm``, ``weight_hash``,
            ``source_run``): the yardstick and provenance every other kind copies.
        seed: the run's seed (random directions, probe folds).
        model: the :class:`~mechprobe.lm.models.LoadedModel` being steered, or None where no model is loaded.
        run: the run directory (other files of the run, e.g. ``audit/``), or None.
    """

    cache: Any
    layer: int
    train_rows: torch.Tensor
    pos_rows: torch.Tensor
    neg_rows: torch.Tensor
    reference: Any
    seed: int = 0
    model: Any = None
    run: Path | None = None


Builder = Callable[[VectorContext], Any]


@dataclass(frozen=True)
class VectorKind:
    """One registered kind: its name (the vector's ``kind`` and the file names), builder and place in tables."""

    name: str
    build: Builder
    order: int
    default: bool
    doc: str


_KINDS: dict[str, VectorKind] = {}


def register_vector_kind(name: str, *, order: int = 100, default: bool = False) -> Callable[[Builder], Builder]:
    """Register ``build(ctx) -> SteeringVector`` as the vector kind ``name`` (a decorator).

    Args:
        name: the kind's name: ``SteeringVector.kind``, the ``kinds`` entry and part of the steered files' names.
        order: where its rows go in results tables (lower first), so adding a kind never reorders the others.
        default: whether ``SteerConfig.kinds`` (``--kinds``) runs it when not told otherwise.

    Returns:
        The decorator; it returns the builder unchanged.

    Raises:
        UsageError: ``name`` is empty, has a comma, or is registered already.

    Example:
        >>> from mechprobe.steering.kind_registry import register_vector_kind, vector_kinds
        >>> "diff_means" in vector_kinds()
        True
        >>> @register_vector_kind("doubled_example", order=900)        # doctest: +SKIP
        ... def doubled(ctx):
        ...     return SteeringVector(2 * ctx.reference.vector, ctx.layer, "doubled_example", dict(ctx.reference.metadata))
    """
    if not name or "," in name or name != name.strip():
        raise UsageError(f"vector kind name {name!r}: use a non-empty name without commas or spaces")

    def deco(build: Builder) -> Builder:
        if name in _KINDS and _KINDS[name].build is not build:
            raise UsageError(f"vector kind {name!r} is registered twice ({_KINDS[name].build.__module__} and "
                             f"{build.__module__}); give the new one another name")
        _KINDS[name] = VectorKind(name, build, order, default, (build.__doc__ or "").strip().split("\n")[0])
        return build
    return deco


def vector_kinds() -> tuple[str, ...]:
    """Every registered kind's name, in table order."""
    return tuple(k.name for k in sorted(_KINDS.values(), key=lambda k: (k.order, k.name)))


def default_kinds() -> tuple[str, ...]:
    """The kinds run when ``SteerConfig.kinds`` is left at its default, in table order."""
    return tuple(k for k in vector_kinds() if _KINDS[k].default)


def vector_kind(name: str) -> VectorKind:
    """The registered kind ``name``; a :class:`~mechprobe.errors.UsageError` naming the known ones otherwise."""
    if name not in _KINDS:
        raise UsageError(f"vector kind {name!r} unknown; use one of {', '.join(vector_kinds())}")
    return _KINDS[name]


def check_kinds(kinds: str | Iterable[str], field: str = "kinds") -> list[str]:
    """``kinds`` (a comma string or names) as a list in table order; unknown names refused naming ``field``."""
    names = [k for k in (kinds.split(",") if isinstance(kinds, str) else kinds) if k]
    unknown = sorted(set(names) - set(_KINDS))
    if unknown:
        raise UsageError(f"{field}={','.join(names)}: {unknown} unknown; choose from {','.join(vector_kinds())}")
    return [k for k in vector_kinds() if k in names]


def build_vector(kind: str, ctx: VectorContext) -> Any:
    """The kind's raw vector at ``ctx.layer`` (the caller puts it in alpha units with ``in_alpha_units``)."""
    vec = vector_kind(kind).build(ctx)
    if getattr(vec, "kind", None) != kind or getattr(vec, "layer", None) != ctx.layer:
        raise TypeError(f"vector kind {kind!r}'s builder returned {type(vec).__name__} of kind "
                        f"{getattr(vec, 'kind', None)!r} at layer {getattr(vec, 'layer', None)}; it must return a "
                        f"SteeringVector of kind {kind!r} at layer {ctx.layer}")
    return vec
