"""Deterministic train / held-out splits by a stable key (item id, conversation id).

One function, so the steering experiment and post-training split the same way: the same key is always on the
same side, across runs and machines (sha256, not Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError


def split_of(key: str, held_out_fraction: float = 0.5) -> str:
    """``"heldout"`` for about ``held_out_fraction`` of keys, else ``"train"``.

    Args:
        key: an item id or conversation id.
        held_out_fraction: the share of keys held out, in [0, 1].

    Returns:
        ``"heldout"`` or ``"train"``.

    Example:
        >>> split_of("gsm8k-17", 0.5) in ("train", "heldout")
        True
    """
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < held_out_fraction else "train"


# ------------------------------------------------------------------ fixed split files (committed package data)

SPLIT_FORMAT = "mechprobe-item-split-v1"
SPLITS_DIR = Path(__file__).resolve().parent / "data" / "splits"
STEERING_SPLIT = SPLITS_DIR / "gsm8k_steering_v1.json"
# How gsm8k_steering_v1 was drawn (scripts/make_steering_split.py repeats it bit for bit).
STEERING_SPLIT_RULE = dict(dataset="gsm8k", source="gsm8k/test.jsonl", seed=20250101, min_index=500,
                           n_heldout=120, n_train=120)


@dataclass(frozen=True)
class ItemSplit:
    """A fixed split of item ids: ``heldout`` (final numbers only) and ``train`` (selection, thresholds)."""

    name: str
    dataset: str
    heldout: tuple[str, ...]
    train: tuple[str, ...]
    path: str = ""
    sha256: str = ""

    @property
    def display_path(self) -> str:
        """The split file's path for reports: relative to the repository for the package's own splits, relative
        to the working directory when inside it, else just the file name (committed reports carry no machine
        paths)."""
        p = Path(self.path).resolve() if self.path else None
        if p is None:
            return self.name
        for root in (Path(__file__).resolve().parent.parent, Path.cwd().resolve()):
            if p.is_relative_to(root):
                return p.relative_to(root).as_posix()
        return p.name

    def side(self, item_id: str) -> str | None:
        """``"heldout"``, ``"train"`` or None (the item is in neither list)."""
        if item_id in self.heldout:
            return "heldout"
        if item_id in self.train:
            return "train"
        return None


def draw_item_split(data_file: str | Path, dataset: str, source: str, seed: int, min_index: int, n_heldout: int,
                    n_train: int) -> dict[str, Any]:
    """Draw disjoint held-out and train id lists from rows ``>= min_index`` of a JSONL data file.

    Ids are ``<dataset>-<row index>`` over the file's non-blank rows (as :mod:`mechprobe.turns.datasets` forms
    them). ``random.Random(seed).sample`` of ``n_heldout + n_train`` eligible indices: the first ``n_heldout``
    are held out, the rest train; each list sorted. Returns the JSON-ready split (see :func:`split_text`).
    """
    raw = Path(data_file).read_bytes()
    n_rows = sum(1 for line in raw.decode("utf-8").splitlines() if line.strip())
    eligible = list(range(min_index, n_rows))
    if n_heldout + n_train > len(eligible):
        raise ValueError(f"{data_file}: {len(eligible)} rows >= {min_index}, fewer than {n_heldout + n_train}")
    drawn = random.Random(seed).sample(eligible, n_heldout + n_train)
    ids = [f"{dataset}-{i:04d}" for i in drawn]
    return {"format": SPLIT_FORMAT, "name": f"{dataset}_steering_v1", "dataset": dataset,
            "source": {"file": source, "sha256": hashlib.sha256(raw).hexdigest(), "n_rows": n_rows},
            "rule": (f"random.Random({seed}).sample(range({min_index}, {n_rows}), {n_heldout + n_train}) over the "
                     f"file's non-blank row indices; the first {n_heldout} drawn are held out, the next {n_train} "
                     f"train; ids '{dataset}-<index:04d>', each list sorted. Rows < {min_index} are left out because "
                     f"earlier runs (--limit 200) used them for selection, thresholds and judge choices"),
            "seed": seed, "min_index": min_index,
            "heldout": sorted(ids[:n_heldout]), "train": sorted(ids[n_heldout:])}


def split_text(d: dict[str, Any]) -> str:
    """The committed file's exact text (so regeneration can be compared byte for byte)."""
    return json.dumps(d, indent=1, sort_keys=True) + "\n"


def load_split(path: str | Path) -> ItemSplit:
    """Read a split file; refuse one that is not a split file, with a missing, empty or repeating id list, or
    whose lists overlap (each a one-line :class:`UsageError`)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"split_file={p} not found")
    raw = p.read_bytes()
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"split_file={p} is not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != SPLIT_FORMAT:
        raise UsageError(f"split_file={p} is not a split file (format {SPLIT_FORMAT!r} expected)")
    fix = "regenerate it with scripts/make_steering_split.py"
    for key in ("name", "dataset"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise UsageError(f"split_file={p}: '{key}' is missing or not a string; {fix}")
    for key in ("heldout", "train"):
        ids = d.get(key)
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise UsageError(f"split_file={p}: '{key}' is missing or not a list of item ids; {fix}")
        if not ids:  # an empty held-out list would run the final stage on no items and report nothing
            raise UsageError(f"split_file={p}: the '{key}' list is empty; {fix}")
        dup = sorted(i for i, c in Counter(ids).items() if c > 1)
        if dup:
            raise UsageError(f"split_file={p}: {len(dup)} ids repeat in '{key}' (e.g. {dup[0]}); {fix}")
    both = set(d["heldout"]) & set(d["train"])
    if both:
        raise UsageError(f"split_file={p}: {len(both)} ids are both held out and train (e.g. {sorted(both)[0]})")
    return ItemSplit(d["name"], d["dataset"], tuple(d["heldout"]), tuple(d["train"]), str(p),
                     hashlib.sha256(raw).hexdigest())
