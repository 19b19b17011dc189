"""Run the user-turn probe: ``python experiments/probe.py --dataset gsm8k --limit 50 --out runs/smol-gsm8k``.

Thin wrapper over :mod:`mechprobe.cli.probe` (the same code as the ``mechprobe`` command); see its module and README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.common import friendly  # noqa: E402
from mechprobe.cli.probe import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(friendly(lambda: main(sys.argv[1:])))
