"""Blind labelling sheets for the study (the labellers' files are read back by :func:`mechprobe.audit.arms.read_sheet_labels`).

Why a sheet per batch with a separate key: labellers (people or model-written labellers) see only an opaque
row key, the query, the real answer and the user turn, never the arm, the split or any judge's verdict. The
key that maps rows back lives beside the sheet and is never shown to them. Rows of every arm are shuffled
together, so a labeller cannot tell a steered turn from a base one by its position.
"""

from __future__ import annotations

import csv
import hashlib
import io
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mechprobe.io import write_json, write_text_atomic

__all__ = ["row_key", "write_sheet", "SHEET_COLUMNS"]

SHEET_COLUMNS = ("sample_id", "row", "query", "answer", "user_turn", "label", "strict", "borderline", "note")


def row_key(salt: str, turn_id: str) -> str:
    """An opaque, stable row key: says nothing about the arm or the item."""
    return "r" + hashlib.sha256(f"{salt}|{turn_id}".encode()).hexdigest()[:10]


def write_sheet(rows: Sequence[dict[str, Any]], sheet: Path, key: Path, *, sample_id: str, seed: int) -> int:
    """Write a shuffled blind sheet (CSV, label columns empty) and its key (JSON) for ``rows``.

    Args:
        rows: each with ``turn_id`` (unique), ``query``, ``answer`` (the real answer, shown to labellers whatever
            the arm saw) and ``turn``; other fields go to the key only.
        sheet: the CSV to write.
        key: the JSON key to write (row key -> the row's hidden fields).
        sample_id: the sheet's id, in every row (labels files are checked against it).
        seed: the shuffle's seed.
    Returns:
        the number of rows written.
    """
    ids = [r["turn_id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("write_sheet: turn ids must be unique")
    order = list(rows)
    random.Random(seed).shuffle(order)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SHEET_COLUMNS)
    keymap: dict[str, Any] = {}
    for r in order:
        k = row_key(sample_id, r["turn_id"])
        w.writerow([sample_id, k, r["query"], r["answer"], r["turn"], "", "", "", ""])
        keymap[k] = {f: v for f, v in r.items() if f not in ("query", "answer", "turn")}
    sheet.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(sheet, buf.getvalue())
    write_json(key, {"sample_id": sample_id, "rows": keymap})
    return len(order)
