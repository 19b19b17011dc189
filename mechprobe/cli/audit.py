"""Blind audit of the judge: draw a sample and write a sheet to label, or import labels and print the report.

    mechprobe audit RUN --n 80 --by condition [--seed 0] [--redraw]     # writes audit/sheet.html + sheet.csv
    mechprobe audit RUN --labels alice.json bob.csv [--labeller-kind person|model]   # imports, then reports

Why one command with two modes: both act on the same recorded sample (``<run>/audit/sample.json``), and the
second is meaningless without the first; keeping them together keeps the sample's arguments in one place.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mechprobe.audit.labels import LABELLER_KINDS, import_labels, load_labellers
from mechprobe.audit.report import build_report, report_markdown, write_report
from mechprobe.audit.sample import load_or_draw, load_sample
from mechprobe.audit.sheet import write_sheet
from mechprobe.audit.table import STRATA, load_run_table
from mechprobe.cli import common

__all__ = ["HELP", "add_args", "run"]

HELP = "blind audit of the judge: a sheet to label, then judge-only vs corrected rates"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the audit command's arguments to ``p`` (the CLI's subparser, or a parser of its own)."""
    common.add_run(p, "the run directory (assistant.jsonl, user_turns.jsonl, labels.jsonl, steering*/)")
    p.add_argument("--n", type=int, default=80, help="turns to audit in total, spread evenly over strata (default 80)")
    p.add_argument("--by", choices=STRATA, default="condition", help="stratum field (default condition)")
    common.add_seed(p)
    p.add_argument("--redraw", action="store_true", help="replace a sample drawn with other --n, --by or --seed")
    p.add_argument("--labels", nargs="+", metavar="FILE",
                   help="import these labels files (one per labeller: the sheet's JSON export or a filled "
                        "sheet.csv), then write and print the report")
    p.add_argument("--labeller-kind", choices=LABELLER_KINDS, default=None,
                   help="person or model, for files that do not say which (CSV)")
    p.add_argument("--alpha", type=float, default=0.05, help="1 - confidence level (default 0.05)")
    p.add_argument("--n-boot", type=int, default=500, help="bootstrap draws for kappa intervals (default 500)")


def run(a: argparse.Namespace) -> int:
    """Draw or reuse the sample and write the sheet, or import ``--labels`` and write the report; returns 0.

    Errors the user can fix raise :class:`~mechprobe.errors.UserError`.

    Example:
        >>> p = argparse.ArgumentParser(); add_args(p)
        >>> run(p.parse_args(["runs/x", "--n", "80", "--by", "condition"]))
        0
    """
    run_dir = Path(a.run)
    table = load_run_table(run_dir)
    if a.labels:
        sample = load_sample(run_dir)
        stored = import_labels(run_dir, a.labels, sample, kind=a.labeller_kind)
        for p in stored:
            print(f"imported {p}")
        rep = build_report(table, sample, load_labellers(run_dir, sample), alpha=a.alpha, n_boot=a.n_boot,
                           seed=a.seed)
        md, js = write_report(run_dir, rep)
        print(report_markdown(rep))
        print(f"report: {md}\nreport data: {js}")
        return 0
    sample, drawn = load_or_draw(run_dir, table, a.n, a.by, a.seed, a.redraw)
    html_p, csv_p = write_sheet(run_dir, sample, table)
    verb = "drew" if drawn else "reused"
    print(f"{verb} sample {sample.sample_id}: {len(sample.record_ids)} turns by {sample.by} "
          + ", ".join(f"{k} {v}" for k, v in sample.per_stratum.items()))
    print(html_p)
    print(csv_p)
    return 0
