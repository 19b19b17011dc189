"""The blind labelling sheet: one self-contained HTML page (and the same rows as CSV) per audit sample.

Why a static page: labellers work from ``file://`` on any machine, offline, with nothing to install; the
page embeds its data and the codebook, saves progress in the browser's localStorage (keyed by the sample
id, so a reload resumes and two samples never mix) and exports a labels file that
:func:`mechprobe.audit.labels.import_labels` reads. Why blind: rows are shuffled with a seed and carry an
opaque row key, and neither the condition nor the judge's label is in the page, so a labeller cannot label
towards a hypothesis. ``sheet.csv`` holds the same rows for spreadsheet users and imports the same way.

Why the layout: a sheet of 200 rows is labelled over hours, so the codebook sits beside the row, each label's
definition under its button, the answer scrolls (and opens at full length) with the keyboard, a label moves
on to the next unlabelled row, and a row overview marks the unlabelled and borderline rows. A ``genuine_followup``
row also takes the codebook's strict reading (``yes`` or the turn's strict label, :mod:`mechprobe.audit.readings`):
the page shows that choice only on such rows, waits for it before moving on, and marks genuine rows still without
it, since a missing entry falls back to the rule for older files and silently narrows less than the labeller
meant. The same template serves the answer-identification page (:mod:`mechprobe.audit.identify`) in its
``identify`` mode.
Why texts starting with ``=``, ``+``, ``-``, ``@``, a tab or a CR get a leading ``'`` in ``sheet.csv`` (the OWASP
advice for CSV injection): a spreadsheet evaluates such a cell, so a generated turn ``=HYPERLINK(...)`` becomes a
live link and ``-2+3`` shows as ``1``; the quote makes it text. The import reads only the labeller's columns,
never these texts back, so nothing has to be undone there. Why a filled ``sheet.csv`` is never rewritten: labellers
fill it in place, and a re-run with the same arguments would otherwise replace their work with a blank sheet.
"""

from __future__ import annotations

import csv
import html
import io
import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mechprobe.errors import UsageError
from mechprobe.io import shell_arg
from mechprobe.taxonomy import GENUINE, TAXONOMY

from .codebook import codebook_text
from .labels import LABELLER_NAME_PATTERN, LABELS_FORMAT
from .readings import STRICT_CHOICES
from .sample import AuditSample, audit_dir
from .store import write_audit_text
from .table import TurnTable

__all__ = ["SheetRow", "sheet_rows", "render_sheet_html", "render_page", "write_sheet", "CSV_COLUMNS", "TOOL_COLUMNS",
           "LABELLER_COLUMNS", "csv_cell", "refuse_filled_sheet", "FORMULA_START", "STRICT_KEYS"]

# What the tool fills in sheet.csv, and what the labeller fills (blank when written). An older sheet.csv may lack
# some labeller columns (``strict``); the import reads each by name and treats a missing one as empty.
TOOL_COLUMNS = ("sample_id", "row", "query", "answer", "user_turn")
LABELLER_COLUMNS = ("label", "borderline", "strict", "note", "labeller", "labeller_kind")
CSV_COLUMNS = TOOL_COLUMNS + LABELLER_COLUMNS
# The sheet's keys for the strict choice: mnemonic letters that no other key of the page uses.
STRICT_KEYS = {"yes": "y", "generic_followup": "g", "empty_or_degenerate": "d", "assistant_continuation": "a"}
_PLACEHOLDER = re.compile(r"\{\{(TITLE|MODE|CODEBOOK_HTML|DATA_JSON)\}\}")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


@dataclass(frozen=True)
class SheetRow:
    """What a labeller sees of one sampled turn: the opaque row key, the three texts and whether the answer was
    cut at the token cap (a property of the answer, the same in every condition), nothing else."""

    row: str
    query: str
    answer: str
    turn: str
    truncated: bool = False


def sheet_rows(sample: AuditSample, table: TurnTable, seed: int | None = None) -> list[SheetRow]:
    """The sample's turns in a seeded shuffled order, stripped of condition and judge label.

    Args:
        sample: the recorded sample.
        table: the run's table (for the texts).
        seed: shuffle seed; default the sample's seed. The order is a function of (sample id, seed) only.
    Returns:
        one :class:`SheetRow` per sampled turn.
    Example:
        >>> [r.row for r in sheet_rows(sample, table)][:2]  # doctest: +SKIP
        ['r3f0c...', 'r91aa...']
    """
    rows = []
    for rid in sample.record_ids:
        t = table.get(rid)
        rows.append(SheetRow(sample.row_key(rid), t.query, t.answer, t.turn, t.answer_stop_reason == "max_tokens"))
    rows.sort(key=lambda r: r.row)
    random.Random(f"sheet|{sample.sample_id}|{sample.seed if seed is None else seed}").shuffle(rows)
    return rows


