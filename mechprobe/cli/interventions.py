"""The intervention study: a pre-registered plan, fixed conversations, arms labelled blind; resumable step by step.

    mechprobe interventions status                 # every step: done (wall time) / pending / external (labels)
    mechprobe interventions run                    # run what is pending, in order, up to the next labelling step
    mechprobe interventions run heldout_base       # one step
    mechprobe interventions table                  # the held-out table from both labellers' files
    mechprobe interventions verify                 # committed outputs still match the ledger's sha256

Outputs go to REPORTS/<plan name>/ (default reports/interventions/), with full texts, so each finished step can
be committed at once. The plan (default studies/interventions/plan_v2c.json, the one in force) is pinned by its sha256 in the ledger.
"""

from __future__ import annotations

import argparse

from mechprobe.cli import common
from mechprobe.study.interventions import Study, load_plan

HELP = "the pre-registered intervention study: status, run steps, table"

ACTIONS = ("status", "run", "table", "verify")


def add_args(p: argparse.ArgumentParser) -> None:
    """Add ``ACTION [STEP]``, ``--plan`` and ``--reports`` to ``p``."""
    p.add_argument("action", choices=ACTIONS, metavar="ACTION", help=f"one of {', '.join(ACTIONS)}")
    p.add_argument("step", nargs="?", default=None, metavar="STEP", help="with run: only this step")
    p.add_argument("--plan", default="studies/interventions/plan_v2c.json", help="the committed plan file in force")
    p.add_argument("--reports", default="reports/interventions", help="where each step's outputs go")
    p.add_argument("--work", default="runs/interventions", help="scratch space (not committed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(a: argparse.Namespace) -> int:
    """Show the ledger, run steps, write the table or verify the committed outputs."""
    study = Study(load_plan(a.plan), a.reports, a.work, progress=not a.no_progress)
    if a.action == "status":
        print(f"plan {study.plan.path} (sha256 {study.plan.sha256[:12]}…), outputs in {study.root}")
        for st in study.status():
            t = f"{st.seconds / 60:6.1f} min" if st.seconds is not None else " " * 10
            print(f"  {st.name:28s} {st.state:9s} {t}  {st.note}")
        return 0
    if a.action == "run":
        ran = study.run(a.step)
        print("ran: " + (", ".join(ran) if ran else "nothing (done, or waiting for labels: see status)"))
        return 0
    if a.action == "table":
        study.table()
        print((study.root / "table.md").read_text(encoding="utf-8"))
        return 0
    bad = study.verify()
    for b in bad:
        print(f"changed since its step finished: {b}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """``python experiments/interventions.py ...``: the same flags and code as ``mechprobe interventions``."""
    return common.friendly(lambda: run(common.command_parser(add_args, __doc__).parse_args(argv)))
