"""Blind audit of judge labels and prediction-powered correction of follow-up rates.

Draw a stratified sample of a run's judged turns (:mod:`.sample`), label it blind in a self-contained HTML
sheet or CSV (:mod:`.sheet`, codebook in :mod:`.codebook`), import each labeller's file (:mod:`.labels`) and
report agreement plus judge-only vs corrected rates (:mod:`.report`, :mod:`.estimate`). A codebook-free check
of grounding, answer identification (which of two answers to the same query did the turn follow?), is in
:mod:`.identify`. The command lives in :mod:`mechprobe.cli.audit`.
"""

from __future__ import annotations

from .agreement import Kappa, kappa_with_ci
from .codebook import codebook_path, codebook_text
from .estimate import (
    Estimate,
    audit_only_difference,
    audit_only_rate,
    corrected_paired_difference,
    corrected_rate,
    judge_only_difference,
    judge_only_rate,
)
from .identify import identification_report, write_identify_sheet
from .labels import (
    LabellerLabels,
    RowLabel,
    import_labels,
    load_labellers,
    read_labellers_file,
    read_labels_file,
)
from .report import build_report, report_markdown, write_report
from .sample import AuditSample, draw_sample, load_or_draw, load_sample
from .sheet import render_sheet_html, sheet_rows, write_sheet
from .table import LabelledTurn, TurnTable, load_run_table, table_from_rows

__all__ = [
    "AuditSample", "Estimate", "Kappa", "LabelledTurn", "LabellerLabels", "RowLabel", "TurnTable",
    "audit_only_difference", "audit_only_rate", "build_report", "codebook_path", "codebook_text", "corrected_paired_difference", "corrected_rate",
    "draw_sample", "identification_report", "import_labels", "judge_only_difference", "judge_only_rate",
    "kappa_with_ci", "load_labellers", "load_or_draw", "load_run_table", "load_sample", "read_labellers_file",
    "read_labels_file", "render_sheet_html", "report_markdown", "sheet_rows", "table_from_rows",
    "write_identify_sheet", "write_report", "write_sheet",
]
