"""Inside the model: each arm's boundary state projected onto the *base* model's difference-of-means direction
(genuine minus not-genuine follow-up), the per-item shift per layer with an item-bootstrap CI, in units of the
base model's class gap at that layer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file

from mechprobe.activations.cache import ActivationCache


def base_directions(base_run: Path, layers: Sequence[int]) -> tuple[dict[int, np.ndarray], str]:
    """Per layer, the base model's difference-of-means direction (genuine minus not), and where it came from.

    Read from ``<run>/probes/directions.safetensors`` when the probes stage wrote it; otherwise computed
    from the run's cache and labels (same definition as :func:`mechprobe.linear.turn.directions`). Empty when the
    base run has no positive or no negative turn (the direction is undefined then).
    """
    p = base_run / "probes" / "directions.safetensors"
    if p.exists():
        d = load_file(str(p))
        got = {la: d[f"diff_means_{la}"] for la in layers if f"diff_means_{la}" in d}
        if got:
            return got, str(p)

    cache = ActivationCache.load(base_run / "activations")
    out: dict[int, np.ndarray] = {}
    for la in layers:
        x, y, _, _ = cache.dataset(la)
        y = np.asarray(y).astype(bool)
        if y.all() or not y.any():
            return {}, f"not computable: {int(y.sum())} positive of {len(y)} judged base turns"
        x = np.asarray(x, dtype=np.float64)
        out[la] = (x[y].mean(0) - x[~y].mean(0)).astype(np.float32)
    return out, f"computed from {base_run}/activations and labels"


def _item_means(run: Path, layer: int, unit: np.ndarray) -> dict[str, float]:
    cache = ActivationCache.load(run / "activations")
    proj = cache.resid(layer).to(torch.float64).numpy() @ unit.astype(np.float64)
    acc: dict[str, list[float]] = {}
    for it, v in zip(cache.item_ids, proj):
        acc.setdefault(it, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def boundary_shift(base_run: Path, other_run: Path, directions: dict[int, np.ndarray], n_boot: int = 1000,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Per layer: mean over items of (other - base) projection of the boundary state on the base direction.

    The boundary state depends on the conversation (each arm answers the item itself), so the unit is the
    item: its rows share one boundary prompt. The CI resamples items. ``shift_gap`` divides by the base
    class gap (|diff of means|): 1.0 means the average state moved by one follow-up/non-follow-up gap.
    """
    rng = np.random.default_rng(seed)
    out = []
    for layer, d in sorted(directions.items()):
        gap = float(np.linalg.norm(d))
        if gap == 0:
            continue
        unit = d / gap
        a, b = _item_means(base_run, layer, unit), _item_means(other_run, layer, unit)
        items = sorted(set(a) & set(b))
        if not items:
            continue
        diff = np.array([b[i] - a[i] for i in items])
        boots = diff[rng.integers(0, len(diff), (n_boot, len(diff)))].mean(1)
        lo, hi = np.percentile(boots, [2.5, 97.5])
        out.append({"layer": layer, "n_items": len(items), "shift": float(diff.mean()), "ci": [float(lo), float(hi)],
                    "gap": gap, "shift_gap": float(diff.mean() / gap), "ci_gap": [float(lo / gap), float(hi / gap)]})
    return out
