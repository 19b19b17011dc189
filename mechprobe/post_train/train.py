"""Collaboration-oriented post-training: LoRA SFT on the *human's* next turn of real conversations.

The paper's last claim is that post-training towards the user role raises follow-up rates while keeping
task accuracy. Here the model is trained to write what a real human wrote after an assistant turn: the data
(:mod:`.conversations`), the example and its loss mask on the user turn only (:mod:`.examples`), and this
module's training loop.

Training is plain PyTorch over a ``peft`` LoRA model (CPU fp32 here), seeded, with an atomic checkpoint
every N steps (:mod:`.checkpoints`) so a killed run resumes from the last checkpoint and produces the same
adapter as an uninterrupted run. The data, example and checkpoint names stay importable from here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import read_json, read_jsonl, write_json
from mechprobe.post_train.checkpoints import (
    CKPT_DIR,
    adapter_state,
    latest_checkpoint,
    save_checkpoint,
    set_rng_state,
    truncate_log,
)
from mechprobe.post_train.conversations import (
    SOURCES,
    Conversation,
    PostTrainError,
    assert_disjoint,
    conversations_from_items,
    load_conversations,
    split_conversations,
)
from mechprobe.post_train.examples import IGNORE, BuiltData, TrainExample, build_example, build_examples

# The data, example and checkpoint names are re-exported: callers and tests use them as ``train.X``.
__all__ = ["ADAPTER_DIR", "BEST", "CKPT_DIR", "CRASH_ENV", "HELDOUT_LOG", "IGNORE", "MEASURE_STEPS", "MERGED_DIR",
           "PLAN", "SOURCES", "TRAIN_LOG", "BuiltData", "Conversation", "PostTrainError", "TrainConfig",
           "TrainExample", "TrainResult", "assert_disjoint", "batch_indices", "batch_loss", "build_example",
           "build_examples", "check_target_modules", "collate", "conversations_from_items", "data_order",
           "heldout_loss", "latest_checkpoint", "load_conversations", "lora_model", "masked_loss", "merge_adapter",
           "planned_steps", "read_train_log", "save_checkpoint", "save_merged", "should_stop", "split_conversations",
           "train_lora"]

TRAIN_LOG = "train_log.jsonl"
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
# Test hook: the training loop ends the process hard (os._exit) right after this step is logged, the way
# a kill would, so the resume test needs no timing-dependent signals.
CRASH_ENV = "MECHPROBE_TRAIN_CRASH_AFTER_STEP"


@dataclass
class TrainConfig:
    """What determines the adapter (recorded in ``train_config.json``; a resume must match it)."""

    steps: int = 180
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    target_modules: str = "all-linear"
    seed: int = 0
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    # Size the run from its own measured step time: after MEASURE_STEPS steps the plan becomes
    # min(steps, budget / seconds-per-step). None: exactly ``steps``.
    budget_minutes: float | None = None
    # Stop after this many held-out evaluations (one per checkpoint) without a new best; 0: never.
    patience: int = 0

    def validate(self) -> None:
        bad = [f"{k} must be >= 1, got {getattr(self, k)}" for k in
               ("steps", "batch_size", "lora_r", "checkpoint_every", "keep_checkpoints") if getattr(self, k) < 1]
        if not (self.lr > 0 and math.isfinite(self.lr)):
            bad.append(f"lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.lora_dropout < 1.0:
            bad.append(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_alpha < 1:
            bad.append(f"lora_alpha must be >= 1, got {self.lora_alpha}")
        if self.warmup_steps < 0:
            bad.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.budget_minutes is not None and not (self.budget_minutes > 0 and math.isfinite(self.budget_minutes)):
            bad.append(f"budget_minutes must be a positive number, got {self.budget_minutes}")
        if self.patience < 0:
            bad.append(f"patience must be >= 0, got {self.patience}")
        if self.target_modules != "all-linear" and not all(self.target_modules.split(",")):
            bad.append(f"target_modules must be 'all-linear' or comma-separated module names, got "
                       f"{self.target_modules!r}")
        if bad:
            raise UsageError("invalid training config: " + "; ".join(bad))

    def target(self) -> str | list[str]:
        return "all-linear" if self.target_modules == "all-linear" else self.target_modules.split(",")


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a seeded permutation, so a resumed run sees the same batches."""
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def batch_indices(n: int, seed: int, batch_size: int, position: int) -> list[int]:
    """Example indices of the batch starting at global data ``position`` (examples consumed so far)."""
    out: list[int] = []
    while len(out) < batch_size:
        epoch, off = divmod(position, n)
        order = data_order(n, seed, epoch)
        take = order[off: off + batch_size - len(out)]
        out.extend(take)
        position += len(take)
    return out


