"""The :class:`SteeringVector` and the rescalings that put every vector kind on one alpha scale.

**What ``alpha`` means** (one unit everywhere in the package). ``alpha`` is the added vector's norm as a
multiple of the layer's mean boundary residual norm (``metadata["resid_norm"]``, the yardstick): ``alpha = 0.2``
adds a vector a fifth as long as the residual itself, in any model and at any layer, and every vector kind
(difference of means, probe, random, negative) gets the same added norm at the same alpha. This holds for
:func:`~mechprobe.steering.intervene.steer`, :func:`~mechprobe.steering.intervene.bake`,
:meth:`SteeringVector.apply` and ``mechprobe steer`` alike (``unit="resid"``, the default of each).

``unit="raw"`` is the explicit CAA option on every one of them: the residual becomes ``h + alpha * v`` with ``v``
as stored; for the raw difference of means ``mean(h | genuine) - mean(h | not genuine)``, ``alpha = 1`` moves the
average non-follow-up boundary state onto the average follow-up state ("one class gap"). In raw units the other
kinds are put on the diff-of-means scale (a probe direction gets the diff-of-means norm, :func:`from_direction`;
the random control too, :func:`random_like`; the negative control is ``-v``). :func:`in_alpha_units` converts a
vector to either unit; :meth:`SteeringVector.describe` states ``|v|`` and the added norm relative to the layer's
mean residual norm, the number that says whether an alpha is gentle (~0.1) or destructive (~1).

Applying a vector to a model lives in :mod:`mechprobe.steering.hooks` (the positions and hooks) and
:mod:`mechprobe.steering.intervene` (:func:`~mechprobe.steering.intervene.steer`,
:func:`~mechprobe.steering.intervene.bake`); the difference of means in :mod:`mechprobe.steering.diff_means`.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mechprobe.errors import MissingInput, UsageError
from mechprobe.linear.linear_probe import LinearProbe
from mechprobe.steering.hooks import _steered
from mechprobe.steering.kind_registry import vector_kind

ALPHA_UNITS = ("raw", "resid")
FORMAT = "mechprobe.steering_vector/1"
MAX_ABS_ALPHA = 1000.0  # any |alpha| past this is a typo: 1 already pushes by the residual norm or class gap


@dataclass
class SteeringVector:
    """A direction in the residual stream at residual index ``layer`` (0 = embeddings, r = output of block r-1).

    ``metadata`` carries what a later reader needs to trust the vector: ``weight_hash`` (model the
    activations came from), ``source_run``, ``position`` (where the activations were read, "boundary"),
    ``n_pos`` / ``n_neg`` (examples per class) and ``resid_norm`` (mean L2 norm of that residual at that
    position: the yardstick for ``|v|``).

    Args:
        vector: the direction, a finite 1-D tensor ``[d_model]`` (any float dtype; :meth:`scaled` returns
            float32). Only its direction matters at the default unit (alpha x ``resid_norm``); with
            ``unit="raw"`` its norm is what ``alpha`` multiplies.
        layer: residual index where the vector is added (TransformerLens ``resid_pre`` convention: ``r`` =
            input of block ``r``; 0 = embeddings, ``r >= 1`` = output of block ``r - 1``); must be >= 0.
        kind: a registered vector kind (:func:`~mechprobe.steering.kind_registry.vector_kinds`): ``"diff_means"``
            (default), ``"probe"``, ``"random"``, ``"negative"`` or one added under :mod:`mechprobe.steering.kinds`.
        metadata: provenance (see above); empty by default. :attr:`meta` is an alias.

    Raises:
        ValueError: ``vector`` is not a 1-D real tensor or has NaN/inf entries, ``layer`` is not a whole number
            >= 0 (:class:`~mechprobe.errors.UsageError`, a ``ValueError``), unknown ``kind``.

    Example:
        >>> import torch
        >>> from mechprobe import SteeringVector
        >>> v = SteeringVector(torch.ones(4), layer=2, metadata={"resid_norm": 10.0})
        >>> v.d_model, v.norm
        (4, 2.0)
        >>> v.describe(alpha=0.5)
        'diff_means vector at residual index 2 (output of block 1): |v| = 2 = 0.200 x mean boundary residual norm (10); alpha 0.5 adds a vector of norm 5 (0.500 x residual norm)'
        >>> v.describe(alpha=0.5, unit="raw")
        'diff_means vector at residual index 2 (output of block 1): |v| = 2 = 0.200 x mean boundary residual norm (10); alpha 0.5 (raw) adds |alpha v| = 1 (0.100 x residual norm)'
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
        vector_kind(self.kind)  # a UsageError (a ValueError) naming the registered kinds

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

    def describe(self, alpha: float | None = None, unit: str = "resid") -> str:
        """One line: kind, where it is added, ``|v|`` relative to the layer's mean residual norm.

        Print it next to every steering result: an alpha is only interpretable together with the added norm
        relative to ``|h|``. ``unit`` is the unit of ``alpha``, as in :func:`steer` (``"resid"``, default, or
        ``"raw"``).
        """
        if unit not in ALPHA_UNITS:
            raise UsageError(f"unit={unit!r}: use one of {', '.join(ALPHA_UNITS)}")
        where = "input of block 0" if self.layer == 0 else f"output of block {self.layer - 1}"
        s = f"{self.kind} vector at residual index {self.layer} ({where}): |v| = {self.norm:.4g}"
        ref = self.resid_norm
        if ref:
            pos = self.metadata.get("position", "boundary")
            s += f" = {self.norm / ref:.3f} x mean {pos} residual norm ({ref:.4g})"
        if "n_pos" in self.metadata and "n_neg" in self.metadata:
            s += f"; from {self.metadata['n_pos']} genuine / {self.metadata['n_neg']} not"
        if alpha is not None and unit == "raw":
            s += f"; alpha {alpha:g} (raw) adds |alpha v| = {abs(alpha) * self.norm:.4g}"
            if ref:
                s += f" ({abs(alpha) * self.norm / ref:.3f} x residual norm)"
        elif alpha is not None and ref:
            s += f"; alpha {alpha:g} adds a vector of norm {abs(alpha) * ref:.4g} ({abs(alpha):.3f} x residual norm)"
        elif alpha is not None:
            s += f"; alpha {alpha:g} needs resid_norm (or unit='raw') to be applied"
        return s

    def scaled(self, alpha: float) -> torch.Tensor:
        """``alpha * v`` in float32, ``v`` as stored (what :func:`steer` and :func:`bake` add with ``unit="raw"``,
        or after :func:`in_alpha_units` has rescaled the vector)."""
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

        The same as :func:`~mechprobe.steering.intervene.steer` ``(model, self, alpha, positions, unit=unit)``.
        ``unit="resid"`` (default, the package's unit, as in ``steer`` and ``mechprobe steer``): the added vector's norm is
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
            UsageError: ``alpha`` not a real number (a bool, a string), not finite or past :data:`MAX_ABS_ALPHA`
                (raised here, at the call); an unknown unit or positions, ``unit="resid"`` on a vector without
                ``resid_norm``, or a vector built for another model. The context may be entered again after it
                exits (the hooks are registered anew), not while it is open.
        """
        _check_alpha(alpha)
        return _Apply(model, in_alpha_units(self, unit), alpha, positions)

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
        try:  # a truncated or foreign file: name it, not a raw JSONDecodeError / SafetensorError
            info = json.loads(side.read_text())
            layer, kind = int(info["layer"]), info["kind"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
            raise UsageError(f"{side} is not a steering vector's description ({type(e).__name__}: {e}); it is "
                             f"truncated or another file: save the vector again (SteeringVector.save)") from None
        try:
            v = load_file(str(st))["vector"]
        except (SafetensorError, KeyError, OSError) as e:
            raise UsageError(f"{st} is not a readable steering vector ({type(e).__name__}: {e}); it is truncated "
                             f"or another file: save the vector again (SteeringVector.save)") from None
        if int(info.get("d_model", v.shape[0])) != v.shape[0]:
            raise ValueError(f"{st} holds {v.shape[0]} dims but {side} says {info['d_model']}: the files are from "
                             "different vectors")
        return cls(v, layer, kind, info.get("metadata", info.get("meta", {})))


class _Apply:
    """What :meth:`SteeringVector.apply` returns: a context manager that may be entered again once it has exited.

    Why not the generator context itself: a used one raised ``AttributeError: ... 'args'`` when entered again.
    """

    def __init__(self, model: Any, vector: SteeringVector, alpha: float, positions: str):
        self._args = (model, vector, alpha, positions)
        self._open: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        if self._open is not None:
            raise UsageError("this vec.apply(...) context is already open; exit it before entering it again")
        ctx = _steered(*self._args)
        ctx.__enter__()
        self._open = ctx

    def __exit__(self, *exc: Any) -> bool | None:
        ctx, self._open = self._open, None
        return ctx.__exit__(*exc) if ctx is not None else None


def _check_alpha(alpha: Any) -> None:
    """Refuse an alpha that is not a finite real number of sane size, naming it (a ``ValueError``).

    Why: ``True`` steered at 1, ``"0.2"`` was taken, and ``1e30`` overflowed the residual into empty text.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise UsageError(f"alpha must be a number (e.g. alpha=0.2), got {alpha!r} ({type(alpha).__name__})")
    if not math.isfinite(float(alpha)) or abs(float(alpha)) > MAX_ABS_ALPHA:
        raise UsageError(f"alpha must be finite and within +-{MAX_ABS_ALPHA:g} (1 is already a push of the whole "
                         f"residual norm or class gap), got {alpha!r}")


def _base_path(path: str | Path) -> Path:
    # Not Path.with_suffix: "vector_alpha_1.5" would lose ".5".
    p = Path(path)
    for suf in (".safetensors", ".json"):
        if p.name.endswith(suf):
            return p.with_name(p.name[: -len(suf)])
    return p


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
    """``vec`` rescaled so that ``steer(model, result, alpha, unit="raw")`` adds ``alpha`` in ``unit``.

    * ``raw``: unchanged (CAA: ``alpha`` multiplies the raw vector, ``alpha = 1`` is one class gap).
    * ``resid``: ``v / |v| * resid_norm``, so ``alpha`` is the added vector's norm as a multiple of the
      layer's mean residual norm (``resid_norm``, default ``vec.resid_norm``). Why: a class gap is a
      different size in every model and layer, a fraction of the residual norm is not, so ``alpha = 0.2``
      means a comparable push everywhere; and every kind (diff-of-means, probe, random, negative) gets
      exactly the same norm at the same alpha, whatever its raw norm was.

    The unit and the yardstick are recorded in the metadata (``alpha_unit``, ``resid_norm``).
    :func:`~mechprobe.steering.intervene.steer`, :func:`~mechprobe.steering.intervene.bake` and
    :meth:`SteeringVector.apply` call this for you (``unit="resid"`` by default).

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
                         f"none (resid_norm={ref}); build it with diff_of_means (which records it), pass "
                         "resid_norm=, or steer with unit='raw' (alpha multiplies the vector as stored)")
    if vec.metadata.get("alpha_unit") == "resid" and math.isclose(vec.norm, ref, rel_tol=1e-6):
        return vec  # already in resid units: converting twice must not change a bit
    if vec.norm == 0.0:
        raise UsageError(f"{vec.kind} vector at layer {vec.layer} is zero: it has no direction to rescale")
    v = vec.vector.detach().float()
    meta = {**vec.metadata, "alpha_unit": "resid", "resid_norm": float(ref), "raw_norm": vec.norm}
    return SteeringVector((v / v.norm() * ref).to(vec.vector.dtype), vec.layer, vec.kind, meta)
