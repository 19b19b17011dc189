"""One linear probe on one layer of an activation cache, as a small object for notebooks and scripts.

``mechprobe probes`` fits every layer with controls and writes reports; :func:`fit_probe` is the same
logistic fit (standardised features, C chosen by item-grouped inner CV, class-balanced) for one layer,
returned as a :class:`LinearProbe` whose direction can be turned into a steering vector
(:meth:`mechprobe.steering.vector.SteeringVector.from_probe`). Named *linear* probe because "probe" in
mechprobe is the user-turn probe (``mechprobe probe``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mechprobe.activations.cache import ActivationCache
from mechprobe.errors import UsageError
from mechprobe.linear.fit import InsufficientPositives, auroc, fit_logreg, make_folds
from mechprobe.linear.turn import oof_scores


@dataclass
class LinearProbe:
    """A logistic probe for "this boundary state precedes a genuine follow-up" at one residual index.

    Made by :func:`fit_probe`. ``score(X) = X @ weight + bias`` is the fitted logistic decision function in
    residual coordinates (> 0: predicted genuine); ``direction`` is ``weight`` scaled to unit norm, the
    direction to steer along.

    Attributes:
        direction: unit float32 tensor ``[d_model]`` pointing towards genuine follow-ups (label 1).
        weight: float32 tensor ``[d_model]``, the logistic weights mapped back to residual coordinates
            (``w_std / sigma`` of the standardising scaler).
        bias: the decision function's intercept in residual coordinates.
        layer: residual index the probe reads (0 = embeddings, ``r`` = input of block ``r``).
        position: the cached position it reads (``"boundary"`` by default).
        auroc: item-grouped cross-validated AUROC of held-out rows (each row scored by a probe fitted
            without its item); NaN when the rows are too few for grouped CV (see ``metadata["cv"]``).
        train_auroc: AUROC on the rows it was fitted on (optimistic; a sanity check, not a result).
        c: the inverse regularisation strength chosen by grouped inner CV.
        n_pos: genuine rows fitted on; ``n_neg``: other rows; ``n_items``: distinct items among them.
        metadata: provenance: ``model``, ``weight_hash``, ``source_run``, ``resid_norm`` (mean L2 norm of the
            fitted rows: the yardstick of steering alphas), ``diff_means_norm`` (the class gap's norm), ``cv``.

    Example:
        >>> import numpy as np, torch
        >>> from mechprobe import LinearProbe
        >>> p = LinearProbe(direction=torch.tensor([0.6, 0.8]), weight=torch.tensor([3.0, 4.0]), bias=-1.0,
        ...                 layer=2, position="boundary", auroc=float("nan"), train_auroc=1.0, c=1.0,
        ...                 n_pos=4, n_neg=4, n_items=8)
        >>> p.score(np.array([[1.0, 1.0], [0.0, 0.0]]))     # numpy in, numpy out
        array([ 6., -1.])
        >>> p.score(torch.tensor([1.0, 1.0]))              # one row as a torch tensor
        array([6.])
    """

    direction: torch.Tensor
    weight: torch.Tensor
    bias: float
    layer: int
    position: str
    auroc: float
    train_auroc: float
    c: float
    n_pos: int
    n_neg: int
    n_items: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def score(self, X: torch.Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
        """The decision function ``X @ weight + bias`` per row (float64 numpy ``[n]``; > 0 = predicted genuine).

        ``X`` is ``[n, d_model]`` or one row ``[d_model]``, torch (any dtype or device) or numpy.
        """
        x = X.detach().float().cpu().numpy() if isinstance(X, torch.Tensor) else np.asarray(X, dtype=np.float64)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] != self.weight.numel():
            raise UsageError(f"score() needs rows of {self.weight.numel()} values ([n, d_model] or [d_model]), got "
                             f"shape {tuple(x.shape)}")
        return x.astype(np.float64) @ self.weight.double().numpy() + float(self.bias)

    def __repr__(self) -> str:
        cv = "n/a" if math.isnan(self.auroc) else f"{self.auroc:.3f}"
        return (f"LinearProbe(layer={self.layer}, position={self.position!r}, auroc={cv} (grouped CV), "
                f"train_auroc={self.train_auroc:.3f}, n_pos={self.n_pos}, n_neg={self.n_neg}, "
                f"n_items={self.n_items}, model={self.metadata.get('model')!r})")


def fit_probe(cache: ActivationCache, layer: int,
              labels: Sequence[float | bool | None] | np.ndarray | torch.Tensor | None = None, *,
              position: str = "boundary", folds: int = 5, seed: int = 0) -> LinearProbe:
    """Fit a logistic probe at ``layer`` on the cache's labelled rows and cross-validate it by item.

    Same fit as ``mechprobe probes`` (standardised features, class-balanced logistic regression, C chosen
    by item-grouped inner CV), so a probe here and the command's metrics agree. Folds are grouped by item
    because an item's greedy and sampled turns share one boundary state: an ungrouped split would score
    rows whose exact input the probe was trained on.

    Args:
        cache: an :class:`~mechprobe.activations.cache.ActivationCache` (``ActivationCache.load(run)``).
        layer: a cached residual index (0 = embeddings, ``r`` = input of block ``r``).
        labels: one label per cache row, in ``cache.record_ids`` order (1/True genuine follow-up, 0/False not,
            NaN/None = leave the row out); None (default) = the judge's labels stored with the run
            (``labels.jsonl`` beside the cache).
        position: a cached position (default ``"boundary"``, the user-role boundary).
        folds: outer folds of the grouped cross-validation behind ``auroc`` (default 5); 0 skips it (faster;
            ``auroc`` is then NaN).
        seed: seed of the folds and the fit (default 0).

    Returns:
        A :class:`LinearProbe` fitted on all labelled rows, with its unit ``direction``, ``score()``, the grouped
        CV ``auroc`` (NaN when there are too few positives or items for ``folds`` folds: ``metadata["cv"]``
        says why) and ``train_auroc``.

    Raises:
        UsageError: ``cache`` is not an ActivationCache, ``layer`` is not an int, the layer or position is not
            cached, or ``labels`` has the wrong length or values.
        MissingInput: ``labels`` is None and the run has no ``labels.jsonl`` (judge it first).
        InsufficientPositives: fewer than 2 rows of either class.

    Example:
        >>> from mechprobe import ActivationCache, fit_probe
        >>> cache = ActivationCache.load("runs/smol-gsm8k")                    # doctest: +SKIP
        >>> probe = fit_probe(cache, layer=12)                                 # doctest: +SKIP
        >>> probe.direction.norm(), probe.auroc                                # doctest: +SKIP
        (tensor(1.), 0.55...)
        >>> probe.score(cache.resid(12)[:3])                                   # doctest: +SKIP
        array([-0.41..., 0.12..., -1.3...])
    """
    if not isinstance(cache, ActivationCache):  # None or a path used to fail as an AttributeError naming nothing
        hint = f": load it first, fit_probe(ActivationCache.load({str(cache)!r}), ...)" if isinstance(cache, str) else ""
        raise UsageError(f"fit_probe: cache must be an ActivationCache, got {type(cache).__name__}{hint}")
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise UsageError(f"fit_probe: layer must be an int (a cached residual index, cached: {list(cache.layers)}), "
                         f"got {layer!r} ({type(layer).__name__})")
    layer = int(layer)
    if position not in cache.positions:
        raise UsageError(f"position {position!r} is not cached here (cached: {', '.join(cache.positions)})")
    if folds < 0:
        raise UsageError(f"folds must be >= 0 (0 skips cross-validation), got {folds}")
    X, y_t, groups_l, _ = cache.dataset(layer, position, labels=labels)
    y = y_t.numpy().astype(int)
    n_pos, n_neg = int(y.sum()), int(len(y) - y.sum())
    if n_pos < 2 or n_neg < 2:
        raise InsufficientPositives(f"fit_probe needs at least 2 rows of each class, got {n_pos} genuine and {n_neg} "
                                    "other labelled rows: probe and judge more items (or samples per item)")
    x = X.double().numpy()
    groups = np.asarray(groups_l)
    fit = fit_logreg(x, y, groups, seed)
    scaler, lr = fit.model.steps[0][1], fit.model.steps[1][1]
    w = lr.coef_[0] / scaler.scale_
    b = float(lr.intercept_[0] - np.sum(lr.coef_[0] * scaler.mean_ / scaler.scale_))
    weight = torch.from_numpy(w.astype(np.float32))
    cv_auroc, cv_note = float("nan"), "skipped (folds=0)"
    if folds:
        try:
            fs = make_folds(y, groups, n_splits=folds, seed=seed)
            cv_auroc, cv_note = auroc(y, oof_scores(x, y, groups, fs, "logreg", seed)), f"{folds}-fold, grouped by item"
        except InsufficientPositives as e:
            cv_note = f"not computed: {e}"
    meta = {"model": cache.model_name, "weight_hash": cache.weight_hash, "source_run": str(cache.path.parent),
            "resid_norm": float(X.norm(dim=-1).mean()),
            "diff_means_norm": float((X[y_t == 1].mean(0) - X[y_t == 0].mean(0)).norm()), "cv": cv_note}
    return LinearProbe(direction=weight / weight.norm(), weight=weight, bias=b, layer=int(layer), position=position,
                       auroc=cv_auroc, train_auroc=auroc(y, x @ w + b), c=fit.c, n_pos=n_pos, n_neg=n_neg,
                       n_items=len(set(groups_l)), metadata={k: v for k, v in meta.items() if v is not None})
