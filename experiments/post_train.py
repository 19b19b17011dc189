"""Collaboration-oriented post-training: LoRA SFT on real human follow-up turns, then before/after evaluation.

    python experiments/post_train.py --model smollm2-135m-instruct            # LoRA SFT on user turns
    python experiments/post_train.py --model qwen2.5-coder-0.5b-instruct --steps 300
    python experiments/post_train.py --eval-only --judge local:qwen2.5-coder-1.5b-instruct

Trains on HH-RLHF and Topical-Chat conversations (the human's next turn, in the user role, loss on that
turn only), resumes from ``<out>/checkpoints`` after a kill, merges the adapter into
``<out>/merged`` (a HF directory every mechprobe command accepts as ``--model``), then probes, judges and
caches base and merged model on GSM8K + MT-Bench and writes ``<out>/report.md``, ``eval_summary.json`` and
``<out>/figures/``. See docs/post_training.md. The work is done by :mod:`mechprobe.post_train` and
:mod:`mechprobe.post_train_eval`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli import accept_negative_numbers, friendly  # noqa: E402
from mechprobe.post_train_eval import add_args, run_cli  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return accept_negative_numbers(p)


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(friendly(lambda: main()))
