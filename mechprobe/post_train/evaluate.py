"""Before/after evaluation of post-training: the probe, the judge and the boundary states.

Each *arm* (the base model, the post-trained merged model, optionally the base model with a steering
vector baked into its weights) gets ordinary probe runs built by :func:`mechprobe.stages.ensure_stages`
on the probe's own items (GSM8K, MT-Bench: never the conversation data the adapter was trained on), so
every number here is the one ``mechprobe judge`` / ``mechprobe cache`` would give for that run.

Paired comparisons key on ``record_id`` (``<item>|greedy|s0``, ``<item>|T1|s<k>``): the same item and the
same decoding slot in both arms, with the same per-row sampling seed, which is what McNemar's exact test
needs. Inside the model, each arm's boundary state is projected onto the *base* model's
difference-of-means direction (genuine minus not-genuine follow-up) and the per-item shift is reported
per layer with an item-bootstrap CI, in units of the base model's class gap at that layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mechprobe.activations.cache import ActivationCache
from mechprobe.audit.estimate import Estimate
from mechprobe.audit.rates import audit_truth, difference_columns, rate_columns
from mechprobe.errors import MissingInput, UsageError
from mechprobe.io import read_json, read_jsonl, write_json
from mechprobe.judges.factory import check_judge_spec, default_judge
from mechprobe.lm.models import check_model_source, load_model, weight_identity
from mechprobe.post_train import train as pt
from mechprobe.post_train.train import save_merged
from mechprobe.records import truncated_item_ids, truncation_note
from mechprobe.stages import ensure_stages, probe_config
from mechprobe.stats import Rate, mcnemar_exact
from mechprobe.steering.evaluate import split_of
from mechprobe.steering.experiment import DEFAULT_ALPHAS, SteerConfig, run_steer
from mechprobe.steering.vector import SteeringVector, bake
from mechprobe.turns.datasets import NAMES
from mechprobe.turns.pipeline import default_run_dir


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
    judge: str | None = None  # offline | hybrid2:MODEL | openai:MODEL | local:MODEL (default: the best-validated judge th…
    relabel: bool = False  # eval runs labelled by another judge: move those labels aside and relabel
    steer_run: str | None = None  # run whose steering/results.json gives the baked-vector arm (default: the base model's gsm8…
    no_steer: bool = False  # do not build a steering result for the baked arm
    include_truncated: bool = False  # keep user turns after truncated assistant answers in rates and paired tests

    @classmethod
    def from_namespace(cls, a: Any) -> PostTrainConfig:
        """Keep only this config's fields of an argparse namespace (the CLI adds its own keys)."""
        return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)})



def labels_of(run: Path) -> dict[str, dict[str, Any]]:
    """``record_id -> label row`` of a judged run (judge errors kept; ``genuine`` is None there)."""
    return {r["record_id"]: r for r in read_jsonl(run / "labels.jsonl", key="record_id")}


def turns_of(run: Path) -> dict[str, dict[str, Any]]:
    return {r["record_id"]: r for r in read_jsonl(run / "user_turns.jsonl", key="record_id")}


def truncated_of(run: Path) -> set[str]:
    """Item ids of ``run`` whose assistant answer hit the token cap."""
    return truncated_item_ids(read_jsonl(run / "assistant.jsonl", key="item_id"))


def followup_rates(run: Path, include_truncated: bool = False) -> dict[str, Rate]:
    """Genuine follow-up rate per decoding (``greedy``, ``sample``) over judged turns; turns after a truncated
    assistant answer are left out unless ``include_truncated``."""
    labels, turns = labels_of(run), turns_of(run)
    cut = set() if include_truncated else truncated_of(run)
    out: dict[str, Rate] = {}
    for dec in ("greedy", "sample"):
        g = [labels[r]["genuine"] for r, t in turns.items() if t["decoding"] == dec and r in labels
             and labels[r]["genuine"] is not None and t["item_id"] not in cut]
        out[dec] = Rate(sum(bool(x) for x in g), len(g))
    return out


