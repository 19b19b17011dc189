"""The post-training command's settings: the typed config, the method defaults and the up-front validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mechprobe.errors import UsageError
from mechprobe.judges.factory import check_judge_spec
from mechprobe.lm.models import check_model_source
from mechprobe.post_train import train as pt
from mechprobe.turns.datasets import NAMES

# Defaults sized by a measured throughput (docs/post_training.md): SmolLM2-135M, batch 8, 1 thread on the
# shared 2-core CPU ran 14.7 s/step, so 180 steps (~1440 examples, ~0.75 epoch) take ~44 minutes.
DEFAULTS = dict(steps=180, batch_size=8, max_len=256, lr=3e-4, lora_r=8, lora_alpha=16, checkpoint_every=10,
                train_minutes=20.0)

STEER_DATASET = "gsm8k"
METHODS = ("sft", "dpo")


@dataclass
class PostTrainConfig:
    """Every setting of the command, typed (built from the command line by :mod:`mechprobe.cli`)."""

    model: str = 'smollm2-135m-instruct'  # embedded name, HF id/dir, or .gguf file
    method: str = 'sft'  # sft (LoRA SFT on real human next turns) | dpo (preference step on the base model's turns)
    out: str | None = None  # output dir (default runs/post_train/<model>)
    sources: list[str] = field(default_factory=lambda: ['hh_rlhf', 'topical_chat'])  # training conversations
    data_path: str | None = None  # folder laid out like shared/data
    data_limit: int | None = None  # first N rows of each source (default: all)
    held_out_fraction: float = 0.1
    max_len: int | None = None  # skip longer examples/pairs (tokens); None: the method's default (SFT 256, DPO 512)
    steps: int | None = None  # None: the method's default (SFT: at most 180, sized by train_minutes; DPO 8)
    train_minutes: float | None = None  # SFT without --steps: plan the steps to fit this many minutes (default 20)
    patience: int = 2  # SFT: stop after this many held-out evaluations without a new best
    curve_examples: int = 32  # SFT: held-out conversations scored at every checkpoint (the curve)
    batch_size: int | None = None  # None: the method's default (SFT 8 examples, DPO 2 pairs)
    lr: float | None = None  # None: the method's default (SFT 3e-4, DPO 1e-4)
    warmup_steps: int | None = None  # None: the method's default (SFT 10, DPO 2)
    lora_r: int = pt.TrainConfig.lora_r
    lora_alpha: int = pt.TrainConfig.lora_alpha
    lora_dropout: float = pt.TrainConfig.lora_dropout
    target_modules: str = pt.TrainConfig.target_modules  # 'all-linear' or comma-separated names
    seed: int = pt.TrainConfig.seed
    checkpoint_every: int | None = None  # None: the method's default (SFT 10, DPO 4)
    beta: float = 0.1  # DPO beta
    pair_items: int = 16  # DPO: GSM8K training items sampled for pairs (never an evaluation item)
    pair_samples: int = 8  # DPO: sampled user turns per training item (at --temperature)
    max_pairs: int | None = None  # DPO: use at most this many pairs (default: all)
    device: str = 'cpu'  # training device (CPU fp32 by default)
    eval_only: bool = False  # reuse the trained adapter in --out
    no_eval: bool = False  # train and merge only
    eval_datasets: list[str] = field(default_factory=lambda: ['gsm8k', 'mt_bench'])
    eval_limit: int = 20  # items per eval dataset
    samples: int = 4  # sampled user turns per item
    temperature: float = 1.0
    max_assistant_tokens: int = 1024  # complete answers: a cap cuts answers and drops their items from rates
    max_user_tokens: int = 48
    judge: str | None = None  # a judge spec; None or 'auto': the default-judge rule (judges.factory.default_judge: BEST_JUDGE of judges.registry where its model is fetched)
    relabel: bool = False  # eval runs labelled by another judge: move those labels aside and relabel
    steer_run: str | None = None  # run whose steering/results.json gives the baked-vector arm (default: the base model's gsm8…
    no_steer: bool = False  # do not build a steering result for the baked arm
    include_truncated: bool = False  # keep user turns after truncated assistant answers in rates and paired tests

    @classmethod
    def from_namespace(cls, a: Any) -> PostTrainConfig:
        """Keep only this config's fields of an argparse namespace (the CLI adds its own keys)."""
        return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)})


def validate_args(a: PostTrainConfig) -> None:
    """Every option checked before the first model loads: a bad judge or dataset must not surface only after
    training. (``target_modules`` is checked against the model's modules right after it loads.)"""
    check_model_source(a.model, "model")
    if a.judge is not None and not a.no_eval:
        check_judge_spec(a.judge)
    bad = []
    unknown = [s for s in a.sources if s not in pt.SOURCES]
    if unknown:
        bad.append(f"sources={unknown} unknown; choose from {', '.join(pt.SOURCES)}")
    unknown = [d for d in a.eval_datasets if d not in NAMES]
    if unknown:
        bad.append(f"eval_datasets={unknown} unknown; choose from {', '.join(NAMES)}")
    if a.data_path is not None and not Path(a.data_path).exists():
        bad.append(f"data_path={a.data_path} does not exist")
    if a.steer_run is not None and not Path(a.steer_run).exists():
        bad.append(f"steer_run={a.steer_run} does not exist")
    if a.data_limit is not None and a.data_limit < 1:
        bad.append(f"data_limit={a.data_limit}: must be >= 1")
    if not 0.0 <= a.held_out_fraction < 1.0:
        bad.append(f"held_out_fraction={a.held_out_fraction}: must be in [0, 1)")
    if a.method not in METHODS:
        bad.append(f"method={a.method!r} unknown; choose from {', '.join(METHODS)}")
    if a.max_pairs is not None and a.max_pairs < 1:
        bad.append(f"max_pairs={a.max_pairs}: must be >= 1")
    for flag in ("batch_size", "max_len", "eval_limit", "samples", "max_assistant_tokens", "max_user_tokens", "pair_items",
                 "pair_samples"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            bad.append(f"{flag}={getattr(a, flag)}: must be >= 1")
    if not (math.isfinite(a.temperature) and a.temperature > 0):
        bad.append(f"temperature={a.temperature}: must be a finite number > 0 (the sampled turns)")
    try:
        torch.device(a.device)
    except RuntimeError:
        bad.append(f"device={a.device!r} is not a torch device (cpu, cuda, cuda:0, mps)")
    if bad:
        raise UsageError("; ".join(bad))
