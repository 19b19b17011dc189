"""Item-level targets: each item's follow-up propensity at one temperature, its greedy label and its samples."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mechprobe.errors import UserError


@dataclass
class ItemTargets:
    """Per-item targets at one temperature; arrays are aligned with ``keys``.

    ``keys`` are ``dataset::item_id`` (unique across pooled runs); ``samples`` keeps each item's judged
    sampled verdicts (1/0) in sample order, for the split-half ceiling.
    """

    keys: list[str]
    item_ids: list[str]
    datasets: list[str]
    propensity: np.ndarray  # fraction genuine among the item's judged samples at ``temperature``
    k: np.ndarray  # judged samples per item
    greedy: np.ndarray  # greedy turn judged genuine: 1.0 / 0.0, NaN when absent or a judge error
    samples: list[list[int]]
    temperature: float
    min_samples: int
    n_dropped: int = 0  # items with fewer than min_samples judged samples
    dropped: list[str] = field(default_factory=list)
    n_judge_errors: int = 0  # sampled or greedy rows skipped as judge_error / unjudged

    def __len__(self) -> int:
        return len(self.keys)

    def subset(self, idx: Sequence[int] | np.ndarray) -> ItemTargets:
        idx = [int(i) for i in idx]
        return ItemTargets([self.keys[i] for i in idx], [self.item_ids[i] for i in idx],
                           [self.datasets[i] for i in idx], self.propensity[idx], self.k[idx], self.greedy[idx],
                           [self.samples[i] for i in idx], self.temperature, self.min_samples, self.n_dropped,
                           list(self.dropped), self.n_judge_errors)

    def summary(self) -> dict[str, Any]:
        return {"items": len(self), "temperature": self.temperature, "min_samples": self.min_samples,
                "dropped_items": self.n_dropped, "judge_errors_skipped": self.n_judge_errors,
                "k_per_item": {str(k): n for k, n in sorted(Counter(self.k.tolist()).items())},
                "mean_propensity": float(self.propensity.mean()) if len(self) else None,
                "items_with_any_genuine": int((self.propensity > 0).sum()),
                "greedy_judged": int(np.isfinite(self.greedy).sum()),
                "greedy_genuine": int(np.nansum(self.greedy)),
                "datasets": dict(Counter(self.datasets))}


def item_key(dataset: str, item_id: str) -> str:
    return f"{dataset}::{item_id}"


def _get(r: Any, name: str) -> Any:
    return r[name] if isinstance(r, Mapping) else getattr(r, name)


def item_targets(user_turn_records: Sequence[Any], label_records: Sequence[Any], temperature: float = 1.0,
                 min_samples: int = 2) -> ItemTargets:
    """Follow-up propensity and greedy label per item from user-turn and label records (dicts or dataclasses).

    Sampled turns at ``temperature`` with a verdict (``genuine`` True/False) count; ``judge_error`` rows
    (``genuine`` None) and unjudged rows are skipped and counted. Items with fewer than ``min_samples``
    judged samples are dropped (a propensity from one sample is a coin, and the split-half ceiling needs
    two). Item order is first appearance in ``user_turn_records``.
    """
    if min_samples < 1:
        raise UserError(f"min_samples must be >= 1, got {min_samples}")
    verdict = {_get(r, "record_id"): _get(r, "genuine") for r in label_records}
    order: dict[str, tuple[str, str]] = {}
    samples: dict[str, list[int]] = {}
    greedy: dict[str, float] = {}
    temps: set[float] = set()
    n_err = 0
    for r in user_turn_records:
        key = item_key(_get(r, "dataset"), _get(r, "item_id"))
        order.setdefault(key, (_get(r, "dataset"), _get(r, "item_id")))
        samples.setdefault(key, [])
        g = verdict.get(_get(r, "record_id"))
        if _get(r, "decoding") == "greedy":
            if g is None:
                n_err += 1
            else:
                greedy[key] = float(bool(g))
            continue
        t = float(_get(r, "temperature"))
        temps.add(t)
        if not math.isclose(t, temperature, rel_tol=0, abs_tol=1e-9):
            continue
        if g is None:
            n_err += 1
            continue
        samples[key].append(int(bool(g)))
    if not any(samples.values()) and temperature not in temps:
        raise UserError(f"no sampled user turns at temperature {temperature:g} (the run has "
                        f"{sorted(temps) or 'greedy turns only'}): pass propensity_temperature=, or probe with "
                        f"temperatures=0 {temperature:g} samples=8")
    keep = [k for k in order if len(samples[k]) >= min_samples]
    dropped = [k for k in order if len(samples[k]) < min_samples]
    return ItemTargets(keys=keep, item_ids=[order[k][1] for k in keep], datasets=[order[k][0] for k in keep],
                       propensity=np.array([np.mean(samples[k]) for k in keep], dtype=float),
                       k=np.array([len(samples[k]) for k in keep], dtype=int),
                       greedy=np.array([greedy.get(k, np.nan) for k in keep], dtype=float),
                       samples=[samples[k] for k in keep], temperature=float(temperature), min_samples=min_samples,
                       n_dropped=len(dropped), dropped=dropped, n_judge_errors=n_err)


def above_median(p: np.ndarray) -> np.ndarray:
    """1 where the propensity is strictly above the median of all items.

    Strictly above: many items sit at 0 (or one common value), and ``>=`` would put the tied mass in the
    positive class, so "above the median" would then mean "at least as high as most", the opposite.
    """
    p = np.asarray(p, float)
    return (p > np.median(p)).astype(int)


def concat_targets(ts: Sequence[ItemTargets]) -> ItemTargets:
    keys = [k for t in ts for k in t.keys]
    dup = [k for k, n in Counter(keys).items() if n > 1]
    if dup:
        raise UserError(f"item {dup[0]} appears in two runs: pool runs of different datasets (or data files)")
    return ItemTargets(keys, [i for t in ts for i in t.item_ids], [d for t in ts for d in t.datasets],
                       np.concatenate([t.propensity for t in ts]), np.concatenate([t.k for t in ts]),
                       np.concatenate([t.greedy for t in ts]), [s for t in ts for s in t.samples],
                       ts[0].temperature, ts[0].min_samples, sum(t.n_dropped for t in ts),
                       [d for t in ts for d in t.dropped], sum(t.n_judge_errors for t in ts))
