"""Markdown rows of one test round of the judge table, each kappa bound to its findings key, for the docs.

    python scripts/judge_table_rows.py "test_hidden:qwen2.5-coder-0.5b-instruct@hidden-v2"
    python scripts/judge_table_rows.py GROUP --judges hidden:qwen2.5-coder-0.5b-instruct@hidden-v2 textfit

Reads the committed ``reports/judge/table.json`` (written by ``mechprobe judges evaluate``); ``mechprobe findings
--check`` then recomputes every bound number from the labels and verdicts. Why a script: the rows are copied into
README.md and docs/findings.md, and a hand-typed row is where a number and its key drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "reports" / "judge" / "table.json"
HEADER = ("| subject model | reading | judge | test turns (items) | binary κ [`95%` CI, item bootstrap] (agree) "
          "| judge vs labellers genuine |\n|---|---|---|---|---|---|")


def _f(x: float) -> str:
    return f"{x:.2f}"


def row(r: dict) -> str:
    """One markdown row; the kappa cell carries its findings key."""
    k = "n/a" if r["kappa"] is None else f"{_f(r['kappa'])} [{_f(r['lo'])}, {_f(r['hi'])}]"
    return (f"| {r['model']} | {r['reading']} | `{r['judge']}` | {r['n']} ({r['items']} items) | "
            f"{k} ({r['agree']}/{r['n']} agree)<!-- ={r['finding']} --> | {r['judge_genuine']} vs "
            f"{r['labellers_genuine']} |")


def rows_of(table: dict, group: str, judges: list[str] | None) -> list[str]:
    """The round's rows (all datasets pooled): per model, strict then lenient, judges in ``judges`` order (default:
    the table's order)."""
    rs = [r for r in table["rows"] if r["split"] == group and r["dataset"] == "all"]
    if not rs:
        groups = sorted({r["split"] for r in table["rows"]})
        raise SystemExit(f"no rows of group {group!r} in {TABLE.relative_to(ROOT)}; groups: {', '.join(groups)}")
    order = judges or list(dict.fromkeys(r["judge"] for r in rs))
    rs = [r for r in rs if r["judge"] in order]
    rs.sort(key=lambda r: (r["model"], ("strict", "lenient").index(r["reading"]), order.index(r["judge"])))
    return [row(r) for r in rs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("group", help="the table's split column, e.g. test_hidden:READER@VERSION (a fit's round)")
    p.add_argument("--judges", nargs="+", help="judges to list, in this order (default: all, table order)")
    a = p.parse_args()
    table = json.loads(TABLE.read_text(encoding="utf-8"))
    print("<!-- findings:begin -->\n" + HEADER)
    print("\n".join(rows_of(table, a.group, a.judges)))
    print("<!-- findings:end -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
