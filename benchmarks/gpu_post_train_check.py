"""Post-training's CUDA path, checked and timed on a tiny random-init Qwen2 model (no weights, no network).

``PYTHONPATH=. python benchmarks/gpu_post_train_check.py [--tokenizer .devcarry/qwen-tok] [--device cuda]
[--out benchmarks/results/gpu_post_train.json]``

Why: LoRA SFT (:mod:`mechprobe.post_train.train`) and DPO (:mod:`mechprobe.post_train.dpo`, ``trl``) are tested
on the CPU only, and ``--device cuda`` adds what the CPU never sees: batches collated on the CPU must reach the
model's device, LoRA dropout draws from the CUDA generators (a resumed run must restore them), and fp32 CUDA
kernels sum in another order. The model is ``tiny_model("qwen2")`` with the real Qwen2.5 vocabulary (its
tokenizer travels as a saved directory), so the LM head, the template and the end-of-turn ids are the real ones.

Checks (all in fp32): the SFT loss mask is exactly the user turn and its ``<|im_end|>`` under the Qwen2.5
template (the library's ``build_example``), and trl's completion mask is the same for DPO pairs; SFT and DPO
train on the device with finite losses (SFT: the held-in loss falls; DPO: chosen/rejected rewards logged);
adapter weights sit on the device; a run resumed from its step-k checkpoint (later checkpoints and the adapter
deleted, the log left as a kill would leave it) matches the uninterrupted run step by step; the merged model
(also saved and reloaded with ``load_model``) reproduces the adapter's logits. Records the device, the library
versions and ms/step. Exits non-zero on a failed check; prints a markdown table and writes JSON.

Resume tolerance: on the CPU with one thread the tests demand 1e-5. On CUDA, float atomics (the backward of
the gathers behind ``logits_to_keep`` and of the embedding lookup) may reorder sums between two runs of the
same step, and Adam turns such ~1e-7 differences into slightly different updates, so losses are compared at
rtol 1e-3 and adapters by relative norm 1e-3. The adapter is the sensitive one: a resume that loses the RNG
state (other dropout masks) moved the SFT adapter by 1.5e-1 but the step losses (~11.9, a random model's) only
by 2e-3 on the CPU; both are exactly equal there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# No network on the device machine: never wait for a hub timeout (set before transformers is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from mechprobe.io import read_jsonl  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.forward import tiny_model  # noqa: E402
from mechprobe.lm.models import load_model, load_tokenizer  # noqa: E402
from mechprobe.post_train import pairs as pp  # noqa: E402
from mechprobe.post_train import train as pt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QA = [("Natalia sold 48 clips in April and half as many in May. How many in total?", "48 + 24 = 72 clips.",
       "Why is May half of April?"),
      ("Can you suggest a board game for four players?", "Try Ticket to Ride.", "Anything more cooperative?"),
      ("What is 7 times 8?", "7 x 8 = 56.", "And 7 times 9, is it 63?"),
      ("Name a prime above 10.", "11 is prime.", "Is 21 prime too?")]
REJECTED = ["Solve: a train travels 60 miles in 1.5 hours.", "What is the capital of France?",
            "Write a poem about the sea.", "Thanks, that is all."]
STEPS, CKPT, RTOL = 8, 4, 1e-3


def model_for(tok, dev: torch.device):
    return tiny_model("qwen2", seed=1, vocab_size=len(tok), num_hidden_layers=2).to(dev)


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ||a - b|| / ||b|| over the adapter's tensors (inf when the key sets differ)."""
    if a.keys() != b.keys() or not a:
        return float("inf")
    return max(((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)).item() for k in a)


def loss_diff(la: dict[int, float], lb: dict[int, float], steps: range) -> float:
    """Largest |a - b| / max(|b|, 1e-3) over ``steps`` (inf when a step is missing)."""
    if not all(s in la and s in lb for s in steps):
        return float("inf")
    return max(abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-3) for s in steps)


def adapter_file(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / pt.ADAPTER_DIR / "adapter_model.safetensors"))


