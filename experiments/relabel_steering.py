"""Re-judge a finished steering run's turns with another judge, without generating anything again.

    python experiments/relabel_steering.py RUN [--steer-dir RUN/steering_llamacpp] --judge hybrid2:MODEL

The same code and flags as ``mechprobe relabel-steering`` (:mod:`mechprobe.cli.relabel_steering`); see README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.relabel_steering import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
