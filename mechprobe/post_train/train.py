"""Collaboration-oriented post-training: LoRA SFT on the *human's* next turn of real conversations.

The paper's last claim is that post-training towards the user role raises follow-up rates while keeping
task accuracy. Here the model is trained to write what a real human wrote after an assistant turn
(HH-RLHF, Topical-Chat): the example is ``[conversation ..., assistant turn]`` rendered with the model's
own chat template, followed by the next human turn in the *user* role, and the loss covers only that
user turn's content and its end-of-turn token -- never the user-role header (the probe prompt supplies
the header, so the model never has to predict it) and never the conversation before it.

Why the mask is found from renderings and not from per-family markers: the same reasoning as
:mod:`mechprobe.lm.chat` -- a hand-written "``<|im_start|>user``" rule breaks on Gemma, Llama-3, Mistral.
We render the conversation with a sentinel user message to find where the user content starts (the
probe's own cut), check that the full rendering has the real content at that character offset, and map
characters to tokens with the in-context offsets of the full rendering.

Training is plain PyTorch over a ``peft`` LoRA model (CPU fp32 here), seeded, with an atomic checkpoint
every N steps (adapter + optimizer + scheduler + RNG states + step + data position) so a killed run
resumes from the last checkpoint and produces the same adapter as an uninterrupted run.
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
from mechprobe.lm import chat
from mechprobe.splits import split_of
from mechprobe.turns.datasets import load_dataset

IGNORE = -100
TRAIN_LOG = "train_log.jsonl"
CKPT_DIR = "checkpoints"
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
SOURCES = ("hh_rlhf", "topical_chat")
# Test hook: the training loop ends the process hard (os._exit) right after this step is logged, the way
# a kill would, so the resume test needs no timing-dependent signals.
CRASH_ENV = "MECHPROBE_TRAIN_CRASH_AFTER_STEP"


class PostTrainError(UserError, ValueError):
    """A post-training input is unusable (template cannot host the example, no data, bad config)."""


# ---------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class Conversation:
    """A real conversation up to an assistant turn, and the human turn that followed it.

    ``conv_id`` is ``<source>:<the dataset's own id>`` (Topical-Chat conversation id; the HH-RLHF row id):
    the unit of the train/held-out split, so no conversation contributes to both sides.
    """

    conv_id: str
    source: str
    messages: list[dict[str, str]]  # ends with the assistant turn
    next_user: str


def conversations_from_items(items: Sequence[Any], source: str) -> list[Conversation]:
    """Items of the HH-RLHF / Topical-Chat loaders -> conversations (rows without a next human turn dropped).

    The loaders keep the first user turn in ``prompt``, the original reply in ``meta`` and the human's next
    turn in ``reference_next_user``; earlier turns, if any, in ``messages``.
    """
    out: list[Conversation] = []
    for it in items:
        reply = it.meta.get("original_assistant") or it.meta.get("original_reply")
        nxt = (it.reference_next_user or "").strip()
        if not reply or not str(reply).strip() or not nxt:
            continue
        own = it.meta.get("conversation_id") or it.item_id
        msgs = [*(it.messages or []), {"role": "user", "content": it.prompt.strip()},
                {"role": "assistant", "content": str(reply).strip()}]
        out.append(Conversation(conv_id=f"{source}:{own}", source=source, messages=msgs, next_user=nxt))
    return out


def load_conversations(sources: Sequence[str] = SOURCES, data_path: str | Path | None = None,
                       limit: int | None = None) -> list[Conversation]:
    """Conversations from the local conversation datasets (``../shared/data`` or ``$MECHPROBE_DATA_DIR``)."""

    bad = [s for s in sources if s not in SOURCES]
    if bad:
        raise UsageError(f"unknown training source(s) {bad}: choose from {', '.join(SOURCES)}")
    out: list[Conversation] = []
    for s in sources:
        try:
            res = load_dataset(s, path=data_path, limit=limit, source="local")
        except FileNotFoundError as e:
            raise MissingInput(str(e)) from e
        out.extend(conversations_from_items(res.items, s))
    if not out:
        raise PostTrainError(f"no conversation with an assistant turn and a next human turn in {list(sources)}")
    return out




def split_conversations(convs: Sequence[Conversation], held_out_fraction: float = 0.1
                        ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out); raises if an id lands on both sides (duplicate ids across rows)."""
    if not 0.0 <= held_out_fraction < 1.0:
        raise UsageError(f"held-out fraction must be in [0, 1), got {held_out_fraction}")
    train = [c for c in convs if split_of(c.conv_id, held_out_fraction) == "train"]
    held = [c for c in convs if split_of(c.conv_id, held_out_fraction) == "heldout"]
    assert_disjoint(train, held)
    return train, held


def assert_disjoint(train: Sequence[Conversation], held: Sequence[Conversation]) -> None:
    both = {c.conv_id for c in train} & {c.conv_id for c in held}
    if both:
        raise PostTrainError(f"{len(both)} conversation id(s) in both train and held-out, e.g. {sorted(both)[:3]}")


# ---------------------------------------------------------------------------------------------------
# Loss mask