def ms_per_step(log: list[dict]) -> float | None:
    secs = [r["seconds"] for r in log[1:]]  # step 1 includes warm-up (kernel selection, allocator growth)
    return round(1000 * statistics.median(secs), 1) if secs else None


def kill_copy(src: Path, dst: Path, ckpt_root: Path, keep: str) -> None:
    """The state a run killed after step > k leaves: every file of ``src`` but the adapter and checkpoints newer
    than ``keep`` (the log keeps its rows after k; the library must drop and redo them)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / pt.ADAPTER_DIR, ignore_errors=True)
    prefix = keep.rstrip("0123456789")
    for c in (dst / ckpt_root.relative_to(src)).iterdir():
        if c.is_dir() and c.name.startswith(prefix) and c.name != keep:
            shutil.rmtree(c)


def mask_checks(tok, res: dict, fail: list[str]) -> None:
    conv = [{"role": "user", "content": QA[0][0]}, {"role": "assistant", "content": QA[0][1]}]
    ex = pt.build_example(tok, conv, QA[0][2], "c0")
    kept = tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != pt.IGNORE])
    prefix = tok.decode(ex.input_ids[:ex.user_span[0]])
    full = tok.apply_chat_template([*conv, {"role": "user", "content": QA[0][2]}], tokenize=False)
    ok = (kept == QA[0][2] + "<|im_end|>" and prefix.startswith(f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n")
          and prefix.endswith(QA[0][1] + "<|im_end|>\n<|im_start|>user\n") and tok.decode(ex.input_ids) == full)
    res["sft_mask"] = {"ok": ok, "kept": kept, "tokens": len(ex.input_ids), "span": list(ex.user_span)}
    if not ok:
        fail.append(f"SFT loss mask under the Qwen2.5 template keeps {kept!r}")


def sft_checks(tok, dev: torch.device, work: Path, res: dict, fail: list[str]) -> None:
    exs = [pt.build_example(tok, [{"role": "user", "content": q}, {"role": "assistant", "content": a}], n, f"c{i}")
           for i, (q, a, n) in enumerate(QA * 2)]
    cfg = pt.TrainConfig(steps=STEPS, batch_size=3, lr=2e-2, checkpoint_every=CKPT, keep_checkpoints=STEPS,
                         lora_dropout=0.1, warmup_steps=2)
    pad = tok.pad_token_id or 0
    full = {k: v.to(dev) for k, v in pt.collate(exs, pad).items()}
    base = model_for(tok, dev)
    with torch.no_grad():
        before = pt.batch_loss(base, full)[0].item()
    clean = work / "sft_clean"
    pm, r = pt.train_lora(base, exs, cfg, clean, pad_id=pad, progress=False, heldout=exs[:4])
    with torch.no_grad():
        after = pt.batch_loss(pm, full)[0].item()
    log = pt.read_train_log(clean)
    losses = [row["loss"] for row in log]
    devs = sorted({str(p.device) for p in pm.parameters() if p.requires_grad})
    res["sft"] = {"steps": r.steps_done, "losses": losses, "loss_all_before": before, "loss_all_after": after,
                  "adapter_devices": devs, "ms_per_step": ms_per_step(log),
                  "tokens_per_s": round(sum(row["tokens"] for row in log[1:])
                                        / max(1e-9, sum(row["seconds"] for row in log[1:])))}
    if r.steps_done != STEPS or [row["step"] for row in log] != list(range(1, STEPS + 1)):
        fail.append(f"SFT: {r.steps_done} steps, log steps {[row['step'] for row in log]}")
    if not all(math.isfinite(x) for x in [*losses, after]):
        fail.append(f"SFT: non-finite loss {losses} / {after}")
    if not after < before:
        fail.append(f"SFT: the loss on the training examples did not fall ({before:.4f} -> {after:.4f})")
    if len(devs) != 1 or torch.device(devs[0]).type != dev.type:
        fail.append(f"SFT: adapter parameters on {devs}, want {dev}")

    # Resume: the step-k checkpoint of the clean run, a fresh model, the same config -> the same steps k+1..N.
    resumed = work / "sft_resumed"
    kill_copy(clean, resumed, clean / pt.CKPT_DIR, f"step_{CKPT:06d}")
    _, r2 = pt.train_lora(model_for(tok, dev), exs, cfg, resumed, pad_id=pad, progress=False, heldout=exs[:4])
    compare_resume("SFT", resumed, clean, log, r2, res, fail)
    # The held-out curve (scored at step 0 and every checkpoint) survives the resume: same steps, same losses, and
    # the same chosen (best) step.
    ca, cb = (read_jsonl(d / pt.HELDOUT_LOG, key="step") for d in (resumed, clean))
    d_curve = max((abs(x["heldout_loss"] - y["heldout_loss"]) / max(1e-12, abs(y["heldout_loss"]))
                   for x, y in zip(ca, cb)), default=float("inf"))
    res["sft_heldout_curve"] = {"clean": [[x["step"], x["heldout_loss"]] for x in cb], "max_rel_diff": d_curve,
                                "chosen_clean": r.chosen_step, "chosen_resumed": r2.chosen_step}
    if [x["step"] for x in ca] != [x["step"] for x in cb] or not d_curve < RTOL or r.chosen_step != r2.chosen_step:
        fail.append(f"SFT held-out curve differs after resume: {res['sft_heldout_curve']}")
    merge_check("sft", pm, tok, exs[0].input_ids, dev, work, res, fail)


def compare_resume(name: str, resumed: Path, clean: Path, log: list[dict], r2: Any, res: dict,
                   fail: list[str]) -> None:
    """The resumed run against the uninterrupted one: steps, per-step losses and the final adapter."""
    la = {row["step"]: row["loss"] for row in pt.read_train_log(resumed)}
    lb = {row["step"]: row["loss"] for row in log}
    d_loss, d_ad = loss_diff(la, lb, range(1, STEPS + 1)), rel_diff(adapter_file(resumed), adapter_file(clean))
    res[f"{name.lower()}_resume"] = {"resumed_from": r2.resumed_from, "steps": r2.steps_done,
                                     "log_steps": sorted(la), "max_rel_loss_diff": d_loss,
                                     "max_rel_adapter_diff": d_ad}
    if r2.resumed_from != CKPT or r2.steps_done != STEPS or sorted(la) != list(range(1, STEPS + 1)):
        fail.append(f"{name} resume: from {r2.resumed_from}, {r2.steps_done} steps, log steps {sorted(la)}")
    if not (d_loss < RTOL and d_ad < RTOL):
        fail.append(f"{name} resume differs from the uninterrupted run: losses {d_loss:.2e}, adapter {d_ad:.2e}")


def merge_check(name: str, pm, tok, ids: list[int], dev: torch.device, work: Path, res: dict,
                fail: list[str]) -> None:
    """The merged model (in memory, and saved + reloaded by ``load_model``) reproduces the adapter's logits."""
    x = torch.tensor([ids], device=dev)
    pm.eval()
    with torch.no_grad():
        ref = pm(input_ids=x).logits.float()
        with pm.disable_adapter():
            moved = (ref - pm(input_ids=x).logits.float()).abs().max().item()
        merged = pt.merge_adapter(pm)
        got = merged(input_ids=x).logits.float()
    merged.config.use_cache = True
    pt.save_merged(merged, tok, work / f"{name}_merged", {"check": name})
    lm = load_model(str(work / f"{name}_merged"), device=dev, dtype=torch.float32)
    with torch.no_grad():
        got2 = lm.model(input_ids=x).logits.float()
    scale = ref.abs().max().item()
    e1, e2 = (got - ref).abs().max().item() / scale, (got2 - ref).abs().max().item() / scale
    res[f"{name}_merged"] = {"adapter_moved_logits_by": moved, "max_rel_err_in_memory": e1,
                             "max_rel_err_reloaded": e2, "reloaded_device": str(lm.device),
                             "reloaded_attn": lm.model.config._attn_implementation}
    # Folding B@A*s into W reorders fp32 sums (~1e-6); the reload may also switch eager -> sdpa attention.
    if moved < 1e-4:
        fail.append(f"{name}: training left the logits unchanged (max diff {moved:.1e}): merge check is vacuous")
    if not (e1 < 1e-4 and e2 < 1e-4):
        fail.append(f"{name}: merged logits differ from the adapter's by {e1:.1e} (in memory) / {e2:.1e} (reloaded)")