def collate(examples: Sequence[TrainExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch (training attends causally, so right padding needs no position fix)."""
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    lab = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    att = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        lab[i, :k] = torch.tensor(e.labels)
        att[i, :k] = 1
    return {"input_ids": ids, "labels": lab, "attention_mask": att}


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over the kept label positions, and how many there were."""
    lg = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    tg = labels[:, 1:].reshape(-1)
    n = int((tg != IGNORE).sum())
    return torch.nn.functional.cross_entropy(lg, tg, ignore_index=IGNORE, reduction="mean"), n


def batch_loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """:func:`masked_loss` with LM-head logits computed only where some row has a target next token.

    Why: the user turn is ~20 of ~100-250 positions, and the LM head (vocab 49k for SmolLM2) over every
    position is a large share of the step's compute and a [batch, len, vocab] fp32 tensor; transformers'
    ``logits_to_keep`` (an index tensor) restricts it to the union of target positions across the batch.
    Same value as the full computation (the other positions carry no loss).
    """
    labels = batch["labels"]
    nxt = (labels[:, 1:] != IGNORE).any(0)
    keep = torch.nonzero(nxt).flatten()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   logits_to_keep=keep).logits
    tg = labels[:, keep + 1].reshape(-1)
    n = int((tg != IGNORE).sum())
    lg = logits.reshape(-1, logits.shape[-1]).float()
    return torch.nn.functional.cross_entropy(lg, tg, ignore_index=IGNORE, reduction="mean"), n


def check_target_modules(model: torch.nn.Module, cfg: TrainConfig) -> None:
    """Refuse ``--target-modules`` names the model does not have, right after it loads and before training
    (peft's own error is a traceback). A name matches a module whose dotted name ends with it, as in peft."""
    names = cfg.target()
    if names == "all-linear":
        return
    have = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    leaves = sorted({n.rsplit(".", 1)[-1] for n in have})
    missing = [t for t in names if not any(n == t or n.endswith("." + t) for n in have)]
    if missing:
        raise UsageError(f"target_modules={missing} are not linear modules of this model; its linear modules are "
                         f"{', '.join(leaves)} (or pass all-linear)")


def lora_model(model: torch.nn.Module, cfg: TrainConfig) -> Any:
    """Wrap a HF causal LM with a fresh LoRA adapter (seeded: LoRA's A matrices are random-initialised)."""
    try:
        from peft import LoraConfig, get_peft_model  # lazy: extra [train]
    except ImportError as e:
        raise MissingInput("post-training needs peft: pip install 'mechprobe[train]' (peft==0.21.2)") from e
    torch.manual_seed(cfg.seed)
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.target(), task_type="CAUSAL_LM", bias="none")
    model.requires_grad_(False)
    pm = get_peft_model(model, lcfg)
    pm.train()
    return pm


