"""The preference step: DPO (``trl``) on a LoRA adapter, from pairs of user turns the base model sampled itself.

The paper's RL step is PPO with a judge's verdict as the reward: the policy samples user turns online, the judge
scores them, the policy moves towards higher-scored turns. DPO is its cheap offline stand-in: the turns are
sampled once from the *base* model (:mod:`mechprobe.post_train.pairs`), judged once, and the policy is trained
to prefer a genuine follow-up over a failure of the same prompt relative to the base model (the reference is
the base model itself: the adapter switched off), with no reward model, no value head and no online sampling.

Training is ``trl.DPOTrainer`` on the pre-tokenised pairs (``prompt_ids``/``chosen_ids``/``rejected_ids``: the
probe prompt and the sampled ids, so nothing is re-tokenised), LoRA with the SFT defaults, CPU fp32, seeded.
Checkpoints are the Trainer's own (``checkpoint-N/``: adapter, optimizer, scheduler, RNG states); re-running the
same command after a kill resumes from the newest one, and ``train_log.jsonl`` rows after it are redone.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mechprobe.audit.rates import audit_truth
from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import output_dir_lock, read_json, read_jsonl, write_json
from mechprobe.judges.factory import default_judge
from mechprobe.judges.run import judge_run
from mechprobe.lm.models import load_model
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.post_train import loss_title, plot_loss
from mechprobe.post_train import train as pt
from mechprobe.post_train.config import PostTrainConfig, validate_args
from mechprobe.post_train.evaluate import PostTrainResult, evaluate_arms
from mechprobe.post_train.pairs import (
    PAIR_DATASET,
    PAIRS_FILE,
    PAIRS_MANIFEST,
    RESERVED_ROWS,
    Pair,
    PairError,
    build_pairs,
    check_disjoint,
    judge_error_on_pairs,
    require_pairs,
    training_item_ids,
    write_pairs,
)
from mechprobe.records import truncated_item_ids
from mechprobe.splits import STEERING_SPLIT, load_split
from mechprobe.stages import probe_config
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ASSISTANT, USER_TURNS, run_probe

CKPT_PREFIX = "checkpoint-"
DPO_DIR = "dpo"
# Probe prompt (system + GSM8K question + an answer of up to 192 tokens + header) + a user turn of up to 48 tokens.
DPO_MAX_LEN = 512
TRAIN_LOG = pt.TRAIN_LOG


@dataclass
class DPOTrainConfig:
    """What determines the DPO adapter (``dpo_config.json``; a resume must match it, only ``steps`` may grow).

    Args:
        steps: optimizer steps.
        batch_size: pairs per step (each pair is two sequences, plus two reference passes).
        lr: peak learning rate (linear warmup, cosine decay to 10%).
        warmup_steps: warmup steps.
        beta: DPO's beta (how far the policy may move from the reference; trl's default 0.1).
        lora_r: LoRA rank (SFT's default).
        lora_alpha: LoRA alpha.
        lora_dropout: LoRA dropout (trl's ``disable_dropout`` sets it to 0 in training, so the policy and the
            reference pass see the same network; kept for the adapter config).
        target_modules: ``all-linear`` or comma-separated module names.
        seed: seed of LoRA init, data order and every RNG.
        checkpoint_every: steps between checkpoints.
        keep_checkpoints: checkpoints kept.
        max_grad_norm: gradient clipping.

    Example:
        >>> DPOTrainConfig(steps=4).validate()
        >>> DPOTrainConfig(beta=0).validate()
        Traceback (most recent call last):
        ...
        mechprobe.errors.UsageError: invalid DPO config: beta must be a positive number, got 0
    """

    steps: int = 8
    batch_size: int = 2
    lr: float = 1e-4
    warmup_steps: int = 2
    beta: float = 0.1
    lora_r: int = pt.TrainConfig.lora_r
    lora_alpha: int = pt.TrainConfig.lora_alpha
    lora_dropout: float = pt.TrainConfig.lora_dropout
    target_modules: str = pt.TrainConfig.target_modules
    seed: int = 0
    checkpoint_every: int = 4
    keep_checkpoints: int = 2
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        bad = []
        try:
            pt.TrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr, warmup_steps=self.warmup_steps,
                           lora_r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                           target_modules=self.target_modules, checkpoint_every=self.checkpoint_every,
                           keep_checkpoints=self.keep_checkpoints).validate()
        except UsageError as e:
            bad.append(str(e).split(": ", 1)[1])
        if not (self.beta > 0 and math.isfinite(self.beta)):
            bad.append(f"beta must be a positive number, got {self.beta}")
        if bad:
            raise UsageError("invalid DPO config: " + "; ".join(bad))


@dataclass
class DPOResult:
    steps_done: int
    resumed_from: int | None
    seconds: float


def latest_trainer_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete Trainer checkpoint (``checkpoint-N`` with its ``trainer_state.json``)."""
    if not ckpt_root.is_dir():
        return None
    done = [p for p in ckpt_root.glob(f"{CKPT_PREFIX}*") if (p / "trainer_state.json").exists()
            and p.name[len(CKPT_PREFIX):].isdigit()]
    return max(done, key=lambda p: int(p.name[len(CKPT_PREFIX):])) if done else None


def _dataset(pairs: Sequence[Pair]) -> Any:
    from datasets import Dataset  # lazy: optional extra `train` (trl brings it)

    return Dataset.from_dict({"prompt_ids": [p.prompt_ids for p in pairs],
                              "chosen_ids": [p.chosen_ids for p in pairs],
                              "rejected_ids": [p.rejected_ids for p in pairs]})


def _trl() -> Any:
    """trl, imported lazily (an optional heavy dependency: ``pip install 'mechprobe[train]'``)."""
    try:
        import trl  # lazy: extra [train]
    except ImportError as e:
        raise MissingInput("the preference step needs trl and peft: pip install 'mechprobe[train]' "
                           "(trl==1.16.0, peft==0.21.2)") from e
    return trl


def train_dpo(model: torch.nn.Module, tokenizer: Any, pairs: Sequence[Pair], cfg: DPOTrainConfig, out: str | Path,
              *, device: str = "cpu", progress: bool = True) -> tuple[Any, DPOResult]:
    """Train (or resume) a LoRA adapter with ``trl.DPOTrainer`` on ``pairs``; returns the peft model and a summary.

    Resumes from the newest ``out/checkpoints/checkpoint-N`` when ``out/dpo_config.json`` matches ``cfg`` (another
    config is refused; only ``steps`` may grow). ``out/train_log.jsonl``: one row per step (DPO loss, reward
    margin and accuracy, lr, grad norm, seconds); rows after the resumed checkpoint are dropped and redone. The
    adapter goes to ``out/adapter``.

    Args:
        model: a HF causal LM (its weights stay frozen; the reference is the same model with the adapter off).
        tokenizer: its tokenizer (saved with checkpoints; its pad id pads batches).
        pairs: the preference pairs (pre-tokenised).
        cfg: the training config.
        out: the training directory.
        device: ``cpu`` (fp32) or a CUDA device.
        progress: show the Trainer's progress bar.

    Returns:
        (peft model, :class:`DPOResult`).

    Example:
        >>> pm, res = train_dpo(model, tok, pairs, DPOTrainConfig(steps=4), "runs/x/dpo")   # doctest: +SKIP
    """
    trl = _trl()
    from peft import LoraConfig  # lazy: extra [train]
    from transformers import TrainerCallback  # lazy: slow import, model paths only

    cfg.validate()
    if not pairs:
        raise pt.PostTrainError("no preference pairs")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / pt.CKPT_DIR
    want = {**asdict(cfg), "trl": trl.__version__, "n_pairs": len(pairs),
            "data_hash": hashlib.sha256(json.dumps([[p.prompt_ids, p.chosen_ids, p.rejected_ids] for p in pairs])
                                        .encode()).hexdigest()}
    cfg_path = out / "dpo_config.json"
    ck = latest_trainer_checkpoint(ckpt_root)
    if cfg_path.exists() and ck is not None:
        have = read_json(cfg_path)
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k) and k != "steps")
        if diff:
            raise UserError(f"{out} holds a DPO run with another config ({', '.join(diff)} differ): pass the same "
                            "options to resume, or another out=")
    write_json(cfg_path, want)
    log_path = out / TRAIN_LOG
    resumed = None
    if ck is not None:
        resumed = int(read_json(ck / "trainer_state.json")["global_step"])
        rows = [r for r in read_jsonl(log_path, key="step") if int(r["step"]) <= resumed] if log_path.exists() else []
        tmp = log_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, log_path)
    elif log_path.exists():
        log_path.unlink()  # no checkpoint: the run starts over, so must its log

    crash_at = int(os.environ.get(pt.CRASH_ENV, "-1"))

    class _Log(TrainerCallback):
        """One log row per step (the Trainer logs every step); the crash hook for the resume test."""

        t0 = time.time()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.time()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "loss" not in logs:
                return
            row = {"step": int(state.global_step), "loss": round(float(logs["loss"]), 6),
                   "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm"),
                   "reward_margin": logs.get("rewards/margins"), "reward_accuracy": logs.get("rewards/accuracies"),
                   "seconds": round(time.time() - self.t0, 3)}
            with open(log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if row["step"] == crash_at:
                os._exit(17)

    class _Trainer(trl.DPOTrainer):
        """``DPOTrainer`` that takes the pairs already tokenised: its own tokenisation would re-tokenise prompt and
        completion as text and append ``eos`` (not the template's end-of-turn token on every family)."""

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            return dataset

    on_cpu = torch.device(device).type == "cpu"
    args = trl.DPOConfig(
        output_dir=str(ckpt_root), max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=cfg.warmup_steps, weight_decay=0.0, max_grad_norm=cfg.max_grad_norm, beta=cfg.beta,
        logging_steps=1, save_strategy="steps", save_steps=cfg.checkpoint_every, save_total_limit=cfg.keep_checkpoints,
        seed=cfg.seed, data_seed=cfg.seed, bf16=False, fp16=False, use_cpu=on_cpu, gradient_checkpointing=False,
        report_to=[], max_length=None, dataloader_num_workers=0, disable_tqdm=not progress, save_only_model=False)
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=pt.TrainConfig(target_modules=cfg.target_modules).target(), task_type="CAUSAL_LM",
                      bias="none")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(cfg.seed)
    trainer = _Trainer(model=model, args=args, train_dataset=_dataset(pairs), processing_class=tokenizer,
                       peft_config=lcfg, callbacks=[_Log()])
    t0 = time.time()
    trainer.train(resume_from_checkpoint=str(ck) if ck is not None else None)
    pm = trainer.model
    pm.eval()
    pm.save_pretrained(out / pt.ADAPTER_DIR)
    return pm, DPOResult(steps_done=int(trainer.state.global_step), resumed_from=resumed, seconds=time.time() - t0)


