"""Steering vectors that raise genuine follow-ups under greedy decoding, with controls.

    python experiments/steer.py                   # embedded default: (layer, alpha) chosen on train items, then held out
    python experiments/steer.py --alpha 4         # the same, the train sweep's ladder running up to 4 x resid norm
    python experiments/steer.py runs/smol-gsm8k --no-select-on-train --layer 12 --alpha-unit raw --alpha 0 1 2 4

The same code and flags as ``mechprobe steer`` (:mod:`mechprobe.cli.steer`); see README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.steer import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
