"""Import audit labels: one file per labeller (the sheet's JSON export or a filled ``sheet.csv``).

Why strict: an audit is only as good as the join between a labeller's rows and the sampled turns. A row
key from another sample, a misspelt label or a second, different file under the same labeller name would
silently change every corrected rate, so each is refused with one line naming the problem and the fix.
Imported files are stored as ``<run>/audit/labels/<name>.json`` (normalised: sorted rows, labeller name and
kind), so the report never re-reads the user's originals.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.io import read_json, write_json
from mechprobe.taxonomy import DEFINITIONS, LABELS

from .readings import parse_strict
from .sample import AuditSample, audit_dir

__all__ = ["RowLabel", "LabellerLabels", "read_labels_file", "import_labels", "load_labellers", "LABELLER_KINDS",
           "LABELS_FORMAT"]

LABELLER_KINDS = ("person", "model")
LABELS_FORMAT = "mechprobe-audit-labels-v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TRUE = {"1", "true", "yes", "y", "x", "b", "borderline"}
_FALSE = {"", "0", "false", "no", "n"}


@dataclass(frozen=True)
class RowLabel:
    """One labeller's verdict on one sheet row (``row`` is the sheet's opaque row key).

    ``strict``: on a ``genuine_followup`` row, ``"yes"`` or the label under the codebook's strict reading; None
    when the labeller did not say (:mod:`mechprobe.audit.readings`).
    """

    row: str
    label: str
    borderline: bool = False
    note: str = ""
    strict: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"row": self.row, "label": self.label, "borderline": self.borderline, "note": self.note}
        if self.strict is not None:
            d["strict"] = self.strict
        return d


@dataclass(frozen=True)
class LabellerLabels:
    """All labels of one labeller for one sample."""

    name: str
    kind: str
    sample_id: str
    rows: tuple[RowLabel, ...] = field(default_factory=tuple)

    def by_row(self) -> dict[str, RowLabel]:
        return {r.row: r for r in self.rows}

    def to_dict(self) -> dict[str, Any]:
        return {"format": LABELS_FORMAT, "sample_id": self.sample_id,
                "labeller": {"name": self.name, "kind": self.kind},
                "rows": [r.to_dict() for r in sorted(self.rows, key=lambda r: r.row)]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabellerLabels:
        lab = d.get("labeller") or {}
        rows = tuple(RowLabel(str(r["row"]), str(r["label"]), bool(r.get("borderline", False)),
                              str(r.get("note") or ""), r.get("strict")) for r in d.get("rows", []))
        return cls(str(lab.get("name") or ""), str(lab.get("kind") or ""), str(d.get("sample_id") or ""), rows)


def _flag(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise UsageError(f"{where}: borderline {value!r} is neither yes nor no; write 1 or leave it empty")


def _read_csv(path: Path) -> dict[str, Any]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        need = {"sample_id", "row", "label"}
        if not reader.fieldnames or not need <= set(reader.fieldnames):
            raise UsageError(f"{path}: a labels CSV needs the columns {sorted(need)} of sheet.csv; fill in a copy "
                             f"of <run>/audit/sheet.csv rather than a new table")
        rows, sample_ids, names, kinds = [], set(), set(), set()
        for i, r in enumerate(reader, start=2):
            sample_ids.add((r.get("sample_id") or "").strip())
            names.add((r.get("labeller") or "").strip())
            kinds.add((r.get("labeller_kind") or "").strip())
            label = (r.get("label") or "").strip()
            if not label:
                continue  # not labelled (yet)
            rows.append({"row": r["row"].strip(), "label": label,
                         "borderline": _flag(r.get("borderline") or "", f"{path}:{i}"),
                         "note": (r.get("note") or "").strip(), "strict": r.get("strict"), "_line": i})
    sample_ids.discard("")
    if len(sample_ids) > 1:
        raise UsageError(f"{path}: rows of several samples ({sorted(sample_ids)}); keep the rows of one sheet.csv")
    names.discard("")
    kinds.discard("")
    return {"sample_id": next(iter(sample_ids), ""), "rows": rows,
            "labeller": {"name": next(iter(names), "") if len(names) == 1 else "",
                         "kind": next(iter(kinds), "") if len(kinds) == 1 else ""}}


def read_labels_file(path: str | Path, kind: str | None = None, name: str | None = None) -> LabellerLabels:
    """Read one labeller's file (sheet JSON export or filled CSV) and check its labels.

    Args:
        path: ``*.json`` (the sheet's Export) or ``*.csv`` (a filled ``sheet.csv``).
        kind: ``person`` or ``model``; required when the file does not say, must agree when it does.
        name: the labeller's name; default the one in the file, else the file name's stem.
    Returns:
        the labels, not yet checked against a sample (see :func:`import_labels`).
    Example:
        >>> read_labels_file("alice.csv", kind="person").name
        'alice'
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} not found; pass the file the sheet exported (or a filled sheet.csv)")
    if path.suffix.lower() == ".csv":
        d = _read_csv(path)
    else:
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}: not JSON ({e}); pass the file the sheet's Export button saved") from None
        if not isinstance(d, dict) or d.get("format") != LABELS_FORMAT:
            raise UsageError(f"{path}: not a labels file of the audit sheet (format {LABELS_FORMAT!r} missing); "
                             f"export it again from sheet.html")
    lab = d.get("labeller") or {}
    file_name = str(lab.get("name") or "").strip()
    file_kind = str(lab.get("kind") or "").strip()
    who = name or file_name or path.stem
    if not _NAME.match(who):
        raise UsageError(f"{path}: labeller name {who!r} must be letters, digits, '_', '.', '-' (at most 64); "
                         f"type a plain name in the sheet or rename the file")
    if kind and file_kind and kind != file_kind:
        raise UsageError(f"{path}: the file says labeller kind {file_kind!r} but --labeller-kind is {kind!r}; "
                         f"drop --labeller-kind or fix the kind in the sheet")
    k = kind or file_kind
    if k not in LABELLER_KINDS:
        raise UsageError(f"{path}: labeller kind {k or 'missing'!r}; pass --labeller-kind person or model")
    rows: list[RowLabel] = []
    seen: set[str] = set()
    for r in d.get("rows", []):
        if r.get("label") in (None, ""):
            continue
        where = f"{path}" + (f":{r['_line']}" if "_line" in r else f" row {r.get('row')!r}")
        label = str(r["label"]).strip()
        if label not in DEFINITIONS:
            raise UsageError(f"{where}: unknown label {label!r}; use one of {', '.join(LABELS)}")
        row = str(r.get("row") or "")
        if row in seen:
            raise UsageError(f"{where}: row {row!r} is labelled twice; keep one label per row")
        seen.add(row)
        rows.append(RowLabel(row, label, bool(r.get("borderline", False)), str(r.get("note") or ""),
                             parse_strict(r.get("strict"), label, where)))
    return LabellerLabels(who, k, str(d.get("sample_id") or ""), tuple(rows))


