"""Blind labelling sheets for the study, and reading the labellers' files back.

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

from mechprobe.audit.labels import read_labellers_file
from mechprobe.audit.readings import LENIENT, STRICT, genuine_under
from mechprobe.errors import UsageError
from mechprobe.io import write_json, write_text_atomic
from mechprobe.taxonomy import GENUINE

__all__ = ["row_key", "write_sheet", "read_sheet_labels", "SHEET_COLUMNS"]

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


def read_sheet_labels(path: Path, sample_id: str, keys: set[str]) -> dict[str, dict[str, Any]]:
    """One labeller's filled sheet: ``row -> {label, strict_genuine, lenient_genuine, borderline, note}``.

    Refuses a file of another sheet, rows not on the sheet, and a ``genuine_followup`` row without its strict
    reading: under codebook v2 every genuine row says whether it is genuine under the strict reading too, so the
    strict rate is the labellers' own call, never a stand-in rule.
    """
    labs = read_labellers_file(path, kind="model")
    if len(labs) != 1:
        raise UsageError(f"{path}: holds {len(labs)} labellers; give each labeller their own file")
    lab = labs[0]
    if lab.sample_id and lab.sample_id != sample_id:
        raise UsageError(f"{path}: labels sheet {lab.sample_id!r}, not {sample_id!r}; label the sheet beside its key")
    out: dict[str, dict[str, Any]] = {}
    for r in lab.rows:
        if r.row not in keys:
            raise UsageError(f"{path}: row {r.row!r} is not on sheet {sample_id!r}")
        if r.label == GENUINE and r.strict is None:
            raise UsageError(f"{path}: row {r.row} is genuine_followup without its strict reading; fill the strict "
                             f"column (yes, or the label it gets under the strict reading)")
        out[r.row] = {"label": r.label, "strict": r.strict, "borderline": r.borderline, "note": r.note,
                      "lenient_genuine": genuine_under(r, LENIENT), "strict_genuine": genuine_under(r, STRICT)}
    return out