def judge_verdicts(run: Path, decoding: str, include_truncated: bool = False) -> dict[str, int]:
    """record id -> the judge's verdict (1 genuine, 0 not) for the turns of ``decoding`` that count in a rate."""
    labels, turns = labels_of(run), turns_of(run)
    cut = set() if include_truncated else truncated_of(run)
    return {r: int(bool(labels[r]["genuine"])) for r, t in turns.items() if t["decoding"] == decoding
            and r in labels and labels[r]["genuine"] is not None and t["item_id"] not in cut}


def corrected_rates(run: Path, include_truncated: bool = False) -> dict[str, Any] | None:
    """Audit-corrected follow-up rate per decoding (PPI++ on the run's audited turns), or None without an audit.

    The audit is ``mechprobe audit RUN``'s sample and its imported labels; see :mod:`mechprobe.audit.rates`."""
    truth = audit_truth(run)
    if truth is None:
        return None
    out: dict[str, Any] = {"labellers": list(truth.labellers), "n_audited": len(truth)}
    for dec in ("greedy", "sample"):
        _, c = rate_columns(judge_verdicts(run, dec, include_truncated), truth)
        out[dec] = c.to_dict() if c is not None else None
    return out


def corrected_difference(run_a: Path, run_b: Path, decoding: str, include_truncated: bool = False
                         ) -> dict[str, Any] | None:
    """Audit-corrected paired difference (b - a) on the record ids both runs judged, or None unless both are audited."""
    ta, tb = audit_truth(run_a), audit_truth(run_b)
    if ta is None or tb is None:
        return None
    cut = set() if include_truncated else truncated_of(run_a) | truncated_of(run_b)
    ja = {r: v for r, v in judge_verdicts(run_a, decoding, True).items() if r.split("|")[0] not in cut}
    jb = {r: v for r, v in judge_verdicts(run_b, decoding, True).items() if r.split("|")[0] not in cut}
    j, c = difference_columns(ja, jb, ta.truth, tb.truth)
    return {"judge_only": j.to_dict(), "corrected": c.to_dict() if c is not None else None}


def label_distribution(run: Path) -> dict[str, int]:
    return dict(Counter(r["label"] for r in labels_of(run).values()).most_common())


def task_accuracy(run: Path) -> Rate:
    """Share of scored assistant turns that are correct (GSM8K exact match; MT-Bench is unscored: n = 0)."""
    scores = [r["score"] for r in read_jsonl(run / "assistant.jsonl", key="item_id") if r.get("score") is not None]
    return Rate(int(sum(s >= 0.5 for s in scores)), len(scores))


@dataclass
class Paired:
    decoding: str
    n: int
    both: int
    only_a: int
    only_b: int
    p: float

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def paired_arm_test(run_a: Path, run_b: Path, keep: Callable[[str], bool] | None = None,
                    include_truncated: bool = False) -> list[Paired]:
    """McNemar exact per decoding over the record ids judged (without error) in both runs.

    ``keep(item_id)`` restricts the pairs to some items (the baked-steering arm on the items its vector was
    not built from). Items whose assistant answer was truncated in either arm are left out unless
    ``include_truncated``."""
    la, lb, ta = labels_of(run_a), labels_of(run_b), turns_of(run_a)
    cut = set() if include_truncated else truncated_of(run_a) | truncated_of(run_b)
    out = []
    for dec in ("greedy", "sample"):
        ids = [r for r, t in ta.items() if t["decoding"] == dec and r in la and r in lb
               and la[r]["genuine"] is not None and lb[r]["genuine"] is not None
               and (keep is None or keep(str(t.get("item_id", r.split("|")[0]))))
               and str(t.get("item_id", r.split("|")[0])) not in cut]
        a = [bool(la[r]["genuine"]) for r in ids]
        b = [bool(lb[r]["genuine"]) for r in ids]
        only_a = sum(x and not y for x, y in zip(a, b))
        only_b = sum(y and not x for x, y in zip(a, b))
        out.append(Paired(dec, len(ids), sum(x and y for x, y in zip(a, b)), only_a, only_b,
                          mcnemar_exact(only_a, only_b)))
    return out


# ---------------------------------------------------------------------------------------------------
# Inside the model


