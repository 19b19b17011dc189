"""Collaboration-oriented post-training: LoRA SFT on real human follow-up turns, then before/after evaluation.

    python experiments/post_train.py --model smollm2-135m-instruct            # LoRA SFT on user turns
    python experiments/post_train.py --model qwen2.5-coder-0.5b-instruct --method dpo   # the DPO preference step

The same code and flags as ``mechprobe post-train`` (:mod:`mechprobe.cli.post_train`); see README.md.
"""

import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli.post_train import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
