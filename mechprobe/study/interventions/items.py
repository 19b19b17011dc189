"""The study's items: drawn once by a seeded rule from rows no earlier run or choice touched.

Why a rule *and* a list: the plan file records the ids the rule produced (so a reader sees exactly which
items are held out without running anything) and the rule itself (so anyone can check that the ids were not
picked by hand). :func:`draw_items` is that rule; :func:`used_item_ids` collects every id that any committed
file of the project mentions (earlier audits, the steering split, the judge's examples), which the rule
excludes: "fresh" means never seen by any earlier choice.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["used_item_ids", "draw_items", "ID_PATTERN"]

ID_PATTERN = re.compile(r"\b(gsm8k|ifeval|mt_bench|math500)-(\d{4})\b")


def used_item_ids(paths: Iterable[str | Path]) -> set[str]:
    """Every dataset item id (``gsm8k-0123`` style) mentioned in any text file under ``paths``.

    Args:
        paths: files or folders (searched recursively; binary files are skipped).
    Returns:
        the ids found, e.g. ``{"gsm8k-0007", "ifeval-0012"}``.
    Example:
        >>> used_item_ids([])
        set()
    """
    found: set[str] = set()
    for p in paths:
        p = Path(p)
        files = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else []
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            found.update(f"{m.group(1)}-{m.group(2)}" for m in ID_PATTERN.finditer(text))
    return found


def draw_items(dataset: str, n_rows: int, n: int, *, seed: int, exclude: set[str], min_index: int = 0
               ) -> list[str]:
    """``n`` ids of ``dataset`` in draw order: a seeded shuffle of the row indices >= ``min_index``, minus ``exclude``.

    Args:
        dataset: the id prefix (``"gsm8k"``).
        n_rows: rows in the dataset file.
        n: how many ids to draw (all remaining when fewer are left).
        seed: the shuffle's seed.
        exclude: ids never to draw (:func:`used_item_ids`).
        min_index: first row index eligible.
    Returns:
        ids ``f"{dataset}-{index:04d}"`` in the order drawn (the plan's order of preference).
    Example:
        >>> draw_items("gsm8k", 10, 3, seed=1, exclude={"gsm8k-0002"})
        ['gsm8k-0006', 'gsm8k-0008', 'gsm8k-0009']
    """
    idx = list(range(min_index, n_rows))
    random.Random(seed).shuffle(idx)
    out = [f"{dataset}-{i:04d}" for i in idx if f"{dataset}-{i:04d}" not in exclude]
    return out[:n]
