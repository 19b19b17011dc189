"""Recompute every number the findings quote from committed files, print them, and check the docs against them.

    mechprobe findings                                 # table of keys and values; writes reports/findings.json
    mechprobe findings --check                         # also check README.md and docs/findings.md (when there)
    mechprobe findings --check docs/post_training.md   # check the named files instead

Audited rates, differences and kappas are recomputed from each audit's committed sample and labels with the
package's statistics where the labels alone decide them; numbers that need the judge's verdict per turn (not
committed) are read from the committed report and marked "read". Only lines between <!-- findings:begin -->
and <!-- findings:end --> are checked: every interval, fraction, percentage and decimal number there (not inline
code, not whole numbers without %) names its key with a marker after it, <!-- =KEY -->, and must equal that key's
value at the precision quoted; README.md may bind only recomputed keys. Exit 1 lists each number that does not
match, each unbound number, each block that checks nothing, and each recomputed number that differs from the
committed report it reproduces. Bad input (a missing or non-UTF-8 file, --json naming a directory, a malformed
committed file) is one line and exit 2, found before the work starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mechprobe.errors import UsageError
from mechprobe.findings import check_file, compute_findings, findings_json, findings_markdown, read_markdown

HELP = "recompute the findings' numbers from committed files; --check the docs that quote them"
DEFAULT_CHECK = ("README.md", "docs/findings.md", "docs/findings_appendix.md")


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the findings command's flags to ``p``."""
    p.add_argument("--root", default=".", help="the repository (its reports/ holds the committed audits)")
    p.add_argument("--json", default="reports/findings.json",
                   help="write every value here (relative to --root); '' writes nothing")
    p.add_argument("--check", nargs="*", default=None, metavar="FILE",
                   help=f"check the numbers quoted in these markdown files (default: {' and '.join(DEFAULT_CHECK)} "
                        "where they exist)")
    p.add_argument("--quiet", action="store_true", help="do not print the table")


def _inputs(a: argparse.Namespace, root: Path) -> tuple[Path | None, list[Path] | None]:
    """The --json target and the files to check, validated before the work (which takes a minute)."""
    out = root / a.json if a.json else None
    if out is not None and out.is_dir():
        raise UsageError(f"--json {a.json}: {out} is a directory; name a file (default reports/findings.json) "
                         f"or pass --json '' to write nothing")
    if a.check is None:
        return out, None
    files = [Path(x) for x in a.check] if a.check else [root / x for x in DEFAULT_CHECK if (root / x).exists()]
    for path in files:
        read_markdown(path)  # missing, a folder or not UTF-8: one line now, not after the recomputation
    return out, files


def run(a: argparse.Namespace) -> int:
    """Compute, print, write; with ``--check`` return 1 when a quoted number is not its key's value, a block
    checks nothing, or a recomputed number differs from the committed report."""
    root = Path(a.root)
    if not (root / "reports").is_dir():
        raise UsageError(f"{root}/reports not found; run the command from the repository root or pass --root")
    out, files = _inputs(a, root)
    if files is not None and not files:
        print("mechprobe findings --check: no file to check (README.md and docs/findings.md not found); pass FILE",
              file=sys.stderr)
        return 1
    f = compute_findings(root)
    if not a.quiet:
        print(findings_markdown(f))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(findings_json(f), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if files is None:
        return 0
    failures: list[str] = [f"mismatch: {m}" for m in f.mismatches]
    n = 0
    for path in files:
        quoted, bad = check_file(path, f.values)
        n += len(quoted)
        failures += bad
    for line in failures:
        print(line, file=sys.stderr)
    print(f"checked {n} quoted numbers in {', '.join(str(p) for p in files)}: "
          f"{'all match' if not failures else f'{len(failures)} failures'}")
    return 1 if failures else 0
