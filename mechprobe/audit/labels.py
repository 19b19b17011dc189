"""Import audit labels: one file per labeller (the sheet's JSON export or a filled ``sheet.csv``).

Why strict: an audit is only as good as the join between a labeller's rows and the sampled turns. A row
key from another sample, a misspelt label or a second, different file under the same labeller name would
silently change every corrected rate, so each is refused with one line naming the problem and the fix.
Imported files are stored as ``<run>/audit/labels/<name>.json`` (normalised: sorted rows, labeller name and
kind), so the report never re-reads the user's originals. A CSV whose ``labeller`` column names several people
is split, one stored labeller each: merging them would make two labellers look like one, and their
disagreement (the inter-labeller kappa) would vanish. Stored files are checked as strictly as imported ones
when they are read back, since a cut-off or hand-edited one would otherwise break or bend the report.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.io import shell_arg
from mechprobe.taxonomy import DEFINITIONS, LABELS

from .readings import parse_strict
from .sample import AuditSample, audit_dir
from .store import write_json_atomic

__all__ = ["RowLabel", "LabellerLabels", "read_labels_file", "read_labellers_file", "import_labels", "load_labellers",
           "LABELLER_KINDS", "LABELS_FORMAT", "LABELLER_NAME_PATTERN"]

LABELLER_KINDS = ("person", "model")
LABELS_FORMAT = "mechprobe-audit-labels-v1"
# A labeller name becomes a file name (<run>/audit/labels/<name>.json), so it is kept to a safe, portable set.
LABELLER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
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
    def from_dict(cls, d: Any, where: str = "labels") -> LabellerLabels:
        """Parse a stored labels file strictly (types, labels, booleans); :class:`UsageError` names ``where``."""
        if not isinstance(d, dict) or d.get("format") != LABELS_FORMAT:
            raise UsageError(f"{where}: not a labels file of the audit (format {LABELS_FORMAT!r} missing)")
        lab = _labeller(d, where)
        rows = tuple(RowLabel(r["row"], r["label"], r["borderline"], r["note"], r["strict"]) for r in _rows(d, where))
        return cls(lab["name"], lab["kind"], _text(d.get("sample_id"), f"{where}: sample_id"), rows)


def _text(value: Any, what: str) -> str:
    """A string field (None counts as empty); anything else is refused rather than turned into its repr."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UsageError(f"{what} is {type(value).__name__} {value!r}, not text; export the file again from the sheet")
    return value.strip()


def _flag(value: Any, where: str) -> bool:
    """A borderline flag, parsed strictly: ``bool("false")`` is True, so strings are matched, never cast."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    v = value.strip().lower() if isinstance(value, str) else None
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise UsageError(f"{where}: borderline {value!r} is neither yes nor no; write 1 (or true) or leave it empty")


def _labeller(d: dict[str, Any], where: str) -> dict[str, str]:
    lab = d.get("labeller")
    if lab is None:
        return {"name": "", "kind": ""}
    if not isinstance(lab, dict):
        raise UsageError(f"{where}: 'labeller' is {type(lab).__name__}, not an object with 'name' and 'kind'; "
                         f"export the file again from the sheet")
    return {"name": _text(lab.get("name"), f"{where}: labeller name"),
            "kind": _text(lab.get("kind"), f"{where}: labeller kind")}


def _rows(d: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The labelled rows of a parsed file, each ``{row, label, borderline, note, strict}`` checked (unlabelled skipped)."""
    rows = d.get("rows", [])
    if not isinstance(rows, list):
        raise UsageError(f"{where}: 'rows' is {type(rows).__name__}, not a list; export the file again from the sheet")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise UsageError(f"{where}: row {i} is {type(r).__name__}, not an object; export the file again")
        at = f"{where}" + (f":{r['_line']}" if "_line" in r else f" row {r.get('row')!r}")
        label = _text(r.get("label"), f"{at}: label")
        if not label:
            continue
        if label not in DEFINITIONS:
            raise UsageError(f"{at}: unknown label {label!r}; use one of {', '.join(LABELS)}")
        row = _text(r.get("row"), f"{at}: row")
        if row in seen:
            raise UsageError(f"{at}: row {row!r} is labelled twice; keep one label per row")
        seen.add(row)
        out.append({"row": row, "label": label, "borderline": _flag(r.get("borderline"), at),
                    "note": _text(r.get("note"), f"{at}: note"), "strict": parse_strict(r.get("strict"), label, at),
                    "labeller": r.get("labeller"),
                    "labeller_kind": r.get("labeller_kind"), "_line": r.get("_line")})
    return out


def _decode(path: Path) -> str:
    """The file's text; a workbook, a binary file or another encoding is one line saying how to save it."""
    data = path.read_bytes()
    if b"\0" in data:
        raise UsageError(f"{path} is a binary file (a spreadsheet workbook?), not text; save it as 'CSV UTF-8' "
                         f"(or export the sheet's JSON again) and pass that file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}; saved as "
                         f"cp1252/Latin-1?); save it as 'CSV UTF-8' (or export the sheet's JSON again)") from None


