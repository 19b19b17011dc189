"""Run the user-turn probe: ``python experiments/probe.py --dataset gsm8k --limit 50 --out runs/smol-gsm8k``.

The same code and flags as ``mechprobe probe`` (:mod:`mechprobe.cli.probe`); see README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.probe import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
