"""Steering vectors: build them from boundary activations, add them to the residual stream, bake them in.

**What ``alpha`` multiplies** (CAA convention). The steered residual is ``h + alpha * v`` where ``v``
is the *raw* difference of means ``mean(h | genuine) - mean(h | not genuine)`` of the boundary residual
at the chosen residual index. ``alpha = 1`` moves the average non-follow-up boundary state onto the
average follow-up state; the number is in units of "one class gap", not of the residual norm. Other
vector kinds are put on the same scale so one alpha means the same push for all of them: a probe
direction is the unit direction times the diff-of-means norm of the same layer (:func:`from_direction`),
the random control has the diff-of-means norm (:func:`random_like`), the negative control is ``-v``.
:meth:`SteeringVector.describe` states ``|v|`` and ``alpha * |v|`` relative to the layer's mean
boundary residual norm, the number that says whether an alpha is gentle (~0.1) or destructive (~1).

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
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mechprobe.activations.backends import blocks_path
from mechprobe.activations.cache import ActivationCache
from mechprobe.errors import MissingInput, UsageError
from mechprobe.linear.linear_probe import LinearProbe
from mechprobe.lm.generation import input_device, left_pad
from mechprobe.lm.models import get_blocks

STEER_POSITIONS = ("boundary", "generated", "boundary+generated", "all")
ALPHA_UNITS = ("raw", "resid")
KINDS = ("diff_means", "probe", "random", "negative")
FORMAT = "mechprobe.steering_vector/1"


@dataclass
class SteeringVector:
    """A direction in the residual stream at residual index ``layer`` (0 = embeddings, r = output of block r-1).

    ``metadata`` carries what a later reader needs to trust the vector: ``weight_hash`` (model the
    activations came from), ``source_run``, ``position`` (where the activations were read, "boundary"),
    ``n_pos`` / ``n_neg`` (examples per class) and ``resid_norm`` (mean L2 norm of that residual at that
    position: the yardstick for ``|v|``).

    Args:
        vector: the direction, a finite 1-D tensor ``[d_model]`` (any float dtype; :meth:`scaled` returns
            float32). Its norm is the raw size that ``alpha`` multiplies in :func:`steer` and :func:`bake`.
        layer: residual index where the vector is added (TransformerLens ``resid_pre`` convention: ``r`` =
            input of block ``r``; 0 = embeddings, ``r >= 1`` = output of block ``r - 1``); must be >= 0.
        kind: one of ``"diff_means"`` (default), ``"probe"``, ``"random"``, ``"negative"``.
        metadata: provenance (see above); empty by default. :attr:`meta` is an alias.

    Raises:
        ValueError: ``vector`` is not a 1-D real tensor or has NaN/inf entries, ``layer`` is not a whole number
            >= 0 (:class:`~mechprobe.errors.UsageError`, a ``ValueError``), unknown ``kind``.

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector
        >>> v = SteeringVector(torch.ones(4), layer=2)
        >>> v.d_model, v.norm
        (4, 2.0)
        >>> v.describe(alpha=0.5)
        'diff_means vector at residual index 2 (output of block 1): |v| = 2; alpha 0.5 adds |alpha v| = 1'
        >>> v.negated().kind, v.negated().vector.tolist()
        ('negative', [-1.0, -1.0, -1.0, -1.0])
        >>> v.save("runs/smol-gsm8k/vectors/layer2")                        # doctest: +SKIP
        >>> SteeringVector.load("runs/smol-gsm8k/vectors/layer2")           # doctest: +SKIP

        The research loop (cache -> probe -> vector -> steered generation; alpha in residual-norm units):

        >>> from mechprobe import ActivationCache, fit_probe, generate, load_model
        >>> cache = ActivationCache.load("runs/smol-gsm8k")                 # doctest: +SKIP
        >>> vec = SteeringVector.from_probe(fit_probe(cache, layer=12))     # doctest: +SKIP
        >>> lm = load_model(cache.model_name)                               # doctest: +SKIP
        >>> with vec.apply(lm, alpha=0.2):   # adds 0.2 x the mean residual norm  # doctest: +SKIP
        ...     turns = generate(lm, prompts)                               # doctest: +SKIP
    """

    vector: torch.Tensor
    layer: int
    kind: str = "diff_means"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.vector, torch.Tensor) or self.vector.dim() != 1:
            shape = tuple(self.vector.shape) if isinstance(self.vector, torch.Tensor) else type(self.vector).__name__
            raise ValueError(f"a steering vector must be a 1-D tensor [d_model], got {shape}")
        if self.vector.is_complex() or self.vector.dtype == torch.bool:
            # a complex vector would be added to real activations (its imaginary part dropped or an error mid-run)
            raise UsageError(f"a steering vector must be a real tensor, got dtype {self.vector.dtype}: pass the real "
                             "direction (e.g. vector.real if the imaginary part is zero)")
        if not torch.isfinite(self.vector).all():
            raise ValueError("steering vector has NaN/inf entries: check the activations it was built from")
        layer = self.layer.item() if isinstance(self.layer, torch.Tensor) and self.layer.numel() == 1 else self.layer
        if isinstance(layer, float) and layer.is_integer():
            layer = int(layer)
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            # int(2.7) is 2: a fractional layer would steer a layer nobody asked for
            raise UsageError(f"layer must be a whole residual index 0..n_layers, got {self.layer!r}")
        if int(layer) < 0:
            raise UsageError(f"layer is a residual index 0..n_layers, got {self.layer}")
        self.layer = int(layer)
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} unknown; use one of {', '.join(KINDS)}")

    @property
    def meta(self) -> dict[str, Any]:
        """Alias of :attr:`metadata` (older call sites)."""
        return self.metadata

    @property
    def d_model(self) -> int:
        return int(self.vector.shape[0])

    @property
    def norm(self) -> float:
        return float(self.vector.float().norm())

    @property
    def resid_norm(self) -> float | None:
        r = self.metadata.get("resid_norm")
        return float(r) if r else None

    def describe(self, alpha: float | None = None) -> str:
        """One line: kind, where it is added, ``|v|`` relative to the layer's mean residual norm.

        Print it next to every steering result: an alpha is only interpretable together with
        ``alpha * |v| / |h|``.
        """
        where = "input of block 0" if self.layer == 0 else f"output of block {self.layer - 1}"
        s = f"{self.kind} vector at residual index {self.layer} ({where}): |v| = {self.norm:.4g}"
        ref = self.resid_norm
        if ref:
            pos = self.metadata.get("position", "boundary")
            s += f" = {self.norm / ref:.3f} x mean {pos} residual norm ({ref:.4g})"
        if "n_pos" in self.metadata and "n_neg" in self.metadata:
            s += f"; from {self.metadata['n_pos']} genuine / {self.metadata['n_neg']} not"
        if alpha is not None:
            s += f"; alpha {alpha:g} adds |alpha v| = {abs(alpha) * self.norm:.4g}"
            if ref:
                s += f" ({abs(alpha) * self.norm / ref:.3f} x residual norm)"
        return s

    def scaled(self, alpha: float) -> torch.Tensor:
        """``alpha * v`` in float32 (what :func:`steer` adds and :func:`bake` folds in)."""
        return float(alpha) * self.vector.detach().float()

    def negated(self) -> SteeringVector:
        """``-v`` (control: if steering works, the negative vector should lower follow-up)."""
        return SteeringVector(-self.vector, self.layer, "negative", {**self.metadata, "source_kind": self.kind})

    def random_like(self, seed: int = 0, orthogonal: bool = True) -> SteeringVector:
        """See :func:`random_like`."""
        return random_like(self, seed, orthogonal)

    @classmethod
    def from_probe(cls, probe: LinearProbe, norm: float | None = None) -> SteeringVector:
        """A ``"probe"`` vector along a :class:`~mechprobe.linear.linear_probe.LinearProbe`'s direction.

        Its norm defaults to the class gap (the difference-of-means norm) of the rows the probe was fitted on,
        the convention that puts every vector kind on one raw scale (:func:`from_direction`); the probe's
        ``resid_norm`` travels along, so :meth:`apply` can take alpha in residual-norm units.

        Args:
            probe: a fitted :class:`~mechprobe.linear.linear_probe.LinearProbe` (:func:`fit_probe`).
            norm: the raw norm to give the vector; None (default) = the probe's ``diff_means_norm``.

        Returns:
            A :class:`SteeringVector` of kind ``"probe"`` at ``probe.layer`` pointing towards genuine follow-ups,
            with the probe's provenance (``model``, ``weight_hash``, ``source_run``, ``resid_norm``, ``probe_auroc``).
        """
        if not isinstance(probe, LinearProbe):
            raise TypeError(f"from_probe needs a LinearProbe (from fit_probe), got {type(probe).__name__}")
        scale = float(norm) if norm is not None else float(probe.metadata.get("diff_means_norm", 0.0))
        meta = {k: probe.metadata[k] for k in ("model", "weight_hash", "source_run", "resid_norm") if k in probe.metadata}
        meta.update(position=probe.position, probe_auroc=probe.auroc, n_pos=probe.n_pos, n_neg=probe.n_neg)
        return from_direction(probe.direction, scale, layer=probe.layer, kind="probe", **meta)

    def apply(self, model: Any, alpha: float, *, unit: str = "resid", positions: str = "boundary+generated"
              ) -> contextlib.AbstractContextManager[None]:
        """Steer ``model`` by ``alpha`` along this vector inside a ``with`` block; hooks always come off.

        ``unit="resid"`` (default, the package's unit, as in ``mechprobe steer``): the added vector's norm is
        ``alpha`` x the layer's mean residual norm at the boundary (``metadata["resid_norm"]``), so ``alpha = 0.2``
        is a push of a fifth of the residual's size in any model and layer, and every kind gets the same norm
        at the same alpha. ``unit="raw"``: the residual becomes ``h + alpha * vector`` (CAA; ``alpha = 1`` = one
        class gap for a difference-of-means vector). ``alpha = 0`` is token-identical to no steering.
        See docs/steering.md.

        Args:
            model: a :class:`~mechprobe.lm.models.LoadedModel` (its weight hash is checked against the vector's)
                or an HF causal LM.
            alpha: the strength, in ``unit``; finite, negative pushes away from genuine follow-ups.
            unit: ``"resid"`` (default) or ``"raw"``.
            positions: where to add it: ``"boundary+generated"`` (default), ``"boundary"``, ``"generated"`` or
                ``"all"`` (see :func:`steer`).

        Returns:
            A context manager; the hooks are registered on entry and removed on exit, also after an exception.

        Raises:
            UsageError: an unknown unit or positions, ``unit="resid"`` on a vector without ``resid_norm``, or a
                vector built for another model.
        """
        return steer(model, in_alpha_units(self, unit), alpha, positions)

    def save(self, path: str | Path) -> Path:
        """Write ``<path>.safetensors`` (the vector) and ``<path>.json`` (layer, kind, metadata)."""
        base = _base_path(path)
        base.parent.mkdir(parents=True, exist_ok=True)
        st = base.with_name(base.name + ".safetensors")
        info = {"format": FORMAT, "layer": self.layer, "kind": self.kind, "d_model": self.d_model,
                "norm": self.norm, "metadata": self.metadata}
        save_file({"vector": self.vector.detach().float().contiguous().cpu()}, str(st),
                  metadata={"format": FORMAT, "layer": str(self.layer), "kind": self.kind})
        side = base.with_name(base.name + ".json")
        tmp = side.with_name(side.name + ".tmp")
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")
        tmp.replace(side)
        return st

    @classmethod
    def load(cls, path: str | Path) -> SteeringVector:
        """Read what :meth:`save` wrote; ``path`` may name the base, the .safetensors or the .json file."""
        base = _base_path(path)
        st, side = base.with_name(base.name + ".safetensors"), base.with_name(base.name + ".json")
        for p in (st, side):
            if not p.exists():
                raise MissingInput(f"steering vector file {p} is missing; SteeringVector.save writes both "
                                        f"{st.name} and {side.name}")
        info = json.loads(side.read_text())
        v = load_file(str(st))["vector"]
        if int(info.get("d_model", v.shape[0])) != v.shape[0]:
            raise ValueError(f"{st} holds {v.shape[0]} dims but {side} says {info['d_model']}: the files are from "
                             "different vectors")
        return cls(v, int(info["layer"]), info["kind"], info.get("metadata", info.get("meta", {})))


def _base_path(path: str | Path) -> Path:
    # Not Path.with_suffix: "vector_alpha_1.5" would lose ".5".
    p = Path(path)
    for suf in (".safetensors", ".json"):
        if p.name.endswith(suf):
            return p.with_name(p.name[: -len(suf)])
    return p


def diff_of_means(x_pos: torch.Tensor | ActivationCache, x_neg: torch.Tensor | int | None = None,
                  layer: int | None = None, *, labels: Any = None, position: str = "boundary",
                  weight_hash: str | None = None, source_run: str | None = None, resid_norm: float | None = None,
                  **extra: Any) -> SteeringVector:
    """``mean(x_pos) - mean(x_neg)`` (rows: examples, columns: d_model), the CAA vector; or straight from a cache.

    Two forms: ``diff_of_means(x_pos, x_neg, layer)`` on tensors, and ``diff_of_means(cache, layer)`` on an
    :class:`~mechprobe.activations.cache.ActivationCache`, which splits the cache's labelled rows at ``layer``
    by the judge's labels (or ``labels``) and records the cache's model, weight hash and run.
    ``resid_norm`` defaults to the mean L2 norm of all rows (both classes): the layer's typical
    residual size at ``position``, which :meth:`SteeringVector.describe` divides by and
    :meth:`SteeringVector.apply` takes alpha in units of.

    Args:
        x_pos: ``[n_pos, d_model]`` activations of the genuine follow-ups (label 1), computed in float32; or an
            ``ActivationCache``.
        x_neg: ``[n_neg, d_model]`` activations of the other turns (label 0), same ``d_model``; with a cache,
            the layer (``diff_of_means(cache, 12)``) or None when ``layer=`` is given.
        layer: residual index the rows were read at (0 = embeddings, ``r`` = input of block ``r``), which is
            where the vector will be added.
        labels: with a cache only: one label per cache row (1 genuine, 0 not, NaN/None left out); None
            (default) = the judge's ``labels.jsonl`` beside the cache.
        position: where the rows were read (recorded in the metadata; default ``"boundary"``); with a cache,
            the cached position to read.
        weight_hash: hash of the model the activations came from; None (default) records nothing (a cache's
            own hash is used). With it, :func:`steer` refuses a :class:`~mechprobe.lm.models.LoadedModel`
            with other weights.
        source_run: run directory the activations came from; None records nothing (a cache's run is used).
        resid_norm: the yardstick for ``|v|``; None (default) = mean L2 norm of all rows of both classes.
        **extra: further metadata entries, stored as given (None values are dropped).

    Returns:
        A :class:`SteeringVector` of kind ``"diff_means"`` with ``vector`` ``[d_model]`` float32 (raw units:
        ``alpha = 1`` is one class gap) and metadata ``n_pos``, ``n_neg``, ``resid_norm``, ``position``.

    Raises:
        ValueError: the inputs are not 2-D with one ``d_model``, or a class has no rows.
        UsageError: with a cache, no layer, a layer or position not cached, or malformed ``labels``.

    Example:
        >>> import torch
        >>> from mechprobe import diff_of_means
        >>> _ = torch.manual_seed(0)
        >>> x_pos, x_neg = torch.randn(8, 16) + 1.0, torch.randn(8, 16)
        >>> v = diff_of_means(x_pos, x_neg, layer=3)
        >>> v.vector.shape, v.kind, v.layer
        (torch.Size([16]), 'diff_means', 3)
        >>> torch.allclose(v.vector, x_pos.mean(0) - x_neg.mean(0))
        True
        >>> v.metadata["n_pos"], v.metadata["n_neg"], v.metadata["position"]
        (8, 8, 'boundary')
        >>> from mechprobe import ActivationCache
        >>> v = diff_of_means(ActivationCache.load("runs/smol-gsm8k"), 12)     # doctest: +SKIP
    """
    if isinstance(x_pos, ActivationCache):
        cache = x_pos
        if layer is None and isinstance(x_neg, int):
            layer, x_neg = x_neg, None
        if layer is None or x_neg is not None:
            raise UsageError("diff_of_means(cache, layer): pass the cache and a layer (tensors go as "
                             "diff_of_means(x_pos, x_neg, layer))")
        if position not in cache.positions:
            raise UsageError(f"position {position!r} is not cached here (cached: {', '.join(cache.positions)})")
        X, y, _, _ = cache.dataset(int(layer), position, labels=labels)
        model = extra.pop("model", cache.model_name)
        return diff_of_means(X[y == 1], X[y == 0], int(layer), position=position,
                             weight_hash=weight_hash or cache.weight_hash,
                             source_run=source_run or str(cache.path.parent), resid_norm=resid_norm, model=model,
                             **extra)
    if labels is not None:
        raise UsageError("labels= goes with diff_of_means(cache, layer); with tensors, split the rows yourself")
    if layer is None:
        raise UsageError("diff_of_means(x_pos, x_neg, layer) needs the layer the rows were read at")
    x_pos, x_neg = torch.as_tensor(x_pos), torch.as_tensor(x_neg)
    if x_pos.dim() != 2 or x_neg.dim() != 2 or x_pos.shape[1] != x_neg.shape[1]:
        raise ValueError(f"x_pos and x_neg must be [n, d_model] with the same d_model, got {tuple(x_pos.shape)} "
                         f"and {tuple(x_neg.shape)}")
    if len(x_pos) == 0 or len(x_neg) == 0:
        raise ValueError(f"need examples of both classes (got {len(x_pos)} positive, {len(x_neg)} negative): "
                         "label more user turns or pool more items")
    x_pos, x_neg = x_pos.float(), x_neg.float()
    v = x_pos.mean(0) - x_neg.mean(0)
    if resid_norm is None:
        resid_norm = float(torch.cat([x_pos, x_neg]).norm(dim=-1).mean())
    meta = {"n_pos": len(x_pos), "n_neg": len(x_neg), "resid_norm": float(resid_norm), "position": position,
            "weight_hash": weight_hash, "source_run": source_run, **extra}
    return SteeringVector(v, layer, "diff_means", {k: val for k, val in meta.items() if val is not None})


def from_direction(direction: torch.Tensor, ref_norm: float | SteeringVector, *, layer: int | None = None,
                   kind: str = "probe", **metadata: Any) -> SteeringVector:
    """A direction (e.g. a linear probe's weight) rescaled to ``ref_norm``, so alphas match diff-of-means.

    Pass the same layer's diff-of-means vector as ``ref_norm`` to take its norm, layer, ``resid_norm``,
    ``weight_hash`` and ``source_run``, and to record the cosine between the two directions. The sign
    of ``direction`` is kept: a probe trained with genuine = 1 points towards genuine follow-ups.

    Args:
        direction: any non-zero finite tensor with ``d_model`` entries (flattened, so a ``[1, d_model]``
            probe weight works); only its direction is used.
        ref_norm: the norm to give the result: a positive number, or a :class:`SteeringVector` whose norm,
            layer and provenance (``resid_norm``, ``position``, ``weight_hash``, ``source_run``) are taken;
            the cosine with it is stored as ``cos_with_reference``.
        layer: residual index of the result; None (default) takes the reference vector's layer, and is an
            error when ``ref_norm`` is a number.
        kind: the result's kind (default ``"probe"``).
        **metadata: further metadata entries; ``ref_norm`` (the norm used) is always recorded.

    Returns:
        A :class:`SteeringVector` ``[d_model]`` float32 pointing along ``direction`` with norm ``ref_norm``.

    Raises:
        ValueError: zero or non-finite direction, dimension mismatch with the reference, no layer, or a
            non-positive ``ref_norm``.

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector, from_direction
        >>> from_direction(torch.tensor([3.0, 4.0]), 10.0, layer=1).vector
        tensor([6., 8.])
        >>> ref = SteeringVector(torch.tensor([0.0, 5.0]), layer=1, metadata={"resid_norm": 20.0})
        >>> p = from_direction(torch.tensor([3.0, 4.0]), ref)
        >>> p.kind, p.layer, p.norm, round(p.metadata["cos_with_reference"], 3)
        ('probe', 1, 5.0, 0.8)
    """
    d = torch.as_tensor(direction).detach().float().flatten()
    if not torch.isfinite(d).all() or float(d.norm()) == 0.0:
        raise ValueError("direction is zero or not finite: nothing to steer along")
    meta: dict[str, Any] = {}
    if isinstance(ref_norm, SteeringVector):
        ref = ref_norm
        if ref.d_model != d.numel():
            raise ValueError(f"direction has {d.numel()} dims, reference vector {ref.d_model}")
        layer = ref.layer if layer is None else layer
        meta = {k: ref.metadata[k] for k in ("resid_norm", "position", "weight_hash", "source_run")
                if k in ref.metadata}
        meta["cos_with_reference"] = float(torch.nn.functional.cosine_similarity(d, ref.vector.float(), dim=0))
        meta["reference_kind"] = ref.kind
        scale = ref.norm
    else:
        scale = float(ref_norm)
    if layer is None:
        raise ValueError("from_direction needs layer= (or a reference SteeringVector as ref_norm)")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"ref_norm must be a positive number, got {scale}")
    meta.update(metadata)
    meta["ref_norm"] = scale
    return SteeringVector(d / d.norm() * scale, layer, kind, meta)


def random_like(vec: SteeringVector, seed: int = 0, orthogonal: bool = True) -> SteeringVector:
    """A random direction with ``vec``'s norm and layer: separates "this direction" from "any push this big".

    Drawn on the CPU from ``seed`` (the same on every machine). With ``orthogonal`` (default) the
    component along ``vec`` is removed first, so the control carries none of ``vec``'s direction.
    """
    g = torch.Generator().manual_seed(int(seed))
    r = torch.randn(vec.d_model, generator=g)
    v = vec.vector.detach().float().cpu()
    if orthogonal and float(v.norm()) > 0:
        u = v / v.norm()
        r = r - (r @ u) * u
    r = r / r.norm() * vec.norm
    meta = {**vec.metadata, "seed": int(seed), "orthogonal": bool(orthogonal), "source_kind": vec.kind}
    return SteeringVector(r.to(vec.vector.dtype), vec.layer, "random", meta)


def in_alpha_units(vec: SteeringVector, unit: str, resid_norm: float | None = None) -> SteeringVector:
    """``vec`` rescaled so that ``steer(model, result, alpha)`` adds ``alpha`` in ``unit``.

    * ``raw``: unchanged (CAA: ``alpha`` multiplies the raw vector, ``alpha = 1`` is one class gap).
    * ``resid``: ``v / |v| * resid_norm``, so ``alpha`` is the added vector's norm as a multiple of the
      layer's mean residual norm (``resid_norm``, default ``vec.resid_norm``). Why: a class gap is a
      different size in every model and layer, a fraction of the residual norm is not, so ``alpha = 0.2``
      means a comparable push everywhere; and every kind (diff-of-means, probe, random, negative) gets
      exactly the same norm at the same alpha, whatever its raw norm was.

    The unit and the yardstick are recorded in the metadata (``alpha_unit``, ``resid_norm``).
    :meth:`SteeringVector.apply` calls this for you (``unit="resid"`` by default).

    Args:
        vec: the :class:`SteeringVector` to rescale.
        unit: ``"raw"`` (unchanged) or ``"resid"`` (norm = the layer's mean residual norm).
        resid_norm: the yardstick for ``"resid"``; None (default) = ``vec.resid_norm`` from its metadata.

    Returns:
        A new :class:`SteeringVector` (same layer and kind) with ``alpha_unit`` recorded in its metadata.

    Raises:
        UsageError: an unknown unit, ``"resid"`` without a yardstick, or a zero vector.

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector, in_alpha_units
        >>> v = SteeringVector(torch.tensor([3.0, 4.0]), layer=1, metadata={"resid_norm": 20.0})
        >>> u = in_alpha_units(v, "resid")
        >>> u.norm, u.metadata["alpha_unit"]       # alpha 0.2 now adds a vector of norm 0.2 x 20
        (20.0, 'resid')
    """
    if unit not in ALPHA_UNITS:
        raise UsageError(f"alpha unit {unit!r}: use one of {', '.join(ALPHA_UNITS)}")
    ref = vec.resid_norm if resid_norm is None else float(resid_norm)
    if unit == "raw":
        meta = {**vec.metadata, "alpha_unit": "raw"}
        return SteeringVector(vec.vector, vec.layer, vec.kind, meta)
    if not ref or not math.isfinite(ref) or ref <= 0:
        raise UsageError(f"alpha unit 'resid' needs the layer's mean residual norm, but this {vec.kind} vector has "
                         f"none (resid_norm={ref}); build it with diff_of_means or pass resid_norm=")
    if vec.norm == 0.0:
        raise UsageError(f"{vec.kind} vector at layer {vec.layer} is zero: it has no direction to rescale")
    v = vec.vector.detach().float()
    meta = {**vec.metadata, "alpha_unit": "resid", "resid_norm": float(ref), "raw_norm": vec.norm}
    return SteeringVector((v / v.norm() * ref).to(vec.vector.dtype), vec.layer, vec.kind, meta)


# ----------------------------------------------------------------------------------------------------------
# Application


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


def _check(model: Any, vector: SteeringVector, alpha: float, positions: str) -> tuple[nn.Module, nn.ModuleList]:
    if positions not in STEER_POSITIONS:
        raise UsageError(f"positions={positions!r}: use one of {', '.join(STEER_POSITIONS)}")
    if not isinstance(vector, SteeringVector):
        raise TypeError(f"expected a SteeringVector, got {type(vector).__name__}; wrap a tensor with "
                        "SteeringVector(tensor, layer, kind)")
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
def steer(model: Any, vector: SteeringVector, alpha: float, positions: str = "boundary+generated"
          ) -> Iterator[None]:
    """Add ``alpha * vector`` to the residual stream at ``vector.layer`` while the context is open.

    Works for any forward-based decoding: :func:`mechprobe.lm.generation.generate`, HF ``generate`` (with
    or without its KV cache), plain forwards. Hooks are removed on exit, also after an exception.
    ``alpha == 0`` adds nothing, so outputs are token-identical to no steering. ``model`` may be an
    ``nn.Module`` or a :class:`~mechprobe.lm.models.LoadedModel`.

    Args:
        model: an HF causal LM (``nn.Module``) or a :class:`~mechprobe.lm.models.LoadedModel`; for the latter,
            a vector whose ``weight_hash`` names other weights is refused.
        vector: the :class:`SteeringVector`; added at residual index ``vector.layer`` (``r = 0``: input of
            block 0 via a forward pre-hook; ``r >= 1``: output of block ``r - 1`` via a forward hook).
        alpha: multiplier of the *raw* vector: the residual becomes ``h + alpha * v`` (``alpha = 1`` = one
            class gap for a diff-of-means vector; not a multiple of the residual norm unless the vector was
            rescaled with :func:`in_alpha_units` ``"resid"``). Must be finite.
        positions: ``"boundary"`` (last position of the prefill call only), ``"generated"`` (every position of
            calls on a non-empty KV cache, never the prefill), ``"boundary+generated"`` (default: both) or
            ``"all"`` (every position of every call, what :func:`bake` does).

    Returns:
        A context manager (yields None); the hooks are active inside the ``with`` block and removed on exit,
        also after an exception.

    Raises:
        UsageError: unknown ``positions``, non-finite ``alpha``, layer outside ``0..n_layers``, or a vector
            built for another model (``d_model`` or ``weight_hash`` mismatch).
        TypeError: ``vector`` is not a :class:`SteeringVector`.

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector, steer, tiny_model
        >>> model = tiny_model("llama")                   # random weights, d_model 64, 3 blocks
        >>> _ = torch.manual_seed(0)
        >>> vec = SteeringVector(torch.randn(64), layer=2)
        >>> ids = torch.tensor([[1, 2, 3, 4]])            # a prompt that ends at the boundary
        >>> with torch.no_grad():
        ...     base = model(ids).logits
        ...     with steer(model, vec, alpha=4.0, positions="boundary"):
        ...         steered = model(ids).logits
        ...     after = model(ids).logits
        >>> torch.equal(base[:, :-1], steered[:, :-1])  # positions before the boundary untouched
        True
        >>> torch.equal(base[:, -1], steered[:, -1])    # the boundary position is steered
        False
        >>> torch.equal(after, base)                      # hooks are gone after the block
        True
    """
    mod, blocks = _check(model, vector, alpha, positions)
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
    try:
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


def bake(model: nn.Module, vector: SteeringVector, alpha: float) -> nn.Module:
    """Fold ``alpha * v`` into the weights as the bias of block ``layer - 1``'s MLP ``down_proj``.

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
        alpha: multiplier of the raw vector, as in :func:`steer`: the bias is ``alpha * vector``.

    Returns:
        The same ``nn.Module``, modified in place: every MLP linear now has a bias (zero except block
        ``layer - 1``'s ``down_proj``), ``config.mlp_bias = True`` and ``config.mechprobe_steering`` records
        layer, alpha, kind, norm and ``positions="all"``.

    Raises:
        ValueError: ``vector.layer < 1``.
        NotImplementedError: the architecture has no ``mlp_bias`` switch or lacks the three MLP linears.
        UsageError: as in :func:`steer` (layer out of range, vector built for another model).

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector, bake, steer, tiny_model
        >>> _ = torch.manual_seed(0)
        >>> vec = SteeringVector(torch.randn(64), layer=2)
        >>> ids = torch.tensor([[1, 2, 3, 4]])
        >>> hooked = tiny_model("llama", seed=0)
        >>> with torch.no_grad(), steer(hooked, vec, alpha=4.0, positions="all"):
        ...     want = hooked(ids).logits
        >>> baked = bake(tiny_model("llama", seed=0), vec, alpha=4.0)
        >>> with torch.no_grad():
        ...     got = baked(ids).logits
        >>> torch.allclose(got, want, atol=1e-5), baked.config.mlp_bias
        (True, True)
        >>> baked.save_pretrained("steered-model")                          # doctest: +SKIP
    """
    mod, _ = _unwrap(model)
    _check(mod, vector, alpha, "all")
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
    cfg.mechprobe_steering = {"layer": vector.layer, "alpha": float(alpha), "kind": vector.kind,
                              "norm": vector.norm, "positions": "all",
                              **{k: vector.metadata[k] for k in ("weight_hash", "source_run") if k in vector.metadata}}
    return mod


# ----------------------------------------------------------------------------------------------------------
# nnsight


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
                     stop_ids: Sequence[int] | dict[int, str] | None = None, tokenizer: Any = None
                     ) -> list[list[int]]:
    """Greedy steered generation through nnsight, with the semantics of :func:`steer`.

    The path for models served remotely by NDIF (same intervention code, ``remote=True``). nnsight
    0.8 specifics: every generate step needs ``for step in tracer.all()``; ``step == 0`` is the
    prefill (so a one-token prompt is handled like :func:`steer` does); code after that open-ended
    loop never runs in the same invoke, so the ids are read in a second invoke. Returns the new
    tokens per prompt, cut after the first stop token (included), like
    :func:`mechprobe.lm.generation.generate`. ``tokenizer`` defaults to a placeholder (ids are passed
    directly); the caller's tokenizer is left as it was (nnsight sets left padding and a pad token).
    """

    mod, blocks = _check(model, vector, alpha, positions)
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