def _check_against(lab: LabellerLabels, sample: AuditSample, path: Path) -> None:
    if lab.sample_id and lab.sample_id != sample.sample_id:
        raise UsageError(f"{path}: labels for sample {lab.sample_id}, but the run's sample is {sample.sample_id}; "
                         f"label the run's current sheet.html (the sample was redrawn since)")
    keys = sample.keys()
    stray = [r.row for r in lab.rows if r.row not in keys]
    if stray:
        raise UsageError(f"{path}: {len(stray)} labelled row(s) are not in the run's sample (first {stray[0]!r}); "
                         f"label the run's own sheet.html/sheet.csv and do not edit the row column")
    if not lab.rows:
        raise UsageError(f"{path}: no row is labelled; label at least one row in the sheet and export again")


def import_labels(run: str | Path, paths: list[str | Path], sample: AuditSample, kind: str | None = None
                  ) -> list[Path]:
    """Check and store each labeller's file as ``<run>/audit/labels/<name>.json``.

    Args:
        run: the run directory whose sample was labelled.
        paths: one file per labeller.
        sample: the run's sample (:func:`~mechprobe.audit.sample.load_sample`).
        kind: ``person`` or ``model`` for files that do not say.
    Returns:
        the stored files. Importing the same content again is a no-op; a different file under a stored
        labeller's name is refused (pick another name, or delete the stored file to replace it).
    Example:
        >>> import_labels(run, ["alice.json", "bob.csv"], load_sample(run), kind="person")
    """
    out_dir = audit_dir(run) / "labels"
    loaded = [(Path(p), read_labels_file(p, kind)) for p in paths]
    names = [lab.name for _, lab in loaded]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"two files name the same labeller {dup[0]!r}; give each labeller a distinct name")
    for p, lab in loaded:
        _check_against(lab, sample, p)
        lab = LabellerLabels(lab.name, lab.kind, sample.sample_id, lab.rows)
        dest = out_dir / f"{lab.name}.json"
        if dest.exists() and read_json(dest) != lab.to_dict():
            raise UsageError(f"{dest} already holds different labels by {lab.name!r}; use another labeller name, "
                             f"or delete {dest} to replace them")
    stored = []
    for _, lab in loaded:
        lab = LabellerLabels(lab.name, lab.kind, sample.sample_id, lab.rows)
        dest = out_dir / f"{lab.name}.json"
        if not dest.exists():
            write_json(dest, lab.to_dict())
        stored.append(dest)
    return stored


def load_labellers(run: str | Path, sample: AuditSample) -> list[LabellerLabels]:
    """Every stored labeller of the run's current sample, sorted by name (other samples' files are ignored)."""
    d = audit_dir(run) / "labels"
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        lab = LabellerLabels.from_dict(read_json(p))
        if lab.sample_id == sample.sample_id:
            out.append(lab)
    return out
