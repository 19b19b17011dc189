"""The pre-registered intervention study: ``python experiments/interventions.py status|run [STEP]|table|verify``.

The same code and flags as ``mechprobe interventions`` (:mod:`mechprobe.cli.interventions`).
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.interventions import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