@dataclass(frozen=True)
class TrainExample:
    """Token ids of one rendered conversation and its labels (``IGNORE`` outside the trained user turn).

    ``user_span`` is the [start, end) token span whose labels are kept: the user content plus its
    end-of-turn token.
    """

    conv_id: str
    input_ids: list[int]
    labels: list[int]
    user_span: tuple[int, int]


def build_example(tokenizer: Any, messages: Sequence[dict[str, str]], next_user: str, conv_id: str = "",
                  system: str | None = None) -> TrainExample:
    """Render ``messages + [user: next_user]`` and mask everything but the user turn's content and end token.

    Template-agnostic: the content's first character is where :mod:`mechprobe.lm.chat` cuts the probe prompt
    (render with a sentinel user message), checked against the full rendering; its tokens are the
    in-context tokens overlapping the content's characters, and the end-of-turn token is the first
    non-blank token after the content, which must be one of the template's user end-of-turn ids.
    """
    content = next_user.strip()
    if not content:
        raise PostTrainError(f"{conv_id}: empty next user turn")
    msgs = list(messages)
    if system is not None:
        msgs = [{"role": "system", "content": system}, *msgs]
    probe = chat.render(tokenizer, [*msgs, {"role": "user", "content": chat.SENTINEL}])
    if probe.count(chat.SENTINEL) != 1:
        raise PostTrainError("the chat template rendered the user message more than once")
    start = probe.index(chat.SENTINEL)
    full = chat.render(tokenizer, [*msgs, {"role": "user", "content": content}])
    if full[:start] != probe[:start] or full[start:start + len(content)] != content:
        raise PostTrainError(f"{conv_id}: the chat template rewrites the user content or the text before it "
                             "(the loss mask needs the content verbatim after the user-role header)")
    end = start + len(content)
    ids, offsets = chat.tokenize_rendered(tokenizer, full)
    if offsets is None:
        raise PostTrainError("the loss mask needs a fast tokenizer (character offsets)")
    inside = [i for i, (s, e) in enumerate(offsets) if e > start and s < end and e > s]
    if not inside:
        raise PostTrainError(f"{conv_id}: no token covers the user content")
    eot_ids = set(chat.user_end_of_turn_ids(tokenizer))
    after = next((i for i, (s, e) in enumerate(offsets) if s >= end and e > s and full[s:e].strip()), None)
    if after is None or ids[after] not in eot_ids:
        raise PostTrainError(f"{conv_id}: no user end-of-turn token after the content (expected one of "
                             f"{sorted(eot_ids)})")
    span = (inside[0], after + 1)
    labels = [IGNORE] * len(ids)
    labels[span[0]:span[1]] = ids[span[0]:span[1]]
    return TrainExample(conv_id=conv_id, input_ids=ids, labels=labels, user_span=span)


@dataclass
class BuiltData:
    examples: list[TrainExample]
    skipped: dict[str, int]


def build_examples(tokenizer: Any, convs: Sequence[Conversation], max_len: int, system: str | None = None
                   ) -> BuiltData:
    """Examples that fit ``max_len`` tokens; longer ones are skipped and counted, never truncated
    (cutting would change what the user turn responds to, or drop its end-of-turn token)."""
    out: list[TrainExample] = []
    skipped = {"too_long": 0, "template": 0}
    for c in convs:
        try:
            ex = build_example(tokenizer, c.messages, c.next_user, c.conv_id, system)
        except PostTrainError:
            skipped["template"] += 1
            continue
        if len(ex.input_ids) > max_len:
            skipped["too_long"] += 1
            continue
        out.append(ex)
    return BuiltData(out, skipped)


# ---------------------------------------------------------------------------------------------------
# Training


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


def _rng_state() -> dict[str, Any]:
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()  # LoRA dropout on a CUDA model draws from the CUDA generators
    return s


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])


def _adapter_state(pm: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pm.named_parameters() if v.requires_grad}


def save_checkpoint(out: Path, pm: Any, opt: Any, sched: Any, step: int, position: int, keep: int) -> Path:
    """Write ``checkpoints/step_NNNNNN`` atomically (a temp dir renamed into place) and prune old ones.

    A checkpoint directory exists under its final name only once every file in it is complete, so a
    kill during the write leaves the previous checkpoint as the latest.
    """
    root = out / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save({"adapter": _adapter_state(pm), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "rng": _rng_state(), "step": step, "position": position}, tmp / "state.pt")
    (tmp / "done.json").write_text(json.dumps({"step": step, "position": position}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (temp dirs of a killed write are ignored)."""
    root = out / CKPT_DIR
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / "done.json").exists() and (p / "state.pt").exists())
    return done[-1] if done else None


def _truncate_log(path: Path, last_step: int) -> None:
    """Keep only log rows up to the checkpoint's step (rows after it are redone on resume), atomically."""
    if not path.exists():
        return
    rows = [r for r in read_jsonl(path, key="step") if int(r["step"]) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


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
        _set_rng_state(st["rng"])
        step, position, resumed = int(st["step"]), int(st["position"]), int(st["step"])
        _truncate_log(log_path, step)
        _truncate_log(ho_path, step)
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
            torch.save({"step": at, "heldout_loss": loss, "adapter": _adapter_state(pm)}, tmp)
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
