"""Blind audit of the judge: draw a sample and write a sheet to label, or import labels and print the report.

    mechprobe audit RUN --n 80 --by condition [--seed 0] [--redraw]     # audit/sheet.html + sheet.csv + identify.html
    mechprobe audit RUN --labels alice.json bob.csv [--labeller-kind person|model]   # imports, then reports

Why one command with two modes: both act on the same recorded sample (``<run>/audit/sample.json``), and the
second is meaningless without the first; keeping them together keeps the sample's arguments in one place.
Both modes write under the audit directory's lock (:func:`mechprobe.audit.store.audit_lock`), and check every
input (flags, the sample against the run's judge labels, a filled sheet.csv) before they write anything.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from mechprobe.audit.identify import (
    identification_report,
    import_identify,
    is_identify_file,
    store_identify,
    write_identify_sheet,
)
from mechprobe.audit.labels import LABELLER_KINDS, import_labels, load_labellers
from mechprobe.audit.report import (
    build_report,
    check_report_args,
    check_sample_judged,
    report_markdown,
    write_report,
)
from mechprobe.audit.sample import audit_dir, load_or_draw, load_sample
from mechprobe.audit.sheet import FORMULA_START, refuse_filled_sheet, sheet_rows, write_sheet
from mechprobe.audit.store import audit_lock
from mechprobe.audit.table import STRATA, TurnTable, load_run_table
from mechprobe.cli import common
from mechprobe.errors import UsageError
from mechprobe.io import shell_arg

__all__ = ["HELP", "add_args", "run"]

HELP = "blind audit of the judge: a sheet to label, then judge-only vs corrected rates"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the audit command's arguments to ``p`` (the CLI's subparser, or a parser of its own)."""
    common.add_run(p, "the run directory (assistant.jsonl, user_turns.jsonl, labels.jsonl, steering*/)")
    p.add_argument("--n", type=int, default=80, help="turns to audit in total, spread evenly over strata (default 80)")
    p.add_argument("--by", choices=STRATA, default="condition", help="stratum field (default condition)")
    common.add_seed(p)
    p.add_argument("--turns-per-item", type=int, default=1, metavar="K",
                   help="at most K turns of one item per stratum in the sample (default 1: spread over items; "
                        "0 = no limit); intervals are item-clustered whenever an item has several turns")
    p.add_argument("--redraw", action="store_true", help="replace a sample drawn with other --n, --by or --seed")
    p.add_argument("--labels", nargs="+", metavar="FILE",
                   help="import these files (sheet.html's JSON export, or a filled sheet.csv: one stored "
                        "labeller per name in its labeller column; identify.html's export), then write and print "
                        "the report")
    p.add_argument("--labeller-kind", choices=LABELLER_KINDS, default=None,
                   help="person or model, for files that do not say which (CSV)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence level of every interval, strictly between 0 and 1 (default 0.95)")
    # Deprecated spelling of 1 - confidence: read as --confidence 1-A with a note (alpha is a steering strength
    # everywhere else in the package).
    p.add_argument("--alpha", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-boot", type=int, default=500, help="bootstrap draws for kappa intervals (default 500, at least 20)")


def run(a: argparse.Namespace) -> int:
    """Draw or reuse the sample and write the sheet, or import ``--labels`` and write the report; returns 0.

    Errors the user can fix raise :class:`~mechprobe.errors.UserError`.

    Example:
        >>> p = argparse.ArgumentParser(); add_args(p)  # doctest: +SKIP
        >>> run(p.parse_args(["runs/x", "--n", "80", "--by", "condition"]))  # doctest: +SKIP
        0
    """
    run_dir = Path(a.run)
    if a.labels:
        check_report_args(significance(a), a.n_boot)
    table = load_run_table(run_dir)
    if a.labels:
        load_sample(run_dir)  # no sample: say how to draw one before making audit/
    with audit_lock(audit_dir(run_dir)):
        return _labels(a, run_dir, table) if a.labels else _sheet(a, run_dir, table)


def significance(a: argparse.Namespace) -> float:
    """1 - ``--confidence`` (the statistics' significance level), or the deprecated ``--alpha`` read as such.

    Rounded to 12 digits, so ``--confidence 0.95`` gives exactly the 0.05 the report always used."""
    c = a.confidence
    if a.alpha is not None:
        if c != 0.95 and not math.isclose(c, 1 - a.alpha):
            raise UsageError(f"--alpha {a.alpha:g} (1 - confidence, deprecated) and --confidence {c:g} disagree; pass "
                             "--confidence alone")
        c = 1 - a.alpha
        print(f"note: --alpha {a.alpha:g} is deprecated on audit (it meant 1 - confidence); read as --confidence "
              f"{c:g}", file=sys.stderr)
    if not (math.isfinite(c) and 0 < c < 1):
        raise UsageError(f"--confidence {c:g}: must be strictly between 0 and 1; pass --confidence 0.95 for 95% "
                         "intervals")
    return round(1 - c, 12)


def _labels(a: argparse.Namespace, run_dir: Path, table: TurnTable) -> int:
    sample = load_sample(run_dir)
    check_sample_judged(sample, table, run_dir)
    load_labellers(run_dir, sample)  # a damaged stored file is refused before anything new is stored
    ident = [p for p in a.labels if is_identify_file(p)]
    checked = import_identify(run_dir, ident, sample, kind=a.labeller_kind) if ident else []
    coded = [p for p in a.labels if p not in ident]
    stored = import_labels(run_dir, coded, sample, kind=a.labeller_kind) if coded else []
    for p in stored + store_identify(checked):
        print(f"imported {p}")
    level = significance(a)
    rep = build_report(table, sample, load_labellers(run_dir, sample), alpha=level, n_boot=a.n_boot, seed=a.seed)
    rep["identification"] = identification_report(run_dir, table, sample, alpha=level, n_boot=a.n_boot, seed=a.seed)
    md, js = write_report(run_dir, rep)
    print(report_markdown(rep))
    print(f"report: {md}\nreport data: {js}")
    return 0


def _sheet(a: argparse.Namespace, run_dir: Path, table: TurnTable) -> int:
    refuse_filled_sheet(run_dir)  # before a redraw replaces the sample the filled sheet belongs to
    sample, drawn = load_or_draw(run_dir, table, a.n, a.by, a.seed, a.redraw, a.turns_per_item)
    html_p, csv_p = write_sheet(run_dir, sample, table)
    ident_p, pairs = write_identify_sheet(run_dir, sample, table)
    verb = "drew" if drawn else "reused"
    print(f"{verb} sample {sample.sample_id}: {len(sample.record_ids)} turns by {sample.by} "
          + ", ".join(f"{k} {v}" for k, v in sample.per_stratum.items()))
    quoted = sum(t.startswith(FORMULA_START) for r in sheet_rows(sample, table) for t in (r.query, r.answer, r.turn))
    if quoted:
        print(f"note: {quoted} text(s) in sheet.csv start like a spreadsheet formula (= + - @ tab CR) and carry a "
              f"leading ' so that spreadsheets show them as text; the ' is not part of the turn")
    print(html_p)
    print(csv_p)
    print(ident_p)
    print(_next_steps(run_dir, html_p, csv_p, ident_p, len(pairs["pairs"]), len(pairs["left_out"])))
    return 0


def _next_steps(run_dir: Path, html_p: Path, csv_p: Path, ident_p: Path, n_pairs: int, n_left: int) -> str:
    """What to do with the files just written: which to open, and the command that imports the result."""
    left = f"; {n_left} turns have no distractor and are left out" if n_left else ""
    return "\n".join([
        "next:",
        f"  1. label: open {html_p} in a browser (offline, from file://), type your name, label every row "
        f"(keys 1-8; y/g/d/a the strict reading of a genuine row), press Export (e); or fill the label column "
        f"(and strict on genuine_followup rows) of a copy of {csv_p.name}",
        f"  2. optional, a codebook-free check by someone who has not seen {html_p.name}: open {ident_p} "
        f"({n_pairs} pairs{left}), pick the answer each turn follows, Export",
        f"  3. import and report: mechprobe audit {shell_arg(run_dir)} --labels <exported .json or filled .csv> ... "
        f"[--labeller-kind person|model]",
    ])