def _read_csv(path: Path) -> dict[str, Any]:
    reader = csv.DictReader(io.StringIO(_decode(path), newline=""))
    need = {"sample_id", "row", "label"}
    try:
        if not reader.fieldnames or not need <= set(reader.fieldnames):
            raise UsageError(f"{path}: a labels CSV needs the columns {sorted(need)} of sheet.csv; fill in a copy "
                             f"of <run>/audit/sheet.csv rather than a new table")
        rows, sample_ids = [], set()
        for i, r in enumerate(reader, start=2):
            if any(x.strip() for x in r.get(None) or []):  # typed past the header: read by no column name
                raise UsageError(f"{path}:{i}: cells beyond the last named column; name their column in the first "
                                 f"row (e.g. strict, on a sheet.csv without it) or delete them")
            sample_ids.add((r.get("sample_id") or "").strip())
            if not (r.get("label") or "").strip():
                continue  # not labelled (yet)
            rows.append({"row": (r.get("row") or "").strip(), "label": r.get("label"),
                         "borderline": r.get("borderline") or "", "note": r.get("note") or "", "strict": r.get("strict"),
                         "labeller": (r.get("labeller") or "").strip(),
                         "labeller_kind": (r.get("labeller_kind") or "").strip(), "_line": i})
    except csv.Error as e:
        raise UsageError(f"{path}:{reader.line_num}: not a readable CSV ({e}); save it as 'CSV UTF-8'") from None
    sample_ids.discard("")
    if len(sample_ids) > 1:
        raise UsageError(f"{path}: rows of several samples ({sorted(sample_ids)}); keep the rows of one sheet.csv")
    return {"sample_id": next(iter(sample_ids), ""), "rows": rows}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(_decode(path))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not JSON ({e}); pass the file the sheet's Export button saved") from None
    if not isinstance(d, dict) or d.get("format") != LABELS_FORMAT:
        raise UsageError(f"{path}: not a labels file of the audit sheet (format {LABELS_FORMAT!r} missing); "
                         f"export it again from sheet.html")
    return d


def _one_labeller(path: Path, who: str, kind: str | None, file_kind: str, sample_id: str,
                  rows: list[dict[str, Any]]) -> LabellerLabels:
    if not LABELLER_NAME_PATTERN.match(who):
        raise UsageError(f"{path}: labeller name {who!r} must be letters, digits, '_', '.', '-' (at most 64); "
                         f"type a plain name in the sheet or rename the file")
    if kind and file_kind and kind != file_kind:
        raise UsageError(f"{path}: the file says labeller kind {file_kind!r} but labeller_kind= is {kind!r}; "
                         f"drop labeller_kind= or fix the kind in the sheet")
    k = kind or file_kind
    if k not in LABELLER_KINDS:
        raise UsageError(f"{path}: labeller kind {k or 'missing'!r}; pass labeller_kind=person or model")
    return LabellerLabels(who, k, sample_id,
                          tuple(RowLabel(r["row"], r["label"], r["borderline"], r["note"], r["strict"]) for r in rows))