def base_directions(base_run: Path, layers: Sequence[int]) -> tuple[dict[int, np.ndarray], str]:
    """Per layer, the base model's difference-of-means direction (genuine minus not), and where it came from.

    Read from ``<run>/probes/directions.safetensors`` when the probes stage wrote it; otherwise computed
    from the run's cache and labels (same definition as :func:`mechprobe.linear.turn.directions`). Empty when the
    base run has no positive or no negative turn (the direction is undefined then).
    """
    p = base_run / "probes" / "directions.safetensors"
    if p.exists():
        from safetensors.numpy import load_file

        d = load_file(str(p))
        got = {la: d[f"diff_means_{la}"] for la in layers if f"diff_means_{la}" in d}
        if got:
            return got, str(p)

    cache = ActivationCache.load(base_run / "activations")
    out: dict[int, np.ndarray] = {}
    for la in layers:
        x, y, _, _ = cache.dataset(la)
        y = np.asarray(y).astype(bool)
        if y.all() or not y.any():
            return {}, f"not computable: {int(y.sum())} positive of {len(y)} judged base turns"
        x = np.asarray(x, dtype=np.float64)
        out[la] = (x[y].mean(0) - x[~y].mean(0)).astype(np.float32)
    return out, f"computed from {base_run}/activations and labels"


