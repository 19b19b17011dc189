"""The difference-of-means steering vector (CAA), from activation tensors or straight from an activation cache."""

from __future__ import annotations

from typing import Any

import torch

from mechprobe.activations.cache import ActivationCache
from mechprobe.errors import UsageError
from mechprobe.steering.steering_vector import SteeringVector


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