def make_pairs(tok) -> list[pp.Pair]:
    """Pairs as the command builds them: probe prompts under the Qwen template, sampled ids ending in <|im_end|>."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(8):
        q, a, good = QA[i % len(QA)]
        bad = REJECTED[(i + i // len(QA)) % len(REJECTED)]
        probe = chat.build_probe_prompt(tok, q, a)
        enc = [tok(t, add_special_tokens=False)["input_ids"] + [im_end] for t in (good, bad)]
        out.append(pp.Pair(f"gsm8k-{600 + i:04d}", f"c{i}", f"r{i}", "new_query", good, bad, probe.input_ids, *enc))
    return out


def dpo_checks(tok, dev: torch.device, work: Path, res: dict, fail: list[str]) -> None:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from mechprobe.post_train import dpo

    ps = make_pairs(tok)
    p0 = ps[0]
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)([
        {"prompt_ids": p0.prompt_ids, "chosen_ids": p0.chosen_ids, "rejected_ids": p0.rejected_ids}])
    kept = [tok.decode(batch["input_ids"][i][batch["completion_mask"][i].bool()]) for i in (0, 1)]
    ok = kept == [p0.chosen_text + "<|im_end|>", p0.rejected_text + "<|im_end|>"]
    res["dpo_mask"] = {"ok": ok, "kept": kept}
    if not ok:
        fail.append(f"DPO: trl's completion mask keeps {kept}")

    cfg = dpo.DPOTrainConfig(steps=STEPS, batch_size=3, lr=2e-2, checkpoint_every=CKPT, keep_checkpoints=STEPS,
                             warmup_steps=2, beta=0.1)
    clean = work / "dpo_clean"
    pm, r = dpo.train_dpo(model_for(tok, dev), tok, ps, cfg, clean, device=str(dev), progress=False)
    log = pt.read_train_log(clean)
    hist = json.loads((dpo.latest_trainer_checkpoint(clean / pt.CKPT_DIR) / "trainer_state.json").read_text())["log_history"]
    rewards = [{k: h.get(k) for k in ("step", "rewards/chosen", "rewards/rejected", "rewards/margins")}
               for h in hist if "loss" in h]
    nums = [row["loss"] for row in log] + [row["reward_margin"] for row in log] + \
        [x[k] for x in rewards for k in ("rewards/chosen", "rewards/rejected")]
    devs = sorted({str(p.device) for p in pm.parameters() if p.requires_grad})
    res["dpo"] = {"steps": r.steps_done, "losses": [row["loss"] for row in log],
                  "reward_margins": [row["reward_margin"] for row in log], "rewards": rewards,
                  "adapter_devices": devs, "ms_per_step": ms_per_step(log)}
    if r.steps_done != STEPS or [row["step"] for row in log] != list(range(1, STEPS + 1)):
        fail.append(f"DPO: {r.steps_done} steps, log steps {[row['step'] for row in log]}")
    if len(rewards) != STEPS or not all(isinstance(v, float) and math.isfinite(v) for v in nums):
        fail.append(f"DPO: losses/rewards missing or non-finite ({len(rewards)} reward rows)")
    elif not min(row["loss"] for row in log) < math.log(2) - 1e-3:
        fail.append("DPO: the loss never left log(2) (the value at the reference): nothing trained")
    if len(devs) != 1 or torch.device(devs[0]).type != dev.type:
        fail.append(f"DPO: adapter parameters on {devs}, want {dev}")

    resumed = work / "dpo_resumed"
    kill_copy(clean, resumed, clean / pt.CKPT_DIR, f"{dpo.CKPT_PREFIX}{CKPT}")
    _, r2 = dpo.train_dpo(model_for(tok, dev), tok, ps, cfg, resumed, device=str(dev), progress=False)
    compare_resume("DPO", resumed, clean, log, r2, res, fail)
    merge_check("dpo", pm, tok, p0.prompt_ids + p0.chosen_ids, dev, work, res, fail)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("transformers", "peft", "trl", "datasets", "accelerate", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=str(REPO / ".devcarry" / "qwen-tok"),
                   help="a saved Qwen2.5 tokenizer directory (save_pretrained of load_tokenizer's)")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (to test this script)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_post_train.json"))
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(int(os.environ.get("MECHPROBE_THREADS", "1")))
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                 **versions(), "dtype": "float32", "steps": STEPS, "resume_from": CKPT, "resume_rtol": RTOL}
    fail: list[str] = []
    tok = load_tokenizer(a.tokenizer)
    res["tokenizer"] = {"class": type(tok).__name__, "len": len(tok), "chat_template": bool(tok.chat_template)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for name, fn in (("mask", lambda: mask_checks(tok, res, fail)),
                         ("sft", lambda: sft_checks(tok, dev, Path(d), res, fail)),
                         ("dpo", lambda: dpo_checks(tok, dev, Path(d), res, fail))):
            t = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 -- one broken stage must not hide the others' results
                import traceback

                traceback.print_exc()
                fail.append(f"{name}: {type(e).__name__}: {e}")
            res[f"{name}_seconds"] = round(time.perf_counter() - t, 1)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["failures"] = fail

    def get(*keys):
        v = res
        for k in keys:
            v = v.get(k, {}) if isinstance(v, dict) else {}
        return "-" if v == {} else v

    def fmt(x):
        if isinstance(x, float):
            return f"{x:.1e}" if abs(x) < 1e-2 else f"{x:.4g}"
        return str(x)

    print(f"\n{res['device']} ({dev}), torch {res['torch']}, transformers {res['transformers']}, peft {res['peft']}, "
          f"trl {res['trl']}; tiny qwen2, vocab {len(tok)}, fp32, {res['seconds']} s")
    print("| check | SFT (LoRA) | DPO (trl, LoRA) |\n|---|---|---|")
    rows = [("loss mask = user turn + <\\|im_end\\|>", ("sft_mask", "ok"), ("dpo_mask", "ok")),
            ("steps done", ("sft", "steps"), ("dpo", "steps")),
            ("ms/step (median, steps 2..N)", ("sft", "ms_per_step"), ("dpo", "ms_per_step")),
            ("adapter on", ("sft", "adapter_devices"), ("dpo", "adapter_devices")),
            ("resumed from step", ("sft_resume", "resumed_from"), ("dpo_resume", "resumed_from")),
            ("resume vs clean: max rel loss diff", ("sft_resume", "max_rel_loss_diff"),
             ("dpo_resume", "max_rel_loss_diff")),
            ("resume vs clean: max rel adapter diff", ("sft_resume", "max_rel_adapter_diff"),
             ("dpo_resume", "max_rel_adapter_diff")),
            ("merged vs adapter logits (in memory)", ("sft_merged", "max_rel_err_in_memory"),
             ("dpo_merged", "max_rel_err_in_memory")),
            ("merged vs adapter logits (reloaded)", ("sft_merged", "max_rel_err_reloaded"),
             ("dpo_merged", "max_rel_err_reloaded"))]
    for label, s, o in rows:
        print(f"| {label} | {fmt(get(*s))} | {fmt(get(*o))} |")
    sl, dl = get("sft", "losses"), get("dpo", "losses")
    print(f"| loss, first -> last step | {fmt(sl[0] if sl != '-' else '-')} -> {fmt(sl[-1] if sl != '-' else '-')} "
          f"| {fmt(dl[0] if dl != '-' else '-')} -> {fmt(dl[-1] if dl != '-' else '-')} |")
    print("failures:", fail or "none")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    return 1 if fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
