"""The paper's studies over the embedded chat models: ``python experiments/study.py [--quick] [--report-only]``.

Runs (or resumes) every model x dataset, its perturbations and the human reference, judges them and
writes ``reports/study/README.md`` with ``figures/study_*.png``. See docs/study.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.study import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
