"""Write the evidence bundles of every audited finding into reports/evidence/ (see mechprobe.findings.evidence).

    python scripts/build_evidence.py

Reads only committed files (the audits in reports/, the labelled set); commit what it writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is pip-installed

from mechprobe.findings import build_evidence  # noqa: E402


def main() -> int:
    for p in build_evidence(REPO):
        print(p.relative_to(REPO))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
