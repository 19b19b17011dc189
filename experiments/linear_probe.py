"""Linear probes on the user-role boundary state, layer by layer, with controls.

    python experiments/linear_probe.py                          # embedded default model, builds every stage
    python experiments/linear_probe.py runs/smol-gsm8k --judge offline --layers all
    python experiments/linear_probe.py --transfer-datasets mt_bench ifeval   # + train-on-A/test-on-B matrix

The same code and flags as ``mechprobe probes`` (:mod:`mechprobe.cli.linear_probe`); see README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.linear_probe import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
