"""Before/after evaluation of post-training: the driver of ``experiments/post_train.py --method sft`` and of the
evaluation both methods share.

Each *arm* (the base model, the post-trained merged model, optionally the base model with a steering
vector baked into its weights) gets ordinary probe runs built by :func:`mechprobe.stages.ensure_stages`
on the probe's own items (GSM8K, MT-Bench: never the conversation data the adapter was trained on), so
every number here is the one ``mechprobe judge`` / ``mechprobe cache`` would give for that run.

The pieces live one concept per module: :mod:`~mechprobe.post_train.config` (settings, validation),
:mod:`~mechprobe.post_train.outcomes` (rates and paired tests read from the runs),
:mod:`~mechprobe.post_train.boundary` (the boundary shift inside the model),
:mod:`~mechprobe.post_train.report` (markdown) and :mod:`mechprobe.plots.post_train` (figures). The driver
returns a :class:`PostTrainResult`; the command line prints it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mechprobe.activations.cache import ActivationCache
from mechprobe.errors import MissingInput
from mechprobe.io import output_dir_lock, read_json, read_jsonl, write_json
from mechprobe.judges.factory import default_judge
from mechprobe.judges.registry import OFFLINE_JUDGE
from mechprobe.lm.models import load_model, weight_identity
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.post_train import loss_title, plot_eval, plot_loss
from mechprobe.post_train import train as pt
from mechprobe.post_train.boundary import base_directions, boundary_shift
from mechprobe.post_train.config import DEFAULTS, METHODS, STEER_DATASET, PostTrainConfig, validate_args
from mechprobe.post_train.outcomes import (
    Paired,
    arm_summary,
    corrected_difference,
    corrected_rates,
    followup_rates,
    judge_verdicts,
    label_distribution,
    labels_of,
    paired_arm_test,
    task_accuracy,
    truncated_of,
    turns_of,
)
from mechprobe.post_train.report import read_summary, report_markdown, write_summary
from mechprobe.post_train.train import save_merged
from mechprobe.stages import ensure_stages, probe_config
from mechprobe.stats import Rate, mcnemar_exact
from mechprobe.steering.evaluate import split_of
from mechprobe.steering.experiment import DEFAULT_ALPHAS, SteerConfig, run_steer
from mechprobe.steering.vector import SteeringVector, bake
from mechprobe.turns.pipeline import default_run_dir

__all__ = ["DEFAULTS", "METHODS", "STEER_DATASET", "EvalResult", "Paired", "PostTrainConfig", "PostTrainResult", "Rate",
           "arm_summary", "base_directions", "boundary_shift", "build_steering", "corrected_difference",
           "corrected_rates", "evaluate_arms", "followup_rates", "judge_verdicts", "label_distribution", "labels_of",
           "mcnemar_exact", "paired_arm_test", "plot_eval", "plot_loss", "read_summary", "report_markdown",
           "run_post_train", "task_accuracy", "truncated_of", "turns_of", "validate_args", "write_summary"]


@dataclass
class EvalResult:
    """What :func:`evaluate_arms` wrote: the summary (also in ``summary_path``), the report and the figure."""

    summary: dict[str, Any]
    summary_path: Path
    report_path: Path
    report: str
    figure: Path | None  # None when it could not be drawn (the report's last line says why)


@dataclass
class PostTrainResult:
    """One post-training command: where it wrote, the training summary, the merged model and the evaluation
    (None with ``--no-eval``). The command line prints ``evaluation.report``."""

    out: Path
    method: str
    train_info: dict[str, Any]
    merged: Path
    evaluation: EvalResult | None = None
    figures: list[Path] = field(default_factory=list)


def _heldout_loss(pm: Any, examples: Sequence[Any], pad_id: int, adapter: bool) -> float:
    """Mean user-turn cross-entropy on held-out conversations, with the adapter on or off."""
    if adapter:
        return pt.heldout_loss(pm, examples, pad_id)
    with pm.disable_adapter():
        return pt.heldout_loss(pm, examples, pad_id)


def build_steering(model: str, run: Path, judge: str, include_truncated: bool = False) -> None:
    """Build the base model's steering result at ``run`` as ``experiments/steer.py`` would (layer and alpha chosen
    on train items, difference-of-means only), so its artifacts (``steering/select.md``, ``results.md``, the
    figure) and its resume behaviour are the ordinary ones."""

    cfg = SteerConfig(model=model, dataset=STEER_DATASET, run=str(run), select_on_train=True, kinds="diff_means",
                      acc_kinds="diff_means", judge=judge, alpha=list(DEFAULT_ALPHAS["resid"]),
                      include_truncated=include_truncated)
    print(f"baked-steering arm: building the base model's steering vector at {run}", flush=True)
    if run_steer(cfg) != 0:
        raise RuntimeError(f"steering the base model at {run} failed")


def _steer_result(a: Any, out: Path, judge: str, notes: list[str]) -> Path | None:
    """``<steer run>/steering/results.json`` for the baked arm: ``--steer-run``, else the base model's ordinary
    GSM8K run when it has one, else ``<out>/steer-gsm8k`` (built here unless ``--no-steer``)."""

    if a.steer_run:
        return Path(a.steer_run) / "steering" / "results.json"
    for run in (default_run_dir(probe_config(a.model, STEER_DATASET)), out / f"steer-{STEER_DATASET}"):
        if (run / "steering" / "results.json").exists():
            return run / "steering" / "results.json"
    if a.no_steer:
        notes.append("baked steering arm skipped (no_steer=True)")
        return None
    run = out / f"steer-{STEER_DATASET}"
    if getattr(a, "include_truncated", False):
        build_steering(a.model, run, judge, include_truncated=True)
    else:
        build_steering(a.model, run, judge)
    return run / "steering" / "results.json"


def _bake_arm(a: Any, out: Path, base_weight_hash: str, notes: list[str], judge: str = OFFLINE_JUDGE
              ) -> tuple[str, dict[str, Any]] | None:
    """(model dir with the base model's steering vector baked in, what was baked), or None with a note saying why."""

    res_p = _steer_result(a, out, judge, notes)
    if res_p is None:
        return None
    steer_run = res_p.parent.parent
    if not res_p.exists():
        notes.append(f"baked steering arm skipped: no steering result for the base model at {res_p} "
                     f"(run the steer command on {steer_run} first)")
        return None
    res = read_json(res_p)
    layer = int(res["layer"])
    rows = [r for r in res.get("heldout", []) if r.get("kind") == "diff_means" and r.get("alpha", 0) > 0]
    if not rows:
        notes.append(f"baked steering arm skipped: {res_p} has no diff_means row with alpha > 0")
        return None
    best = max(rows, key=lambda r: (r["followup_rate"], -r.get("degenerate_rate", 0)))
    vec = SteeringVector.load(steer_run / "steering" / f"vector_L{layer}_diff_means")
    if vec.metadata.get("weight_hash") not in (None, base_weight_hash):
        notes.append("baked steering arm skipped: the steering vector was made from other weights")
        return None
    dest = out / "baked"
    if not (dest / "config.json").exists():
        lm = load_model(a.model, device="cpu", dtype=torch.float32)
        try:
            bake(lm.model, vec, float(best["alpha"]), unit="raw")  # the pinned vector is already in alpha units
        except NotImplementedError as e:
            notes.append(f"baked steering arm skipped: {e}")
            return None

        save_merged(lm.model, lm.tokenizer, dest, {"baked_from": str(res_p), "alpha": best["alpha"]})
    sel = res.get("selection") or {}
    how = ("chosen on train items (steering/select.md)" if sel.get("chosen", {}).get("alpha") == best["alpha"]
           else "its best held-out follow-up rate: optimistic")
    notes.append(f"baked arm: diff-of-means vector of {steer_run} at residual {layer}, alpha {best['alpha']:g} "
                 f"({how}; {res_p}, judge {res.get('judge')}), added at every position; the vector came from "
                 f"that run's train-split {STEER_DATASET} items, so its paired test is also given on the "
                 f"held-out split only")
    info = {"run": str(steer_run), "layer": layer, "alpha": best["alpha"], "alpha_unit": res.get("alpha_unit"),
            "how": how, "judge": res.get("judge"), "dataset": STEER_DATASET,
            "steered_heldout": {k: best.get(k) for k in ("n", "followup_rate", "ci", "degenerate_rate", "mcnemar")},
            "unsteered_heldout": next(({k: r.get(k) for k in ("n", "followup_rate", "ci", "degenerate_rate")}
                                       for r in res.get("heldout", []) if r.get("kind") == "diff_means"
                                       and r.get("alpha") == 0), None)}
    return str(dest), info


def train_config(a: PostTrainConfig) -> pt.TrainConfig:
    """The SFT training config: the command's settings over the method's defaults, validated."""
    d = pt.TrainConfig()
    cfg = pt.TrainConfig(steps=d.steps if a.steps is None else a.steps,
                         batch_size=d.batch_size if a.batch_size is None else a.batch_size,
                         lr=d.lr if a.lr is None else a.lr,
                         warmup_steps=d.warmup_steps if a.warmup_steps is None else a.warmup_steps,
                         lora_r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                         target_modules=a.target_modules, seed=a.seed,
                         checkpoint_every=d.checkpoint_every if a.checkpoint_every is None else a.checkpoint_every,
                         budget_minutes=(a.train_minutes if a.train_minutes is not None
                                         else None if a.steps is not None else float(DEFAULTS["train_minutes"])),
                         patience=a.patience)
    cfg.validate()
    return cfg


def out_dir(a: PostTrainConfig) -> Path:
    """``--out``, else ``runs/post_train/<model name>``."""
    return Path(a.out) if a.out else Path("runs") / "post_train" / Path(a.model).name.replace(".gguf", "")


def run_post_train(a: PostTrainConfig) -> PostTrainResult:
    """Train (or reuse) the adapter, merge it, evaluate base vs post-trained (vs baked steering), report."""
    out = out_dir(a)
    cfg = train_config(a)
    validate_args(a)
    if a.eval_only and not (out / pt.ADAPTER_DIR / "adapter_config.json").exists():
        raise MissingInput(f"eval_only=True needs a trained adapter at {out / pt.ADAPTER_DIR}: train first")
    with output_dir_lock(out, "post-training", "out"):
        return _run_sft(a, cfg, out)


def _run_sft(a: PostTrainConfig, cfg: pt.TrainConfig, out: Path) -> PostTrainResult:
    """:func:`run_post_train` once ``out`` is locked."""
    lm = load_model(a.model, device=a.device, dtype=torch.float32)
    pt.check_target_modules(lm.model, cfg)
    pm, info = _train_sft(a, cfg, out, lm)
    merged_dir = out / pt.MERGED_DIR
    if not a.eval_only or not (merged_dir / "config.json").exists():
        base_hash = lm.weight_hash
        pt.save_merged(pt.merge_adapter(pm), lm.tokenizer, merged_dir,
                       {"base_model": lm.name, "base_weight_hash": base_hash, "adapter": str(out / pt.ADAPTER_DIR),
                        "train_config": asdict_safe(cfg)})
    del pm, lm
    check = load_model(str(merged_dir), device="cpu", dtype=torch.float32)
    print(f"merged model: {merged_dir} (weight hash {check.weight_hash[:12]}..., loads with load_model)")
    info["merged"] = {"path": str(merged_dir), **check.identity()}
    del check
    write_json(out / "train_summary.json", info)
    res = PostTrainResult(out, "sft", info, merged_dir)
    if not a.eval_only:
        res.figures.append(out / "figures" / "post_train_loss.png")
    if not a.no_eval:
        res.evaluation = evaluate_arms(a, out, {"post": str(merged_dir)}, info)
    return res


def _train_sft(a: PostTrainConfig, cfg: pt.TrainConfig, out: Path, lm: Any) -> tuple[Any, dict[str, Any]]:
    """The adapter (trained here, or loaded with ``--eval-only``) and the training summary."""
    tok = lm.tokenizer
    convs = pt.load_conversations(a.sources, a.data_path, a.data_limit)
    train, held = pt.split_conversations(convs, a.held_out_fraction)
    max_len = DEFAULTS["max_len"] if a.max_len is None else a.max_len
    built = pt.build_examples(tok, train, max_len)
    held_ex = pt.build_examples(tok, held, max_len).examples[:64]
    write_json(out / "data_split.json", {"sources": a.sources, "held_out_fraction": a.held_out_fraction,
                                         "n_train": len(train), "n_heldout": len(held),
                                         "n_train_examples": len(built.examples), "skipped": built.skipped,
                                         "heldout_ids": sorted(c.conv_id for c in held)})
    info: dict[str, Any] = {"model": lm.name, "train_conversations": len(train), "heldout_conversations": len(held),
                            "train_examples": len(built.examples), "skipped": built.skipped}
    pad = tok.pad_token_id
    if a.eval_only:
        from peft import PeftModel  # lazy: optional extra `train`; only a LoRA adapter needs it

        pm = PeftModel.from_pretrained(lm.model, out / pt.ADAPTER_DIR)
        info.update({k: v for k, v in (read_json(out / "train_summary.json") if (out / "train_summary.json").exists()
                                      else {}).items() if k not in info})
        return pm, info
    print(f"training on {len(built.examples)} user turns from {len(train)} conversations "
          f"({len(held)} held out); skipped {built.skipped}")
    pm, res = pt.train_lora(lm.model, built.examples, cfg, out, pad_id=pad, heldout=held_ex[:a.curve_examples])
    log = pt.read_train_log(out)
    info.update(_train_info(out, log, res))
    if held_ex:
        info["heldout_loss"] = {"base": round(_heldout_loss(pm, held_ex, pad, adapter=False), 4),
                                "post": round(_heldout_loss(pm, held_ex, pad, adapter=True), 4),
                                "n_examples": len(held_ex)}
    write_json(out / "train_summary.json", info)
    # After the summary: a plotting failure costs the loss curve (one line on stderr), never the training.
    loss_fig = out / "figures" / "post_train_loss.png"
    title = (loss_title(lm.name, f"LoRA r={cfg.lora_r} SFT, {info['tokens_per_s']} tok/s", len(built.examples))
             + f"; held-out n={min(len(held_ex), a.curve_examples)}")
    _, failed = draw_figure(loss_fig, lambda: plot_loss(log, loss_fig, title, heldout=info["heldout_curve"],
                                                        chosen=res.chosen_step))
    if failed:
        print(f"mechprobe: error: {failed}", file=sys.stderr)
    return pm, info


def _train_info(out: Path, log: list[dict[str, Any]], res: Any) -> dict[str, Any]:
    # From the whole log, not this session: a resumed (or already finished) run still reports the
    # throughput of all its steps.
    secs = sum(r["seconds"] for r in log)
    curve = read_jsonl(out / pt.HELDOUT_LOG, key="step") if (out / pt.HELDOUT_LOG).exists() else []
    return {"steps_done": res.steps_done, "resumed_from": res.resumed_from, "chosen_step": res.chosen_step,
            "planned_steps": res.planned_steps, "stopped_early": res.stopped_early,
            "plan": read_json(out / pt.PLAN) if (out / pt.PLAN).exists() else None,
            "heldout_curve": [[r["step"], r["heldout_loss"]] for r in curve],
            "seconds": round(secs, 1),
            "tokens_per_s": round(sum(r["tokens"] for r in log) / secs, 1) if secs else None,
            "seconds_per_step": round(secs / len(log), 2) if log else None,
            "first_loss": log[0]["loss"] if log else None,
            "last_loss_mean10": round(float(np.mean([r["loss"] for r in log[-10:]])), 4) if log else None}


def evaluate_arms(a: PostTrainConfig, out: Path, trained: dict[str, str], info: dict[str, Any], suffix: str = "",
                  what: str = "post-trained") -> EvalResult:
    """Probe, judge and cache every arm (``base``, the ``trained`` model dirs, the baked steering arm), compare each
    with ``base``, and write ``eval_summary{suffix}.json``, ``report{suffix}.md`` and the figure into ``out``.

    Args:
        a: the command's config (eval datasets, items, decoding, judge).
        out: the post-training directory (``eval/<arm>-<dataset>/`` runs go under it, shared between methods).
        trained: arm name -> model directory (``{"post": <out>/merged}`` for SFT, ``{"dpo": ...}`` for DPO).
        info: the training summary shown at the top of the report.
        suffix: file-name suffix of the summary, report and figure (``""`` for SFT, ``"_dpo"``).
        what: what the trained arms are, for the figure title.

    Returns:
        what was written (the report text included, for the command line to print).

    Example:
        >>> evaluate_arms(cfg, Path("runs/post_train/m"), {"dpo": "runs/post_train/m/dpo/merged"}, {})  # doctest: +SKIP
        EvalResult(...)
    """
    base_hash = load_base_hash(a.model)
    notes: list[str] = []
    judge_spec = default_judge(a.model) if a.judge in (None, "auto") else a.judge
    arms: dict[str, str] = {"base": a.model, **trained}
    t0 = time.time()
    baked = _bake_arm(a, out, base_hash, notes, judge_spec)
    steer_seconds = round(time.time() - t0, 1)
    if baked:
        arms["baked_steering"] = baked[0]
    t0 = time.time()
    runs, judge_name = _eval_runs(a, out, arms, judge_spec)
    summary: dict[str, Any] = {"judge": judge_name,
                               "arms": {arm: arm_summary(r, a.include_truncated) for arm, r in runs.items()},
                               "paired": {}, "eval_seconds": round(time.time() - t0, 1),
                               "steering": baked[1] if baked else None, "steer_seconds": steer_seconds}
    shifts: dict[str, list[dict[str, Any]]] = {}
    for arm in arms:
        if arm != "base":
            _compare_arm(a, runs, arm, summary, shifts, notes)
    summary["boundary_shift"] = shifts
    write_json(out / f"eval_summary{suffix}.json", summary)
    fig = out / "figures" / f"post_train_eval{suffix}.png"
    notes.append(f"figures: {out / 'figures' / f'post_train_loss{suffix}.png'}, {fig}")
    text = report_markdown(summary, info, shifts, notes)
    (out / f"report{suffix}.md").write_text(text)
    # The figure is the last thing written; a plotting failure ends the printed report in one line naming it.
    drawn, failed = draw_figure(fig, lambda: plot_eval(summary, shifts, fig, str(info.get("model", a.model)), what))
    if failed:
        text += f"\nmechprobe: error: {failed}\n"
    return EvalResult(summary, out / f"eval_summary{suffix}.json", out / f"report{suffix}.md", text, drawn)


def _eval_runs(a: PostTrainConfig, out: Path, arms: dict[str, str], judge_spec: str
               ) -> tuple[dict[str, dict[str, Path]], str]:
    """Build (or reuse) the probe run of every arm and eval dataset; returns them and the judge's name."""
    runs: dict[str, dict[str, Path]] = {}
    judge_name = judge_spec
    for arm, src in arms.items():
        runs[arm] = {}
        for ds in a.eval_datasets:
            run = out / "eval" / f"{arm}-{ds}"
            pcfg = probe_config(src, ds, limit=a.eval_limit, samples=a.samples, temperatures=[0.0, a.temperature],
                                max_assistant_tokens=a.max_assistant_tokens, max_user_tokens=a.max_user_tokens)
            _, judge_name = ensure_stages(run, pcfg, judge_spec, relabel=a.relabel,
                                          include_truncated=a.include_truncated)
            runs[arm][ds] = run
    return runs, judge_name


def _compare_arm(a: PostTrainConfig, runs: dict[str, dict[str, Path]], arm: str, summary: dict[str, Any],
                 shifts: dict[str, list[dict[str, Any]]], notes: list[str]) -> None:
    """Paired tests (judge only and audit-corrected) and the boundary shift of ``arm`` against ``base``."""
    summary["paired"][f"base vs {arm}"] = {
        ds: [p.to_dict() for p in paired_arm_test(runs["base"][ds], runs[arm][ds],
                                                  include_truncated=a.include_truncated)]
        for ds in a.eval_datasets}
    summary.setdefault("corrected_paired", {})[f"base vs {arm}"] = {
        ds: {dec: corrected_difference(runs["base"][ds], runs[arm][ds], dec, a.include_truncated)
             for dec in ("greedy", "sample")} for ds in a.eval_datasets}
    if arm == "baked_steering" and STEER_DATASET in a.eval_datasets:
        summary["paired"][f"base vs {arm} (steering held-out items)"] = {STEER_DATASET: [
            p.to_dict() for p in paired_arm_test(runs["base"][STEER_DATASET], runs[arm][STEER_DATASET],
                                                 keep=lambda i: split_of(i) == "heldout",
                                                 include_truncated=a.include_truncated)]}
    for ds in a.eval_datasets:
        layers = ActivationCache.load(runs["base"][ds] / "activations").layers
        dirs, src = base_directions(runs["base"][ds], layers)
        if not dirs:
            notes.append(f"{ds}: no base direction ({src}); boundary shift not reported")
            shifts[f"{arm} {ds}"] = []
            continue
        shifts[f"{arm} {ds}"] = boundary_shift(runs["base"][ds], runs[arm][ds], dirs)
        if f"{ds}: base direction {src}" not in notes:
            notes.append(f"{ds}: base direction {src}")


def asdict_safe(cfg: Any) -> dict[str, Any]:
    return asdict(cfg)


def load_base_hash(model: str) -> str:
    return weight_identity(model)[1]
