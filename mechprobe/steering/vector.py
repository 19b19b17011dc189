"""Steering vectors: build them from boundary activations, add them to the residual stream, bake them in.

**What ``alpha`` means**: one unit everywhere, the added vector's norm as a multiple of the layer's mean boundary
residual norm (``unit="resid"``, the default of :func:`steer`, :func:`bake`, ``SteeringVector.apply`` and
``mechprobe steer``); ``unit="raw"`` is the explicit CAA option, ``h + alpha * v`` with ``v`` as stored
(``alpha = 1`` = one class gap for a raw difference of means). :mod:`mechprobe.steering.steering_vector` explains
both.

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
  baked bias does (:func:`bake`).

The prefill/decode split is read from the cache length, not from ``seq_len``, so a one-token prompt is
still a prefill. HF ``generate(use_cache=False)`` re-runs the whole sequence every step; a no-cache
call whose ``input_ids`` extend the previous no-cache call's by exactly one token is recognised as such
a step, and the boundary and generated positions are then found inside the full sequence, giving the
same result as the cached run.

Where each part lives: :mod:`mechprobe.steering.steering_vector` (the class, :func:`from_direction`,
:func:`random_like`, :func:`in_alpha_units`), :mod:`mechprobe.steering.kind_registry` and
:mod:`mechprobe.steering.kinds` (the vector kinds, one module each), :mod:`mechprobe.steering.diff_means` (:func:`diff_of_means`),
:mod:`mechprobe.steering.hooks` (positions and the hooks), :mod:`mechprobe.steering.intervene` (:func:`steer`,
:func:`bake`), :mod:`mechprobe.steering.nnsight_steer` (:func:`generate_nnsight`). Every name is importable from
here.
"""

from __future__ import annotations

from mechprobe.steering import kinds as _kinds  # noqa: F401  (imports, and so registers, every vector kind)
from mechprobe.steering.diff_means import diff_of_means
from mechprobe.steering.hooks import STEER_POSITIONS
from mechprobe.steering.intervene import bake, steer
from mechprobe.steering.kind_registry import (
    VectorContext,
    build_vector,
    check_kinds,
    default_kinds,
    register_vector_kind,
    vector_kinds,
)
from mechprobe.steering.nnsight_steer import generate_nnsight, placeholder_tokenizer
from mechprobe.steering.steering_vector import (
    ALPHA_UNITS,
    FORMAT,
    SteeringVector,
    from_direction,
    in_alpha_units,
    random_like,
)

KINDS = vector_kinds()
"""Every registered steering-vector kind (:mod:`mechprobe.steering.kinds`), in table order."""

__all__ = [
    "ALPHA_UNITS", "FORMAT", "KINDS", "STEER_POSITIONS", "SteeringVector", "VectorContext", "bake", "build_vector",
    "check_kinds", "default_kinds", "diff_of_means", "from_direction", "generate_nnsight", "in_alpha_units",
    "placeholder_tokenizer", "random_like", "register_vector_kind", "steer", "vector_kinds",
]
