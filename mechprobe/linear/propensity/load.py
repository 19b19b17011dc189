"""Reading runs for the propensity probes: which target a run supports, and one boundary state per item."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.activations.cache import ActivationCache, parse_layers
from mechprobe.errors import UsageError, UserError
from mechprobe.io import read_jsonl, shell_arg
from mechprobe.linear.propensity.targets import ItemTargets, concat_targets, item_key, item_targets

# Rows of one item come from one forward pass per unique prompt, so they are bit-identical in practice;
# the tolerance only allows for storage round-off (float16 holds ~3e-4 relative) should a backend ever
# recompute them.
SAME_STATE_RTOL = 1e-3


# Fewer sampled turns per item than this and the propensity is too coarse (steps of 1/k) to be the
# default target; the turn-level probe runs instead unless --target propensity is asked for.
AUTO_MIN_SAMPLES = 8


def choose_target(requested: str | None, samples: int, temperatures: Sequence[float], temperature: float
                  ) -> tuple[str, str]:
    """(``propensity`` | ``turn``, why). ``auto`` picks propensity when the run has >= 8 samples at ``temperature``."""
    if requested in ("propensity", "turn"):
        return requested, f"asked for with target={requested}"
    if requested not in (None, "auto"):
        raise UsageError(f"target={requested!r}: must be propensity, turn or auto")
    at_t = samples if any(math.isclose(float(t), temperature, abs_tol=1e-9) for t in temperatures) else 0
    if at_t >= AUTO_MIN_SAMPLES:
        return "propensity", (f"the run has {at_t} samples per item at T = {temperature:g} (>= {AUTO_MIN_SAMPLES}), "
                              "so the item-level propensity is the primary target")
    return "turn", (f"the run has {at_t} samples per item at T = {temperature:g} (< {AUTO_MIN_SAMPLES} needed for a "
                    "usable propensity); probe with samples=8 or pass target=propensity")


def one_row_per_item(rows: np.ndarray, row_keys: Sequence[str], keys: Sequence[str],
                     rtol: float = SAME_STATE_RTOL) -> np.ndarray:
    """``[len(keys), ...]``: the first row of each item, after checking all its rows hold the same state.

    Every turn of an item is generated from one boundary state, so its cached rows should be identical;
    this asserts it (within ``rtol`` of the row's scale) instead of assuming it, because a cache whose
    rows differ within an item (e.g. a variant prompt) would make "the item's state" ambiguous.
    """
    by: dict[str, list[int]] = {}
    for i, k in enumerate(row_keys):
        by.setdefault(k, []).append(i)
    missing = [k for k in keys if k not in by]
    if missing:
        raise UserError(f"{len(missing)} item(s) have labels but no cached activations (e.g. {missing[0]}): "
                        "re-run the cache stage")
    out = np.empty((len(keys), *rows.shape[1:]), dtype=np.float32)
    for j, k in enumerate(keys):
        idx = by[k]
        first = np.asarray(rows[idx[0]], np.float32)
        if len(idx) > 1:
            diff = float(np.abs(np.asarray(rows[idx], np.float32) - first).max())
            scale = float(np.abs(first).max())
            if diff > rtol * scale + 1e-6:
                raise UserError(f"the cached rows of item {k} differ (max |diff| {diff:.3g} vs scale {scale:.3g}): "
                                "its turns do not share one boundary state, so an item-level probe is undefined")
        out[j] = first
    return out


@dataclass
class ItemStates:
    """One boundary state per item (pooled over runs), with targets and the text-only inputs."""

    stack: np.ndarray  # [n_items, len(layers), d] float32
    layers: list[int]
    targets: ItemTargets
    texts: list[str]  # prompt + assistant response: what the model saw before the boundary
    response_tokens: np.ndarray
    weight_hash: str
    runs: list[str]


def load_item_states(runs: Sequence[Path], layers_arg: Any, temperature: float = 1.0, min_samples: int = 2
                     ) -> ItemStates:
    """Boundary states, propensity targets and texts of every item of ``runs`` (one model), pooled."""

    parts, stacks, texts, toks = [], [], [], []
    layers: list[int] | None = None
    weight_hash = None
    for run in runs:
        run = Path(run)
        cache = ActivationCache.load(run)
        wh = cache.meta["identity"]["weight_hash"]
        if weight_hash is not None and wh != weight_hash:
            raise UserError(f"{run} was cached from another model than {runs[0]}: pool runs of one model")
        weight_hash = wh
        want = parse_layers(layers_arg, cache.meta["n_layers_model"])
        want = sorted(set(want) | {0}) if 0 in cache.layers else want  # the embedding control, always
        missing = [la for la in want if la not in cache.layers]
        if missing:
            raise UsageError(f"layers {missing} are not in {run}/activations (cached: {cache.layers}); "
                             "re-cache with layers=all")
        if layers is not None and want != layers:
            raise UserError(f"{run} has layers {want}, {runs[0]} has {layers}: cache the runs with the same layers=")
        layers = want
        turns = read_jsonl(run / "user_turns.jsonl", key="record_id")
        if not (run / "labels.jsonl").exists():
            raise UserError(f"no labels.jsonl in {run}: run `mechprobe judge {shell_arg(run)}` first")
        t = item_targets(turns, read_jsonl(run / "labels.jsonl", key="record_id"), temperature, min_samples)
        by_rid = {r["record_id"]: r for r in turns}
        row_keys = [item_key(by_rid[rid]["dataset"], by_rid[rid]["item_id"]) for rid in cache.record_ids]
        full = cache.to_numpy()[:, [cache.layers.index(la) for la in want]]
        stacks.append(one_row_per_item(full, row_keys, t.keys))
        assistants = {r["item_id"]: r for r in read_jsonl(run / "assistant.jsonl", key="item_id")}
        texts += [assistants[i]["prompt"] + "\n" + assistants[i]["response"] for i in t.item_ids]
        toks += [assistants[i].get("n_tokens", len(assistants[i]["response"])) for i in t.item_ids]
        parts.append(t)
    assert layers is not None and weight_hash is not None
    return ItemStates(np.concatenate(stacks), layers, concat_targets(parts), texts, np.asarray(toks, float),
                      weight_hash, [str(r) for r in runs])


def run_datasets(runs: Sequence[Path]) -> list[str]:
    """The dataset of each run (its first assistant row's; "" for an empty run), in ``runs`` order."""
    out = []
    for r in runs:
        rows = read_jsonl(Path(r) / "assistant.jsonl", key="item_id")
        out.append(rows[0]["dataset"] if rows else "")
    return out