def _item_means(run: Path, layer: int, unit: np.ndarray) -> dict[str, float]:

    cache = ActivationCache.load(run / "activations")
    proj = cache.resid(layer).to(torch.float64).numpy() @ unit.astype(np.float64)
    acc: dict[str, list[float]] = {}
    for it, v in zip(cache.item_ids, proj):
        acc.setdefault(it, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def boundary_shift(base_run: Path, other_run: Path, directions: dict[int, np.ndarray], n_boot: int = 1000,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Per layer: mean over items of (other - base) projection of the boundary state on the base direction.

    The boundary state depends on the conversation (each arm answers the item itself), so the unit is the
    item: its rows share one boundary prompt. The CI resamples items. ``shift_gap`` divides by the base
    class gap (|diff of means|): 1.0 means the average state moved by one follow-up/non-follow-up gap.
    """
    rng = np.random.default_rng(seed)
    out = []
    for layer, d in sorted(directions.items()):
        gap = float(np.linalg.norm(d))
        if gap == 0:
            continue
        unit = d / gap
        a, b = _item_means(base_run, layer, unit), _item_means(other_run, layer, unit)
        items = sorted(set(a) & set(b))
        if not items:
            continue
        diff = np.array([b[i] - a[i] for i in items])
        boots = diff[rng.integers(0, len(diff), (n_boot, len(diff)))].mean(1)
        lo, hi = np.percentile(boots, [2.5, 97.5])
        out.append({"layer": layer, "n_items": len(items), "shift": float(diff.mean()), "ci": [float(lo), float(hi)],
                    "gap": gap, "shift_gap": float(diff.mean() / gap), "ci_gap": [float(lo / gap), float(hi / gap)]})
    return out


# ---------------------------------------------------------------------------------------------------
# Figures


def plot_loss(log: list[dict[str, Any]], out: Path, title: str,
              ylabel: str = "user-turn cross-entropy (nats/token)", heldout: Sequence[Sequence[float]] = (),
              chosen: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in log]
    loss = np.array([r["loss"] for r in log])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.8, alpha=0.5, label="loss per step")
    if len(loss) >= 10:
        w = max(5, len(loss) // 20)
        ax.plot(steps[w - 1:], np.convolve(loss, np.ones(w) / w, mode="valid"), lw=2, label=f"mean of {w}")
    if heldout:
        ax.plot([h[0] for h in heldout], [h[1] for h in heldout], "o-", color="k", lw=1.5, label="held-out loss")
    if chosen is not None and heldout:
        ax.axvline(chosen, color="k", ls=":", lw=1, label=f"chosen step {chosen} (held-out best)")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_eval(summary: dict[str, Any], shifts: dict[str, list[dict[str, Any]]], out: Path, title: str) -> Path:
    """Left: follow-up rates per arm and decoding with Wilson CIs. Right: boundary shift per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    arms = list(summary["arms"])
    decs = ["greedy", "sample"]
    width = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        r = summary["arms"][arm]["all"]["followup"]
        vals = [r[d]["rate"] if r[d]["n"] else 0 for d in decs]
        err = [[v - r[d]["ci"][0] for v, d in zip(vals, decs)], [r[d]["ci"][1] - v for v, d in zip(vals, decs)]]
        ax.bar(np.arange(len(decs)) + j * width, vals, width, yerr=err, capsize=3, label=f"{arm}, judge only")
        # Audit-corrected rates are per dataset (not pooled): drawn when the arm was evaluated on one dataset.
        per = [v for k, v in summary["arms"][arm].items() if k != "all"]
        c = per[0].get("corrected") if len(per) == 1 else None
        for i, d in enumerate(decs):
            e = (c or {}).get(d)
            if e and math.isfinite(e["point"]):
                lab = "corrected by the audit (model-written labels)"
                ax.errorbar(i + j * width + width * 0.3, e["point"],
                            yerr=[[max(0.0, e["point"] - e["lo"])], [max(0.0, e["hi"] - e["point"])]],
                            fmt="D", color="crimson", ms=5, capsize=4,
                            label=None if lab in ax.get_legend_handles_labels()[1] else lab)
    ax.set_xticks(np.arange(len(decs)) + width * (len(arms) - 1) / 2, decs)
    ax.set_ylabel("genuine follow-up rate (95% CI)")
    ax.legend()
    for name, rows in shifts.items():
        if not rows:
            continue
        ls = [r["layer"] for r in rows]
        ax2.plot(ls, [r["shift_gap"] for r in rows], marker="o", ms=3, label=name)
        ax2.fill_between(ls, [r["ci_gap"][0] for r in rows], [r["ci_gap"][1] for r in rows], alpha=0.2)
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_xlabel("residual index")
    ax2.set_ylabel("boundary shift on base diff-of-means (class gaps)")
    if any(shifts.values()):
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no base direction (no positive labels)", ha="center", transform=ax2.transAxes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def arm_summary(runs: dict[str, Path], include_truncated: bool = False) -> dict[str, Any]:
    """Per dataset run and pooled: follow-up rates, accuracy, label distribution, truncated answers."""
    per: dict[str, Any] = {}
    pooled_f = {"greedy": Rate(0, 0), "sample": Rate(0, 0)}
    pooled_acc = Rate(0, 0)
    pooled_labels: Counter = Counter()
    pooled_cut = Rate(0, 0)
    for ds, run in runs.items():
        f = followup_rates(run, include_truncated)
        acc = task_accuracy(run)
        lab = label_distribution(run)
        cut = Rate(len(truncated_of(run)), len(read_jsonl(run / "assistant.jsonl", key="item_id")))
        pooled_cut = Rate(pooled_cut.k + cut.k, pooled_cut.n + cut.n)
        per[ds] = {"run": str(run), "followup": {k: v.to_dict() for k, v in f.items()}, "accuracy": acc.to_dict(),
                   "labels": lab, "truncated": {"k": cut.k, "n": cut.n, "excluded": not include_truncated},
                   "corrected": corrected_rates(run, include_truncated)}
        for k, v in f.items():
            pooled_f[k] = Rate(pooled_f[k].k + v.k, pooled_f[k].n + v.n)
        pooled_acc = Rate(pooled_acc.k + acc.k, pooled_acc.n + acc.n)
        pooled_labels.update(lab)
    per["all"] = {"followup": {k: v.to_dict() for k, v in pooled_f.items()}, "accuracy": pooled_acc.to_dict(),
                  "labels": dict(pooled_labels.most_common()),
                  "truncated": {"k": pooled_cut.k, "n": pooled_cut.n, "excluded": not include_truncated}}
    return per


def _fmt_rate(d: dict[str, Any]) -> str:
    return Rate(d["k"], d["n"]).fmt()


def report_markdown(summary: dict[str, Any], train_info: dict[str, Any], shifts: dict[str, list[dict[str, Any]]],
                    notes: list[str]) -> str:
    lines = [f"# Post-training report: {train_info.get('model')}", ""]
    if train_info:
        lines += ["## Training", ""]
        for k in ("method", "train_conversations", "heldout_conversations", "train_examples", "skipped", "pairs",
                  "judge_error_on_pairs", "beta", "steps_done", "resumed_from", "seconds", "seconds_per_step",
                  "tokens_per_s", "first_loss", "last_loss_mean10", "last_reward_accuracy_mean10", "heldout_loss"):
            if k in train_info:
                lines.append(f"- {k}: {train_info[k]}")
        lines.append("")
    lines += ["## Follow-up rates (judge: " + summary.get("judge", "?") + ")", "",
              "| arm | dataset | greedy follow-up [95% CI] | sampled follow-up [95% CI] | task accuracy [95% CI] "
              "| truncated answers |", "|---|---|---|---|---|---|"]
    for arm, per in summary["arms"].items():
        for ds, r in per.items():
            acc = _fmt_rate(r["accuracy"]) if r["accuracy"]["n"] else "unscored"
            cut = r.get("truncated")
            cut_s = truncation_note(cut["k"], cut["n"], not cut["excluded"]) if cut else "n/a"
            lines.append(f"| {arm} | {ds} | {_fmt_rate(r['followup']['greedy'])} | "
                         f"{_fmt_rate(r['followup']['sample'])} | {acc} | {cut_s} |")
    audited = [(arm, ds, r["corrected"]) for arm, per in summary["arms"].items() for ds, r in per.items()
               if r.get("corrected")]
    lines += ["", "## Follow-up rates corrected by the audit (PPI++ on the audited turns)", ""]
    if not audited:
        lines.append("No eval run is audited: every rate above is judge only (`mechprobe audit RUN` draws the sample).")
    else:
        lines += ["| arm | dataset | greedy, corrected [95% CI] | sampled, corrected [95% CI] | audited turns | "
                  "labellers |", "|---|---|---|---|---|---|"]
        for arm, ds, c in audited:
            cell = {k: (Estimate(**c[k]).cell() + f" (n={c[k]['n_audited']})" if c.get(k) else "n/a")
                    for k in ("greedy", "sample")}
            lines.append(f"| {arm} | {ds} | {cell['greedy']} | {cell['sample']} | {c['n_audited']} | "
                         f"{', '.join(c['labellers'])} |")
    diffs = [(comp, ds, d) for comp, per in summary.get("corrected_paired", {}).items() for ds, d in per.items()]
    if diffs:
        lines += ["", "| comparison | dataset | decoding | difference, judge only [95% CI] | "
                  "difference, corrected [95% CI] (n items audited in both) |", "|---|---|---|---|---|"]
        for comp, ds, d in diffs:
            for dec, v in d.items():
                if v is None:
                    continue
                c = v["corrected"]
                lines.append(f"| {comp} | {ds} | {dec} | {Estimate(**v['judge_only']).cell()} | "
                             f"{Estimate(**c).cell() + ' (n=' + str(c['n_audited']) + ')' if c else 'n/a'} |")
    lines += ["", "## Paired tests (McNemar exact, same record ids)", "",
              "| comparison | dataset | decoding | pairs | both | only first | only second | p |",
              "|---|---|---|---|---|---|---|---|"]
    for comp, per in summary["paired"].items():
        for ds, rows in per.items():
            for r in rows:
                lines.append(f"| {comp} | {ds} | {r['decoding']} | {r['n']} | {r['both']} | {r['only_a']} | "
                             f"{r['only_b']} | {r['p']:.3g} |")
    st = summary.get("steering")
    if st:
        def _r(d: dict[str, Any] | None) -> str:
            if not d or d.get("followup_rate") is None:
                return "?"
            ci = d.get("ci") or [None, None]
            return (f"{d['followup_rate']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] (n={d.get('n')})" if ci[0] is not None
                    else f"{d['followup_rate']:.3f} (n={d.get('n')})")

        lines += ["", "## Steering it vs training it", "",
                  f"The baked arm is the base model with the difference-of-means vector of `{st['run']}` (residual "
                  f"{st['layer']}, alpha {st['alpha']:g} {st.get('alpha_unit') or ''}, {st['how']}; judge "
                  f"{st.get('judge')}) folded into its weights. In that steering run, greedy follow-up on its "
                  f"held-out {st['dataset']} items: unsteered {_r(st.get('unsteered_heldout'))}, steered (hooks, "
                  f"boundary + generated positions) {_r(st.get('steered_heldout'))}. The tables above give the same "
                  "comparison for the baked weights (vector at every position) on this report's items."]
    lines += ["", "## Label distributions (pooled over datasets)", ""]
    for arm, per in summary["arms"].items():
        lines.append(f"- {arm}: " + ", ".join(f"{k} {v}" for k, v in per["all"]["labels"].items()))
    lines += ["", "## Inside the model: boundary state on the base model's difference-of-means direction", ""]
    if not any(shifts.values()):
        lines.append("no base direction could be formed (see notes)")
    for name, rows in shifts.items():
        if not rows:
            continue
        best = max(rows, key=lambda r: abs(r["shift_gap"]))
        lines.append(f"- {name}: largest |shift| at residual {best['layer']}: {best['shift_gap']:+.3f} class gaps "
                     f"[{best['ci_gap'][0]:+.3f}, {best['ci_gap'][1]:+.3f}] over {best['n_items']} items")
        lines.append("  per layer (class gaps): " + ", ".join(f"L{r['layer']} {r['shift_gap']:+.2f}" for r in rows))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    write_json(out, summary)


def read_summary(out: Path) -> dict[str, Any]:
    return read_json(out)


# ---------------------------------------------------------------------------------------------------
# The command (experiments/post_train.py)

# Defaults sized by a measured throughput (docs/post_training.md): SmolLM2-135M, batch 8, 1 thread on the
# shared 2-core CPU ran 14.7 s/step, so 180 steps (~1440 examples, ~0.75 epoch) take ~44 minutes.
DEFAULTS = dict(steps=180, batch_size=8, max_len=256, lr=3e-4, lora_r=8, lora_alpha=16, checkpoint_every=10,
                train_minutes=20.0)




def _heldout_loss(pm: Any, examples: Sequence[Any], pad_id: int, adapter: bool) -> float:
    """Mean user-turn cross-entropy on held-out conversations, with the adapter on or off."""
    if adapter:
        return pt.heldout_loss(pm, examples, pad_id)
    with pm.disable_adapter():
        return pt.heldout_loss(pm, examples, pad_id)


STEER_DATASET = "gsm8k"
METHODS = ("sft", "dpo")


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
        notes.append("baked steering arm skipped (--no-steer)")
        return None
    run = out / f"steer-{STEER_DATASET}"
    if getattr(a, "include_truncated", False):
        build_steering(a.model, run, judge, include_truncated=True)
    else:
        build_steering(a.model, run, judge)
    return run / "steering" / "results.json"


def _bake_arm(a: Any, out: Path, base_weight_hash: str, notes: list[str], judge: str = "offline"
              ) -> tuple[str, dict[str, Any]] | None:
    """(model dir with the base model's steering vector baked in, what was baked), or None with a note saying why."""

    res_p = _steer_result(a, out, judge, notes)
    if res_p is None:
        return None
    steer_run = res_p.parent.parent
    if not res_p.exists():
        notes.append(f"baked steering arm skipped: no steering result for the base model at {res_p} "
                     f"(run `python experiments/steer.py --run {steer_run}` first)")
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
            bake(lm.model, vec, float(best["alpha"]))
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


def validate_args(a: PostTrainConfig) -> None:
    """Every option checked before the first model loads: a bad judge or dataset must not surface only after
    training. (``--target-modules`` is checked against the model's modules right after it loads.)"""
    check_model_source(a.model, "--model")
    if a.judge is not None and not a.no_eval:
        check_judge_spec(a.judge)
    bad = []
    unknown = [s for s in a.sources if s not in pt.SOURCES]
    if unknown:
        bad.append(f"--sources {unknown} unknown; choose from {', '.join(pt.SOURCES)}")
    unknown = [d for d in a.eval_datasets if d not in NAMES]
    if unknown:
        bad.append(f"--eval-datasets {unknown} unknown; choose from {', '.join(NAMES)}")
    if a.data_path is not None and not Path(a.data_path).exists():
        bad.append(f"--data-path {a.data_path} does not exist")
    if a.steer_run is not None and not Path(a.steer_run).exists():
        bad.append(f"--steer-run {a.steer_run} does not exist")
    if a.data_limit is not None and a.data_limit < 1:
        bad.append(f"--data-limit must be >= 1, got {a.data_limit}")
    if not 0.0 <= a.held_out_fraction < 1.0:
        bad.append(f"--held-out-fraction must be in [0, 1), got {a.held_out_fraction}")
    if a.method not in METHODS:
        bad.append(f"--method {a.method!r} unknown; choose from {', '.join(METHODS)}")
    if a.max_pairs is not None and a.max_pairs < 1:
        bad.append(f"--max-pairs must be >= 1, got {a.max_pairs}")
    for flag in ("batch_size", "max_len", "eval_limit", "samples", "max_assistant_tokens", "max_user_tokens", "pair_items",
                 "pair_samples"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            bad.append(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if not (math.isfinite(a.temperature) and a.temperature > 0):
        bad.append(f"--temperature must be a finite number > 0 (the sampled turns), got {a.temperature}")
    try:
        torch.device(a.device)
    except RuntimeError:
        bad.append(f"--device {a.device!r} is not a torch device (cpu, cuda, cuda:0, mps)")
    if bad:
        raise UsageError("; ".join(bad))


def run_post_train(a: PostTrainConfig) -> int:
    """Train (or reuse) the adapter, merge it, evaluate base vs post-trained (vs baked steering), report."""


    name = Path(a.model).name.replace(".gguf", "")
    out = Path(a.out) if a.out else Path("runs") / "post_train" / name
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
    validate_args(a)
    if a.eval_only and not (out / pt.ADAPTER_DIR / "adapter_config.json").exists():
        raise MissingInput(f"--eval-only needs a trained adapter at {out / pt.ADAPTER_DIR}: train first")
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(a.model, device=a.device, dtype=torch.float32)
    pt.check_target_modules(lm.model, cfg)
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
        from peft import PeftModel

        pm = PeftModel.from_pretrained(lm.model, out / pt.ADAPTER_DIR)
        info.update({k: v for k, v in (read_json(out / "train_summary.json") if (out / "train_summary.json").exists()
                                      else {}).items() if k not in info})
    else:
        print(f"training on {len(built.examples)} user turns from {len(train)} conversations "
              f"({len(held)} held out); skipped {built.skipped}")
        pm, res = pt.train_lora(lm.model, built.examples, cfg, out, pad_id=pad, heldout=held_ex[:a.curve_examples])
        log = pt.read_train_log(out)
        # From the whole log, not this session: a resumed (or already finished) run still reports the
        # throughput of all its steps.
        secs = sum(r["seconds"] for r in log)
        curve = read_jsonl(out / pt.HELDOUT_LOG, key="step") if (out / pt.HELDOUT_LOG).exists() else []
        info.update({"steps_done": res.steps_done, "resumed_from": res.resumed_from, "chosen_step": res.chosen_step,
                     "planned_steps": res.planned_steps, "stopped_early": res.stopped_early,
                     "plan": read_json(out / pt.PLAN) if (out / pt.PLAN).exists() else None,
                     "heldout_curve": [[r["step"], r["heldout_loss"]] for r in curve],
                     "seconds": round(secs, 1),
                     "tokens_per_s": round(sum(r["tokens"] for r in log) / secs, 1) if secs else None,
                     "seconds_per_step": round(secs / len(log), 2) if log else None,
                     "first_loss": log[0]["loss"] if log else None,
                     "last_loss_mean10": round(float(np.mean([r["loss"] for r in log[-10:]])), 4) if log else None})
        if held_ex:
            info["heldout_loss"] = {"base": round(_heldout_loss(pm, held_ex, pad, adapter=False), 4),
                                    "post": round(_heldout_loss(pm, held_ex, pad, adapter=True), 4),
                                    "n_examples": len(held_ex)}
        plot_loss(log, out / "figures" / "post_train_loss.png",
                  f"{lm.name}: LoRA r={cfg.lora_r} on {len(built.examples)} human user turns, "
                  f"{info['tokens_per_s']} tok/s; held-out n={min(len(held_ex), a.curve_examples)}",
                  heldout=info["heldout_curve"], chosen=res.chosen_step)
        write_json(out / "train_summary.json", info)
    merged_dir = out / pt.MERGED_DIR
    if not a.eval_only or not (merged_dir / "config.json").exists():
        base_hash = lm.weight_hash
        pt.save_merged(pt.merge_adapter(pm), tok, merged_dir,
                       {"base_model": lm.name, "base_weight_hash": base_hash, "adapter": str(out / pt.ADAPTER_DIR),
                        "train_config": asdict_safe(cfg)})
    del pm, lm
    check = load_model(str(merged_dir), device="cpu", dtype=torch.float32)
    print(f"merged model: {merged_dir} (weight hash {check.weight_hash[:12]}..., loads with load_model)")
    info["merged"] = {"path": str(merged_dir), **check.identity()}
    del check
    write_json(out / "train_summary.json", info)
    if a.no_eval:
        return 0
    return evaluate_arms(a, out, {"post": str(merged_dir)}, info)


def evaluate_arms(a: PostTrainConfig, out: Path, trained: dict[str, str], info: dict[str, Any], suffix: str = "",
                  what: str = "post-trained") -> int:
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
        0.

    Example:
        >>> evaluate_arms(cfg, Path("runs/post_train/m"), {"dpo": "runs/post_train/m/dpo/merged"}, {})  # doctest: +SKIP
        0
    """
    import time

    base_hash = load_base_hash(a.model)
    notes: list[str] = []
    judge_spec = default_judge(a.model) if a.judge in (None, "auto") else a.judge
    arms: dict[str, str] = {"base": a.model, **trained}
    t0 = time.time()
    baked = _bake_arm(a, out, base_hash, notes, judge_spec)
    steer_seconds = round(time.time() - t0, 1)
    if baked:
        arms["baked_steering"] = baked[0]
    runs: dict[str, dict[str, Path]] = {}
    judge_name = judge_spec
    t0 = time.time()
    for arm, src in arms.items():
        runs[arm] = {}
        for ds in a.eval_datasets:
            run = out / "eval" / f"{arm}-{ds}"
            pcfg = probe_config(src, ds, limit=a.eval_limit, samples=a.samples, temperatures=[0.0, a.temperature],
                                max_assistant_tokens=a.max_assistant_tokens, max_user_tokens=a.max_user_tokens)
            _, judge_name = ensure_stages(run, pcfg, judge_spec, relabel=a.relabel,
                                          include_truncated=a.include_truncated)
            runs[arm][ds] = run
    summary: dict[str, Any] = {"judge": judge_name,
                               "arms": {arm: arm_summary(r, a.include_truncated) for arm, r in runs.items()},
                               "paired": {}, "eval_seconds": round(time.time() - t0, 1),
                               "steering": baked[1] if baked else None, "steer_seconds": steer_seconds}
    shifts: dict[str, list[dict[str, Any]]] = {}
    for arm in arms:
        if arm == "base":
            continue
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
    summary["boundary_shift"] = shifts
    write_json(out / f"eval_summary{suffix}.json", summary)
    fig = plot_eval(summary, shifts, out / "figures" / f"post_train_eval{suffix}.png",
                    f"{info.get('model', a.model)}: base vs {what}, {a.eval_limit} items x {a.eval_datasets}, judge {judge_name}")
    notes.append(f"figures: {out / 'figures' / f'post_train_loss{suffix}.png'}, {fig}")
    (out / f"report{suffix}.md").write_text(report_markdown(summary, info, shifts, notes))
    print((out / f"report{suffix}.md").read_text())
    return 0


def asdict_safe(cfg: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)


def load_base_hash(model: str) -> str:

    return weight_identity(model)[1]
