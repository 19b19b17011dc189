"""SFT checkpoints: every N steps the adapter, optimizer, scheduler, RNG states, step and data position are written
atomically, so a killed run resumes from the last complete one and produces the same adapter as an uninterrupted
run; the step logs are cut back to the checkpoint's step on resume.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mechprobe.io import read_jsonl

__all__ = ["CKPT_DIR", "adapter_state", "latest_checkpoint", "rng_state", "save_checkpoint", "set_rng_state",
           "truncate_log"]

CKPT_DIR = "checkpoints"


def rng_state() -> dict[str, Any]:
    """Every generator a training step draws from (torch, Python, NumPy, CUDA when used), for a checkpoint."""
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()  # LoRA dropout on a CUDA model draws from the CUDA generators
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s generators, so a resumed run draws what the uninterrupted one would."""
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])


def adapter_state(pm: Any) -> dict[str, torch.Tensor]:
    """A copy of the trainable (LoRA) parameters of ``pm``."""
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
    torch.save({"adapter": adapter_state(pm), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "rng": rng_state(), "step": step, "position": position}, tmp / "state.pt")
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


def truncate_log(path: Path, last_step: int) -> None:
    """Keep only log rows up to the checkpoint's step (rows after it are redone on resume), atomically."""
    if not path.exists():
        return
    rows = [r for r in read_jsonl(path, key="step") if int(r["step"]) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
