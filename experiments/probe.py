"""Run the user-turn probe: ``python experiments/probe.py --dataset gsm8k --limit 50 --out runs/smol-gsm8k``.

Generates the assistant turn with the model itself, then greedy and sampled user turns after the
model's own user-role header. Re-running the same command resumes; see ``mechprobe probe --help``.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["probe", *sys.argv[1:]]))