def _schedule(cfg: TrainConfig, plan: dict[str, int] | None = None) -> Callable[[int], float]:
    """Linear warmup, cosine decay to 10% over the planned steps (``plan["steps"]``, read at every call: a budgeted
    run fixes its plan after its first steps, inside the warmup, where the schedule does not depend on it)."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        total = plan["steps"] if plan else cfg.steps
        p = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))
    return f


MEASURE_STEPS = 3  # a budgeted run times steps 2..MEASURE_STEPS (step 1 pays one-off warm-up costs)
PLAN = "plan.json"
HELDOUT_LOG = "heldout_log.jsonl"
BEST = "best_adapter.pt"


def planned_steps(cfg: TrainConfig, seconds: Sequence[float]) -> int:
    """Steps that fit ``cfg.budget_minutes`` at the mean of ``seconds`` per step, within [MEASURE_STEPS, cfg.steps].

    Example:
        >>> planned_steps(TrainConfig(steps=180, budget_minutes=30), [27.0, 27.0])
        66
    """
    if cfg.budget_minutes is None or not seconds:
        return cfg.steps
    per = float(np.mean(seconds))
    return int(max(MEASURE_STEPS, min(cfg.steps, math.floor(cfg.budget_minutes * 60 / max(per, 1e-9)))))


def should_stop(rows: Sequence[dict[str, Any]], patience: int) -> bool:
    """True when the last ``patience`` held-out evaluations brought no new best (the curve has turned).

    Example:
        >>> should_stop([{"step": 0, "heldout_loss": 3.0}, {"step": 10, "heldout_loss": 2.9},
        ...              {"step": 20, "heldout_loss": 2.95}, {"step": 30, "heldout_loss": 2.91}], patience=2)
        True
    """
    if patience < 1 or len(rows) <= patience:
        return False
    best_i = min(range(len(rows)), key=lambda i: (rows[i]["heldout_loss"], rows[i]["step"]))
    return len(rows) - 1 - best_i >= patience


def heldout_loss(pm: Any, examples: Sequence[TrainExample], pad_id: int, batch_size: int = 8) -> float:
    """Mean user-turn cross-entropy of ``examples`` under ``pm`` as it is (adapter on), without dropout or grads.

    Leaves the model in the mode it found it, and draws no random numbers, so a run that evaluates at its
    checkpoints trains exactly as one that does not."""
    was = pm.training
    pm.eval()
    dev = next(p for p in pm.parameters()).device
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            b = {k: v.to(dev) for k, v in collate(examples[i:i + batch_size], pad_id).items()}
            loss, k = batch_loss(pm, b)
            tot += float(loss) * k
            n += k
    pm.train(was)
    return tot / max(1, n)


@dataclass
class TrainResult:
    steps_done: int
    resumed_from: int | None
    seconds: float
    tokens: int
    losses: list[float] = field(default_factory=list)
    chosen_step: int | None = None  # the step whose adapter was returned (the held-out best, else the last)
    planned_steps: int | None = None
    stopped_early: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def train_lora(model: torch.nn.Module, examples: Sequence[TrainExample], cfg: TrainConfig, out: str | Path,
               pad_id: int, *, progress: bool = True, heldout: Sequence[TrainExample] = (),
               stop_after: int | None = None) -> tuple[Any, TrainResult]:
    """Train (or resume training) a LoRA adapter on ``examples``; returns the peft model and a summary.

    Resumes from ``out/checkpoints`` when one exists and ``out/train_config.json`` matches ``cfg`` (a
    different config is refused rather than mixed). ``out/train_log.jsonl`` gets one row per step
    (loss, lr, target tokens, seconds); rows written after the last checkpoint are dropped on resume
    and redone, so the log never has a step twice.

    With ``heldout`` examples the step count is read off the held-out curve rather than fixed: the held-out
    user-turn loss is measured before training (step 0) and at every checkpoint (``out/heldout_log.jsonl``), the
    best adapter so far is kept (``out/best_adapter.pt``), training stops after ``cfg.patience`` evaluations
    without a new best, and the returned model carries the best step's adapter (``TrainResult.chosen_step``).
    With ``cfg.budget_minutes`` the planned step count is sized from steps 2..3's measured time (``out/plan.json``).
    ``stop_after`` ends training after that many steps while the learning-rate schedule still runs over
    ``cfg.steps``: a run that must take exactly the steps another run chose on its held-out curve (same schedule,
    same steps) is that run's config with ``stop_after`` = its chosen step.
    """
    if stop_after is not None and not 1 <= stop_after <= cfg.steps:
        raise UsageError(f"stop_after={stop_after}: must be in 1..steps ({cfg.steps})")
    cfg.validate()
    if not examples:
        raise PostTrainError("no training examples")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "train_config.json"
    want = {**asdict(cfg), "n_examples": len(examples),
            "data_hash": hashlib.sha256(json.dumps([e.input_ids for e in examples]).encode()).hexdigest()}
    ck = latest_checkpoint(out)
    if cfg_path.exists():
        have = read_json(cfg_path)
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k) and k != "steps")
        if diff and ck is not None:
            raise UserError(f"{out} holds a training run with another config ({', '.join(diff)} differ): pass "
                            "the same options to resume, or another out=")
    write_json(cfg_path, want)
    pm = lora_model(model, cfg)
    params = [p for p in pm.parameters() if p.requires_grad]
    dev = params[0].device  # batches are collated on the CPU; the model may be on CUDA (--device cuda)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    plan = {"steps": cfg.steps}
    plan_path, ho_path = out / PLAN, out / HELDOUT_LOG
    if ck is not None and plan_path.exists() and cfg.budget_minutes is not None:
        plan["steps"] = min(cfg.steps, int(read_json(plan_path)["steps"]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg, plan))
    step, position, resumed = 0, 0, None
    log_path = out / TRAIN_LOG
    if ck is not None:
        st = torch.load(ck / "state.pt", weights_only=False)
        with torch.no_grad():
            named = dict(pm.named_parameters())
            for k, v in st["adapter"].items():
                named[k].copy_(v)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        set_rng_state(st["rng"])
        step, position, resumed = int(st["step"]), int(st["position"]), int(st["step"])
        truncate_log(log_path, step)
        truncate_log(ho_path, step)
    else:
        for p in (log_path, ho_path, plan_path, out / BEST):
            if p.exists():
                p.unlink()  # no checkpoint: the run starts over, so must its logs
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
    ho_rows = read_jsonl(ho_path, key="step") if ho_path.exists() else []

    def evaluate(at: int) -> None:
        loss = heldout_loss(pm, heldout, pad_id)
        best = min((r["heldout_loss"] for r in ho_rows), default=math.inf)
        ho_rows.append({"step": at, "heldout_loss": round(loss, 6), "n_examples": len(heldout)})
        with open(ho_path, "a") as f:
            f.write(json.dumps(ho_rows[-1]) + "\n")
        if loss < best:  # written before the checkpoint: a kill in between redoes this step, same numbers
            tmp = out / f".{BEST}.tmp"
            torch.save({"step": at, "heldout_loss": loss, "adapter": adapter_state(pm)}, tmp)
            os.replace(tmp, out / BEST)

    if heldout and not ho_rows:
        evaluate(step)  # step 0: the adapter starts as a no-op (LoRA B = 0), so this is the base model's loss
    crash_at = int(os.environ.get(CRASH_ENV, "-1"))
    n = len(examples)
    t0, toks, losses = time.time(), 0, []
    bar = tqdm(total=cfg.steps, initial=step, desc="LoRA SFT", unit="step", disable=not progress)
    pm.train()
    stopped = bool(heldout) and should_stop(ho_rows, cfg.patience)
    end = plan["steps"] if stop_after is None else min(stop_after, plan["steps"])
    while step < end and not stopped:
        idx = batch_indices(n, cfg.seed, cfg.batch_size, position)
        batch = {k: v.to(dev) for k, v in collate([examples[i] for i in idx], pad_id).items()}
        ts = time.time()
        loss, n_tgt = batch_loss(pm, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        step += 1
        position += cfg.batch_size
        n_tok = int(batch["attention_mask"].sum())
        toks += n_tok
        loss_v = loss.item()
        losses.append(loss_v)
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": step, "loss": round(loss_v, 6), "lr": lr, "grad_norm": float(gnorm),
                                "target_tokens": n_tgt, "tokens": n_tok, "seconds": round(time.time() - ts, 3)})
                    + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{loss_v:.3f}")
        if cfg.budget_minutes is not None and step == MEASURE_STEPS and not plan_path.exists():
            secs = [r["seconds"] for r in read_jsonl(log_path, key="step") if 2 <= int(r["step"]) <= MEASURE_STEPS]
            plan["steps"] = planned_steps(cfg, secs)
            write_json(plan_path, {"steps": plan["steps"], "seconds_per_step": round(float(np.mean(secs)), 3),
                                   "budget_minutes": cfg.budget_minutes, "max_steps": cfg.steps})
            bar.total = plan["steps"]
            print(f"\nplan: {plan['steps']} steps fit {cfg.budget_minutes:g} min at {np.mean(secs):.1f} s/step "
                  f"(cap {cfg.steps})", flush=True)
        end = plan["steps"] if stop_after is None else min(stop_after, plan["steps"])
        last = step == end
        if step % cfg.checkpoint_every == 0 or last:
            if heldout:
                evaluate(step)
                stopped = should_stop(ho_rows, cfg.patience)
            save_checkpoint(out, pm, opt, sched, step, position, cfg.keep_checkpoints)
        if step == crash_at:
            os._exit(17)
    bar.close()
    chosen = step
    if heldout and (out / BEST).exists():
        b = torch.load(out / BEST, weights_only=False)
        with torch.no_grad():
            named = dict(pm.named_parameters())
            for k, v in b["adapter"].items():
                named[k].copy_(v)
        chosen = int(b["step"])
    pm.eval()
    pm.save_pretrained(out / ADAPTER_DIR)
    return pm, TrainResult(steps_done=step, resumed_from=resumed, seconds=time.time() - t0, tokens=toks,
                           losses=losses, chosen_step=chosen, planned_steps=plan["steps"], stopped_early=stopped)


def merge_adapter(pm: Any) -> torch.nn.Module:
    """The base model with the LoRA update folded into its weights (a plain HF model)."""
    merged = pm.merge_and_unload()
    merged.eval()
    merged.requires_grad_(False)
    return merged


def save_merged(merged: torch.nn.Module, tokenizer: Any, out: str | Path, provenance: dict[str, Any]) -> Path:
    """Write a HF model directory (weights, config, tokenizer with its chat template) atomically.

    ``mechprobe.lm.models.load_model(out)`` accepts it like any HF directory; its weight hash is the
    directory fingerprint, so runs of the merged model never mix with runs of the base model.
    """
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    merged.config.mechprobe_post_train = provenance
    merged.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def read_train_log(out: str | Path) -> list[dict[str, Any]]:
    p = Path(out) / TRAIN_LOG
    return read_jsonl(p, key="step") if p.exists() else []
