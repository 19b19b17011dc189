"""Collaboration-oriented post-training, then the before/after evaluation (docs/post_training.md).

    mechprobe post-train --model smollm2-135m-instruct                  # LoRA SFT on real human next turns
    mechprobe post-train --model qwen2.5-coder-0.5b-instruct --method dpo   # the DPO preference step

--method sft trains LoRA on real human next turns; --method dpo runs the preference step on pairs of the base
model's own judged user turns. python experiments/post_train.py takes the same flags.
"""

from __future__ import annotations

import argparse

from mechprobe.cli import common
from mechprobe.lm.registry import DEFAULT_MODEL
from mechprobe.post_train.config import DEFAULTS, METHODS, PostTrainConfig
from mechprobe.post_train.dpo import run_dpo
from mechprobe.post_train.evaluate import PostTrainResult, run_post_train
from mechprobe.post_train.train import SOURCES

HELP = "LoRA SFT (or DPO) toward real human next turns, then base vs post-trained vs steered"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the post-train command's flags to ``p`` (also ``experiments/post_train.py``'s)."""
    common.add_model(p, DEFAULT_MODEL)
    p.add_argument("--method", choices=list(METHODS), default="sft",
                   help="sft: LoRA SFT on real human next turns; dpo: the preference step (trl DPO on LoRA) on pairs "
                        "of the base model's own sampled user turns, genuine vs failure (docs/post_training.md)")
    p.add_argument("--out", default=None, help="output dir (default runs/post_train/<model>)")
    p.add_argument("--sources", nargs="+", default=list(SOURCES), help="training conversations")
    p.add_argument("--data-path", default=None, help="folder laid out like shared/data")
    p.add_argument("--data-limit", type=int, default=None, help="first N rows of each source (default: all)")
    p.add_argument("--held-out-fraction", type=float, default=0.1,
                   help="sft: share of the training conversations held out for the step choice")
    p.add_argument("--max-len", type=int, default=None,
                   help=f"skip longer examples / pairs (tokens); default: sft {DEFAULTS['max_len']}, dpo 512")
    p.add_argument("--steps", type=int, default=None,
                   help=f"default: sft at most {DEFAULTS['steps']} (planned to fit --train-minutes), dpo 8")
    p.add_argument("--train-minutes", type=float, default=None,
                   help=f"sft: plan the steps from the measured time of steps 2-3 to fit this budget (default "
                        f"{DEFAULTS['train_minutes']:g} when --steps is not given)")
    p.add_argument("--patience", type=int, default=2,
                   help="sft: stop after this many held-out evaluations (one per checkpoint) without a new best; "
                        "the best step's adapter is the one merged (0: never stop early)")
    p.add_argument("--curve-examples", type=int, default=32,
                   help="sft: held-out conversations scored at every checkpoint for the step choice")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"examples (sft, default {DEFAULTS['batch_size']}) or pairs (dpo, default 2) per step")
    p.add_argument("--lr", type=float, default=None, help=f"default: sft {DEFAULTS['lr']:g}, dpo 1e-4")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: sft 10, dpo 2")
    p.add_argument("--lora-r", type=int, default=DEFAULTS["lora_r"], help="LoRA rank")
    p.add_argument("--lora-alpha", type=int, default=DEFAULTS["lora_alpha"], help="LoRA scaling numerator")
    p.add_argument("--lora-dropout", type=float, default=0.05, help="dropout on the LoRA inputs")
    p.add_argument("--target-modules", default="all-linear", help="'all-linear' or comma-separated names")
    common.add_seed(p)
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help=f"default: sft {DEFAULTS['checkpoint_every']}, dpo 4")
    p.add_argument("--beta", type=float, default=0.1, help="dpo: how far the policy may move from the base model")
    p.add_argument("--pair-items", type=int, default=PostTrainConfig.pair_items,
                   help="dpo: GSM8K training items whose sampled turns make the pairs (never an evaluation item)")
    p.add_argument("--pair-samples", type=int, default=8,
                   help="dpo: user turns sampled per training item at --temperature")
    p.add_argument("--max-pairs", type=int, default=None, help="dpo: use at most this many pairs (default: all)")
    p.add_argument("--device", default="cpu", help="training device (CPU fp32 by default)")
    p.add_argument("--eval-only", action="store_true", help="reuse the trained adapter in --out")
    p.add_argument("--no-eval", action="store_true", help="train and merge only")
    p.add_argument("--eval-datasets", nargs="+", default=["gsm8k", "mt_bench"],
                   help="datasets of the before/after evaluation")
    p.add_argument("--eval-limit", type=int, default=20, help="items per eval dataset")
    p.add_argument("--samples", type=int, default=4, help="sampled user turns per item")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the evaluated user turns")
    p.add_argument("--max-assistant-tokens", type=int, default=PostTrainConfig.max_assistant_tokens,
                   help="answer cap (tokens); items whose answer reaches it are left out of rates")
    p.add_argument("--max-user-tokens", type=int, default=48, help="cap of each user turn (tokens)")
    common.add_judge(p)
    p.add_argument("--relabel", action="store_true",
                   help="eval runs labelled by another judge: move those labels aside and relabel")
    p.add_argument("--steer-run", default=None,
                   help="run whose steering/results.json gives the baked-vector arm (default: the base model's "
                        "gsm8k run runs/<model>-gsm8k when it has one, else <out>/steer-gsm8k, built with "
                        "mechprobe steer --select-on-train)")
    p.add_argument("--no-steer", action="store_true", help="do not build a steering result for the baked arm")
    common.add_include_truncated(p)


def run(a: argparse.Namespace) -> int:
    """Train (or reuse the adapter), merge, evaluate; print the evaluation report."""
    cfg = PostTrainConfig.from_namespace(a)
    show(run_dpo(cfg) if cfg.method == "dpo" else run_post_train(cfg))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python experiments/post_train.py ...``: the same flags and code as ``mechprobe post-train``; the exit code."""
    p = common.command_parser(add_args, __doc__)
    return common.friendly(lambda: run(p.parse_args(argv)), p)


def show(res: PostTrainResult) -> None:
    """Print the evaluation report (nothing more with ``--no-eval``: training printed its progress)."""
    if res.evaluation is not None:
        print(res.evaluation.report)
