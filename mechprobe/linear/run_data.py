"""A run directory as the linear probes' input: its labelled boundary activations as arrays, and where its figures go.

Kept apart from :mod:`mechprobe.linear.turn`, whose functions are pure (arrays in, numbers out), so the fitting
code reads no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.activations.cache import ActivationCache, parse_layers
from mechprobe.errors import UsageError
from mechprobe.io import read_jsonl


def figures_dir(flag: str | None, run: Path) -> Path:
    """Where a run's figures go: ``--figures`` if given, else ``<run>/figures`` (git-ignored with the run)."""
    return Path(flag) if flag else Path(run) / "figures"



@dataclass
class LabelledActivations:
    """Labelled rows of one or more runs, as arrays the probes take."""

    stack: np.ndarray  # [n, len(layers), d]
    layers: list[int]
    y: np.ndarray
    labels: list[str]
    groups: np.ndarray
    greedy: np.ndarray
    datasets: list[str]
    texts: list[str]
    meta: dict[str, Any]
    n_unlabelled: int


def load_labelled_activations(run: Path, layers_arg: str) -> LabelledActivations:
    """Labelled rows of a run (judge errors and unlabelled rows dropped), residual index 0 always included."""

    cache = ActivationCache.load(run)
    layers = parse_layers(layers_arg, cache.meta["n_layers_model"])
    layers = sorted(set(layers) | {0}) if 0 in cache.layers else layers  # the embedding control, always
    missing = [la for la in layers if la not in cache.layers]
    if missing:
        raise UsageError(f"layers {missing} are not in {run}/activations (cached: {cache.layers}); "
                         "re-cache with layers=all")
    mask = cache.labeled_mask().numpy()
    turns = {r["record_id"]: r for r in read_jsonl(run / "user_turns.jsonl", key="record_id")}
    assistants = {r["item_id"]: r for r in read_jsonl(run / "assistant.jsonl", key="item_id")}
    rids = [rid for rid, m in zip(cache.record_ids, mask) if m]
    full = cache.to_numpy()
    idx = [cache.layers.index(la) for la in layers]
    # The text baseline sees what the model saw before the boundary: the prompt and its own answer.
    texts = [assistants[turns[r]["item_id"]]["prompt"] + "\n" + assistants[turns[r]["item_id"]]["response"]
             for r in rids]
    return LabelledActivations(stack=full[mask][:, idx], layers=layers,
                     y=cache.labels("genuine").numpy()[mask].astype(int),
                     labels=[str(lab) for lab, m in zip(cache.labels("label"), mask) if m],
                     groups=np.asarray(cache.item_ids)[mask],
                     greedy=np.asarray([turns[r]["decoding"] == "greedy" for r in rids]),
                     datasets=[turns[r]["dataset"] for r in rids], texts=texts, meta=cache.meta,
                     n_unlabelled=int((~mask).sum()))