def _json_for_script(obj: object) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>``, ``&`` escaped so no text can close the script tag."""
    s = json.dumps(obj, ensure_ascii=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace(
        "\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_sheet_html(sample: AuditSample, rows: list[SheetRow], codebook: str | None = None) -> str:
    """The sheet page as one string (see the module docstring).

    Args:
        sample: the recorded sample (its id keys the browser's saved state and the export).
        rows: :func:`sheet_rows` output.
        codebook: the markdown shown beside the row; default :func:`codebook_text` (tests pass
            nothing: the page must show exactly the package's codebook).
    Returns:
        HTML with no external resource (no CDN, no font, no script URL).
    Example:
        >>> Path("sheet.html").write_text(render_sheet_html(sample, sheet_rows(sample, table)))  # doctest: +SKIP
    """
    data = {"mode": "label", "format": LABELS_FORMAT, "sample_id": sample.sample_id,
            "labels": [{"name": lab.name, "definition": lab.definition} for lab in TAXONOMY],
            "genuine": GENUINE, "strict": [{"value": v, "key": STRICT_KEYS[v]} for v in STRICT_CHOICES],
            "rows": [{"row": r.row, "query": r.query, "answer": r.answer, "turn": r.turn, "truncated": r.truncated}
                     for r in rows]}
    return render_page(f"mechprobe audit sheet {sample.sample_id}", data,
                       codebook_text() if codebook is None else codebook)


def render_page(title: str, data: dict[str, object], codebook: str = "") -> str:
    """The sheet template filled with ``data`` (its ``mode``: ``label`` or ``identify``) and a codebook text.

    Args:
        title: the page title (escaped here).
        data: what the page's script reads: ``mode``, ``format``, ``sample_id``, ``labels`` (the buttons:
            ``name``, ``definition``, optional ``title``), ``rows`` and, in the label mode, ``genuine`` (the label
            that takes a strict choice) and ``strict`` (the choices: ``value``, ``key``). The labeller-name
            pattern of the import is added here, so the page refuses the names the import would.
        codebook: markdown shown beside the row (escaped here); empty in the identify mode.
    Returns:
        HTML with no external resource.
    """
    values = {"TITLE": html.escape(title), "MODE": html.escape(str(data["mode"])),
              "CODEBOOK_HTML": html.escape(codebook, quote=False),
              "DATA_JSON": _json_for_script({**data, "name_pattern": LABELLER_NAME_PATTERN.pattern})}
    template = resources.files(__package__).joinpath("sheet_template.html").read_text(encoding="utf-8")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def csv_cell(text: str) -> str:
    """``text`` as a spreadsheet shows it verbatim: a leading ``'`` when it starts like a formula."""
    return "'" + text if text.startswith(FORMULA_START) else text


def _filled_rows(path: Path) -> str | None:
    """What a labeller put into ``path`` (e.g. ``"3 filled rows"``), or None when it is a blank sheet.

    Any non-empty cell outside the tool's own columns counts: the labeller columns of this or an older sheet, a
    column the labeller added (``strict`` on an older sheet) and cells typed beyond the header (which the CSV
    reader gathers as a list). A file that no longer reads as the tool's UTF-8 CSV was edited (a spreadsheet saved
    it in another encoding), so it counts as filled too.
    """
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        return f"edits ({type(e).__name__})"

    def filled(v: str | list[str] | None) -> bool:
        return any(x.strip() for x in v) if isinstance(v, list) else bool((v or "").strip())

    n = sum(any(filled(v) for k, v in r.items() if k not in TOOL_COLUMNS) for r in rows)
    return f"{n} filled row(s)" if n else None


def refuse_filled_sheet(run: str | Path) -> None:
    """Refuse (one line) when ``<run>/audit/sheet.csv`` holds a labeller's work, before anything is written."""
    csv_p = audit_dir(run) / "sheet.csv"
    filled = _filled_rows(csv_p) if csv_p.is_file() else None
    if filled:
        raise UsageError(f"{csv_p} holds labels ({filled}) and is never overwritten; import them with "
                         f"`mechprobe audit {shell_arg(run)} labels={shell_arg(csv_p)}`, then move the file away (e.g. to <labeller>.csv) "
                         f"if you need a blank sheet.csv")


def write_sheet(run: str | Path, sample: AuditSample, table: TurnTable, seed: int | None = None
                ) -> tuple[Path, Path]:
    """Write ``<run>/audit/sheet.html`` and ``<run>/audit/sheet.csv`` for ``sample``.

    Args:
        run: the run directory.
        sample: the recorded sample; table: the run's table; seed: shuffle seed (default the sample's).
    Returns:
        ``(html_path, csv_path)``. A ``sheet.csv`` that holds labels is refused (:func:`refuse_filled_sheet`)
        before either file is written; texts that start like a formula are written through :func:`csv_cell`.
    Example:
        >>> html_p, csv_p = write_sheet(run, sample, table)  # doctest: +SKIP
    """
    refuse_filled_sheet(run)
    rows = sheet_rows(sample, table, seed)
    out = audit_dir(run)
    html_p, csv_p = out / "sheet.html", out / "sheet.csv"
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow([sample.sample_id, r.row, csv_cell(r.query), csv_cell(r.answer), csv_cell(r.turn),
                    *([""] * len(LABELLER_COLUMNS))])
    write_audit_text(html_p, render_sheet_html(sample, rows))
    write_audit_text(csv_p, buf.getvalue(), newline="")
    return html_p, csv_p