def log_summary(log: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds, seconds per step, first loss, mean of the last 10 losses / reward accuracies, from the whole log."""
    secs = sum(r["seconds"] for r in log)
    last = log[-10:]
    return {"seconds": round(secs, 1), "seconds_per_step": round(secs / len(log), 2) if log else None,
            "first_loss": log[0]["loss"] if log else None,
            "last_loss_mean10": round(float(np.mean([r["loss"] for r in last])), 4) if log else None,
            "last_reward_accuracy_mean10": round(float(np.mean([r["reward_accuracy"] or 0 for r in last])), 3)
            if log else None}


def load_base(model: str, device: str) -> Any:
    """The base model in fp32 on ``device`` (the policy's frozen weights and, adapter off, the reference)."""
    return load_model(model, device=device, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# The command (experiments/post_train.py --method dpo)


def dpo_config(a: PostTrainConfig) -> DPOTrainConfig:
    """The DPO training config of the command: its flags, the DPO defaults where a flag was not given."""
    d = DPOTrainConfig()
    return DPOTrainConfig(steps=d.steps if a.steps is None else a.steps,
                          batch_size=d.batch_size if a.batch_size is None else a.batch_size,
                          lr=d.lr if a.lr is None else a.lr,
                          warmup_steps=d.warmup_steps if a.warmup_steps is None else a.warmup_steps, beta=a.beta,
                          lora_r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                          target_modules=a.target_modules, seed=a.seed,
                          checkpoint_every=d.checkpoint_every if a.checkpoint_every is None else a.checkpoint_every)


def evaluation_item_ids(a: PostTrainConfig) -> tuple[set[str], dict[str, Any]]:
    """Every item id an evaluation reads: the first ``--eval-limit`` items of each eval dataset (what the eval arms
    probe) and both lists of the fixed steering split (its train items build the baked arm's vector, its held-out
    items are the steering evaluation). Returns the ids and what they were (for the manifest)."""
    ids: set[str] = set()
    what: dict[str, Any] = {}
    for ds in a.eval_datasets:
        got = [it.item_id for it in load_dataset(ds, limit=a.eval_limit).items]
        ids |= set(got)
        what[f"post_train_eval_{ds}"] = got
    split = load_split(STEERING_SPLIT)
    ids |= set(split.heldout) | set(split.train)
    what["steering_split"] = {"name": split.name, "sha256": split.sha256, "n_heldout": len(split.heldout),
                              "n_train": len(split.train)}
    what["rows_below"] = RESERVED_ROWS
    return ids, what


def run_dpo(a: PostTrainConfig) -> PostTrainResult:
    """Sample and judge the base model's user turns on training items, build pairs, train DPO, merge, evaluate.

    Everything goes to ``<out>/dpo/`` (``pairs-gsm8k/`` probe run, ``pairs.jsonl``, ``pairs_manifest.json``,
    ``checkpoints/``, ``adapter/``, ``merged/``, ``train_summary.json``); the evaluation arms ``base``, ``dpo`` (and
    ``post`` when an SFT model exists in ``<out>``) share ``<out>/eval/`` with SFT, and the report is
    ``<out>/report_dpo.md``.

    Args:
        a: the command's config (``method == "dpo"``).

    Returns:
        what was written; the command line prints its report.

    Example:
        >>> run_dpo(PostTrainConfig(method="dpo", steps=4, no_eval=True)).merged   # doctest: +SKIP
        PosixPath('runs/post_train/smollm2-135m-instruct/dpo/merged')
    """
    validate_args(a)
    cfg = dpo_config(a)
    cfg.validate()
    name = Path(a.model).name.replace(".gguf", "")
    out = Path(a.out) if a.out else Path("runs") / "post_train" / name
    if a.eval_only and not (out / DPO_DIR / pt.MERGED_DIR / "config.json").exists():
        raise MissingInput(f"eval_only=True needs a trained DPO model at {out / DPO_DIR / pt.MERGED_DIR}: train first")
    with output_dir_lock(out, "post-training", "out"):
        return _run_dpo(a, cfg, out)


def _run_dpo(a: PostTrainConfig, cfg: DPOTrainConfig, out: Path) -> PostTrainResult:
    """:func:`run_dpo` once ``out`` is locked (its evaluation shares ``<out>/eval/`` with SFT)."""
    d = out / DPO_DIR
    merged_dir = d / pt.MERGED_DIR
    if a.eval_only:
        info = read_json(d / "train_summary.json") if (d / "train_summary.json").exists() else {}
        refresh_pair_error(d, info)
    else:
        info = _train(a, cfg, d)
    res = PostTrainResult(out, "dpo", info, merged_dir,
                          figures=[] if a.eval_only else [d / "figures" / "post_train_loss_dpo.png"])
    if a.no_eval:
        return res
    trained = {"dpo": str(merged_dir)}
    if (out / pt.MERGED_DIR / "config.json").exists():
        trained["post"] = str(out / pt.MERGED_DIR)
    res.evaluation = evaluate_arms(a, out, trained, info, suffix="_dpo", what="DPO")
    return res


def refresh_pair_error(d: Path, info: dict[str, Any]) -> None:
    """Recompute the judge's error on the pairs from the pairs run's audit, which usually arrives after training
    (``--eval-only`` then fills it into the summary, the manifest and the report without retraining)."""
    pairs_p, run = d / PAIRS_FILE, d / f"pairs-{PAIR_DATASET}"
    truth = audit_truth(run) if run.exists() else None
    if truth is None or not pairs_p.exists():
        return
    err = judge_error_on_pairs([Pair.from_dict(r) for r in read_jsonl(pairs_p)], truth)
    info["judge_error_on_pairs"] = err
    if (d / "train_summary.json").exists():
        write_json(d / "train_summary.json", info)
    man = d / PAIRS_MANIFEST
    if man.exists():
        write_json(man, {**read_json(man), "judge_error_on_pairs": err})


def _train(a: PostTrainConfig, cfg: DPOTrainConfig, d: Path) -> dict[str, Any]:
    max_len = DPO_MAX_LEN if a.max_len is None else a.max_len
    judge_spec = default_judge(a.model) if a.judge in (None, "auto") else a.judge
    try:
        all_items = load_dataset(PAIR_DATASET).items
        eval_ids, eval_what = evaluation_item_ids(a)
    except FileNotFoundError as e:
        raise MissingInput(str(e)) from e
    train_ids = training_item_ids([it.item_id for it in all_items], a.pair_items, eval_ids)
    check_disjoint(train_ids, eval_ids)
    if not train_ids:
        raise PairError(f"no {PAIR_DATASET} item is left for training after the evaluation items")
    keep = set(train_ids)
    items = [it for it in all_items if it.item_id in keep]
    lm = load_base(a.model, a.device)
    pt.check_target_modules(lm.model, pt.TrainConfig(target_modules=cfg.target_modules))
    run = d / f"pairs-{PAIR_DATASET}"
    pcfg = probe_config(a.model, PAIR_DATASET, limit=len(items), temperatures=[a.temperature], samples=a.pair_samples,
                        max_assistant_tokens=a.max_assistant_tokens, max_user_tokens=a.max_user_tokens)
    print(f"pairs: sampling {a.pair_samples} user turns x {len(items)} {PAIR_DATASET} training items at T="
          f"{a.temperature:g} into {run}", flush=True)
    run_probe(pcfg, run, lm=lm, items=items)
    summary = judge_run(run, judge=judge_spec, include_truncated=a.include_truncated)
    turns = read_jsonl(run / USER_TURNS, key="record_id")
    labels = {r["record_id"]: r for r in read_jsonl(run / "labels.jsonl", key="record_id")}
    cut = set() if a.include_truncated else truncated_item_ids(read_jsonl(run / ASSISTANT, key="item_id"))
    ps = build_pairs(turns, labels, train_ids, eval_ids, truncated=cut, max_len=max_len, max_pairs=a.max_pairs)
    err = judge_error_on_pairs(ps.pairs, audit_truth(run))
    write_pairs(d, ps, {"model": lm.name, "judge": summary.judge, "run": str(run), "dataset": PAIR_DATASET,
                        "temperature": a.temperature, "samples_per_item": a.pair_samples, "max_len": max_len,
                        "train_item_ids": train_ids, "excluded": eval_what, "judge_error_on_pairs": err})
    c = ps.counts
    print(f"pairs: {c['items']} items, {c['turns']} sampled turns, {c['genuine']} genuine ({c['genuine_unfinished']} "
          f"unfinished), {c['items_with_both']} items with both, {c['pairs_available']} pairs available, "
          f"{c['pairs_too_long']} too long, {c['pairs_used']} used (judge {summary.judge})", flush=True)
    require_pairs(ps)
    pm, res = train_dpo(lm.model, lm.tokenizer, ps.pairs, cfg, d, device=a.device)
    log = read_jsonl(d / TRAIN_LOG, key="step")
    info: dict[str, Any] = {"model": lm.name, "method": "dpo", "pairs": c, "judge_error_on_pairs": err,
                            "beta": cfg.beta, "steps_done": res.steps_done, "resumed_from": res.resumed_from,
                            **log_summary(log)}
    title = loss_title(lm.name, f"DPO (LoRA r={cfg.lora_r}, beta {cfg.beta:g}) on preference pairs", len(ps.pairs),
                       judge=summary.judge)
    merged = pt.merge_adapter(pm)
    merged.config.use_cache = True  # the Trainer turns the KV cache off for training; generation needs it back
    pt.save_merged(merged, lm.tokenizer, d / pt.MERGED_DIR,
                   {"base_model": lm.name, "base_weight_hash": lm.weight_hash, "adapter": str(d / pt.ADAPTER_DIR),
                    "method": "dpo", "train_config": asdict(cfg)})
    del pm, lm
    check = load_model(str(d / pt.MERGED_DIR), device="cpu", dtype=torch.float32)
    print(f"merged DPO model: {d / pt.MERGED_DIR} (weight hash {check.weight_hash[:12]}..., loads with load_model)")
    info["merged"] = {"path": str(d / pt.MERGED_DIR), **check.identity()}
    write_json(d / "train_summary.json", info)
    # After the merged model and the summary: a plotting failure costs the loss curve (one line), never the model.
    loss_fig = d / "figures" / "post_train_loss_dpo.png"
    _, failed = draw_figure(loss_fig, lambda: plot_loss(log, loss_fig, title, ylabel="DPO loss"))
    if failed:
        print(f"mechprobe: error: {failed}", file=sys.stderr)
    return info
