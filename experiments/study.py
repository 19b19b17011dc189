"""The paper's studies over the embedded chat models: ``python experiments/study.py [--quick] [--report-only]``.

The same code and flags as ``mechprobe study`` (:mod:`mechprobe.cli.study`); see README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.study import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