def read_labellers_file(path: str | Path, kind: str | None = None, name: str | None = None
                        ) -> list[LabellerLabels]:
    """Read one labels file (sheet JSON export or filled CSV) and check its labels; one entry per labeller.

    Args:
        path: ``*.json`` (the sheet's Export) or ``*.csv`` (a filled ``sheet.csv``).
        kind: ``person`` or ``model``; required when the file does not say, must agree when it does.
        name: the labeller's name; default the one in the file, else the file name's stem.
    Returns:
        the labels, not yet checked against a sample (see :func:`import_labels`). A CSV whose ``labeller``
        column names several people gives one :class:`LabellerLabels` each (in name order); a labelled
        row without a name beside named ones is refused, since it cannot be given to anyone.
    Example:
        >>> [lab.name for lab in read_labellers_file("shared.csv", kind="person")]  # doctest: +SKIP
        ['carol', 'dave']
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} not found; pass the file the sheet exported (or a filled sheet.csv)")
    is_csv = path.suffix.lower() == ".csv"
    d = _read_csv(path) if is_csv else _read_json(path)
    sample_id = _text(d.get("sample_id"), f"{path}: sample_id")
    rows = _rows(d, str(path))
    if not is_csv:
        lab = _labeller(d, str(path))
        return [_one_labeller(path, name or lab["name"] or path.stem, kind, lab["kind"], sample_id, rows)]
    names = sorted({r["labeller"] for r in rows} - {""})
    if name or len(names) <= 1:
        kinds = {r["labeller_kind"] for r in rows} - {""}
        if len(kinds) > 1:
            raise UsageError(f"{path}: labeller_kind holds {sorted(kinds)}; one labeller has one kind")
        return [_one_labeller(path, name or next(iter(names), "") or path.stem, kind, next(iter(kinds), ""),
                              sample_id, rows)]
    nameless = [r["_line"] for r in rows if not r["labeller"]]
    if nameless:
        raise UsageError(f"{path}:{nameless[0]}: a labelled row without a labeller name, beside rows of "
                         f"{', '.join(names)}; fill the labeller column of every labelled row")
    out = []
    for who in names:
        mine = [r for r in rows if r["labeller"] == who]
        kinds = {r["labeller_kind"] for r in mine} - {""}
        if len(kinds) > 1:
            raise UsageError(f"{path}: labeller {who!r} has the kinds {sorted(kinds)}; one labeller has one kind")
        out.append(_one_labeller(path, who, kind, next(iter(kinds), ""), sample_id, mine))
    return out


def read_labels_file(path: str | Path, kind: str | None = None, name: str | None = None) -> LabellerLabels:
    """Read one labeller's file (sheet JSON export or filled CSV) and check its labels.

    Args:
        path, kind, name: see :func:`read_labellers_file`.
    Returns:
        the labels, not yet checked against a sample (see :func:`import_labels`); a CSV holding several
        labellers is refused here (:func:`read_labellers_file` splits it).
    Example:
        >>> read_labels_file("alice.csv", kind="person").name  # doctest: +SKIP
        'alice'
    """
    got = read_labellers_file(path, kind, name)
    if len(got) > 1:
        raise UsageError(f"{path} holds the labels of {len(got)} labellers ({', '.join(lab.name for lab in got)}); "
                         f"read it with read_labellers_file, or import it with `mechprobe audit RUN labels={shell_arg(path)}`")
    return got[0]


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
        paths: labels files (one per labeller, or a CSV of several labellers, which is split by name).
        sample: the run's sample (:func:`~mechprobe.audit.sample.load_sample`).
        kind: ``person`` or ``model`` for files that do not say.
    Returns:
        the stored files. Importing the same content again is a no-op; a different file under a stored
        labeller's name is refused (pick another name, or delete the stored file to replace it). Every file,
        new and stored, is checked before anything is written, and a write that fails removes the files this
        call wrote, so a refused or failed import leaves the stored labels as they were.
    Example:
        >>> import_labels(run, ["alice.json", "bob.csv"], load_sample(run), kind="person")  # doctest: +SKIP
    """
    out_dir = audit_dir(run) / "labels"
    loaded = [(Path(p), lab) for p in paths for lab in read_labellers_file(p, kind)]
    names = [lab.name for _, lab in loaded]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"two files name the same labeller {dup[0]!r}; give each labeller a distinct name")
    stored_now = {lab.name: lab for lab in _load_all(out_dir)}
    stored: list[Path] = []
    new: list[tuple[Path, LabellerLabels]] = []
    for p, lab in loaded:
        _check_against(lab, sample, p)
        lab = LabellerLabels(lab.name, lab.kind, sample.sample_id, lab.rows)
        dest = out_dir / f"{lab.name}.json"
        old = stored_now.get(lab.name)
        if old is not None and old.to_dict() != lab.to_dict():
            raise UsageError(f"{dest} already holds different labels by {lab.name!r}; use another labeller name, "
                             f"or delete {dest} to replace them")
        stored.append(dest)
        if old is None:
            new.append((dest, lab))
    written: list[Path] = []
    try:
        for dest, lab in new:
            write_json_atomic(dest, lab.to_dict())
            written.append(dest)
    except BaseException:
        for dest in written:  # all of this call's labellers or none
            dest.unlink(missing_ok=True)
        raise
    return stored


def _load_all(d: Path) -> list[LabellerLabels]:
    """Every stored labels file in ``d``, strictly parsed; a damaged one is refused naming the fix."""
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        fix = (f"delete {p} and import that labeller's own file again (labels=FILE, `mechprobe audit RUN`); "
               f"nothing was changed")
        try:
            d_ = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{p} is cut off or not JSON ({e}); {fix}") from None
        try:
            lab = LabellerLabels.from_dict(d_, str(p))
        except UsageError as e:
            raise UsageError(f"stored labels are damaged: {e}; {fix}") from None
        if lab.name != p.stem or lab.kind not in LABELLER_KINDS or not lab.sample_id:
            raise UsageError(f"{p} names labeller {lab.name!r} of kind {lab.kind!r} for sample {lab.sample_id!r}; "
                             f"a stored file holds its own labeller, a kind and a sample; {fix}")
        out.append(lab)
    return out


def load_labellers(run: str | Path, sample: AuditSample) -> list[LabellerLabels]:
    """Every stored labeller of the run's current sample, sorted by name (other samples' files are ignored).

    A stored file that is cut off, holds a label outside the taxonomy, or names rows that are not in the
    sample it claims is refused in one line (the report would otherwise fail on it or silently drop rows).
    """
    out = []
    keys = sample.keys()
    for lab in _load_all(audit_dir(run) / "labels"):
        if lab.sample_id != sample.sample_id:
            continue
        stray = [r.row for r in lab.rows if r.row not in keys]
        if stray:
            p = audit_dir(run) / "labels" / f"{lab.name}.json"
            raise UsageError(f"{p} labels {len(stray)} row(s) not in sample {sample.sample_id} (first {stray[0]!r}); "
                             f"delete it and import that labeller's own file again")
        out.append(lab)
    return out
