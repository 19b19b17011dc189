"""Post-training figures: the training loss curve and the before/after evaluation.

Plain data in (the training log rows, the evaluation summary as written to ``eval_summary*.json``), a PNG out,
so a committed summary redraws its figure without the runs. Every title names the model, the judge (or that
there is none), n, and whether the rates are judge only or corrected by the audit; legends sit below the axes
so they never cover a bar.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.plots.extents import yerr

DECODINGS = ("greedy", "sample")
CORRECTED = "corrected by the audit (model-written labels)"


def _pyplot() -> Any:
    import matplotlib  # lazy: module otherwise light; pyplot loads when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: module otherwise light; pyplot loads when a figure is drawn

    return plt


def _legend_below(ax: Any, ncol: int, fontsize: int = 8) -> None:
    """A legend under the axes: outside the data area, so it never hides a bar or a line."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=max(1, ncol), fontsize=fontsize,
                  frameon=False)


def plot_loss(log: list[dict[str, Any]], out: Path, title: str,
              ylabel: str = "user-turn cross-entropy (nats/token)", heldout: Sequence[Sequence[float]] = (),
              chosen: int | None = None) -> Path:
    """Loss per step (with a running mean), the held-out curve and the chosen step. ``title`` comes from
    :func:`loss_title`, which names the model, the judge and n."""
    plt = _pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in log]
    loss = np.array([r["loss"] for r in log])
    fig, ax = plt.subplots(figsize=(7, 4.4))
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
    _legend_below(ax, 4)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def loss_title(model: str, what: str, n: int, judge: str | None = None) -> str:
    """``model: what, n=...; judge ...``: a loss curve has no rates, so it says which judge (if any) chose the
    training data and that its labels were used as the judge gave them (judge only)."""
    who = f"training data labelled by judge {judge} (judge only)" if judge else "no judge (loss on human turns)"
    return f"{model}: {what}, n={n}; {who}"


def _arm_items(arm: dict[str, Any]) -> int:
    """Items behind an arm: its answers, summed over datasets (the pooled ``truncated`` count)."""
    cut = arm.get("all", {}).get("truncated")
    return int(cut["n"]) if cut else 0


def eval_title(summary: dict[str, Any], model: str, what: str) -> str:
    """Model, comparison, judge, n (items and judged turns of the base arm) and judge only vs corrected."""
    arms = summary["arms"]
    base = arms.get("base") or next(iter(arms.values()))
    f = base["all"]["followup"]
    datasets = [k for k in base if k != "all"]
    corrected = _has_corrected(summary)
    how = "bars judge only, diamonds corrected by the audit" if corrected else "judge only (no audit)"
    return (f"{model}: base vs {what}; judge {summary.get('judge', '?')}\n"
            f"n = {_arm_items(base)} items ({', '.join(datasets)}); base arm judged turns: greedy n={f['greedy']['n']}, "
            f"sampled n={f['sample']['n']}; {how}")


def _has_corrected(summary: dict[str, Any]) -> bool:
    return any(_corrected_of(a) for a in summary["arms"].values())


def _corrected_of(arm: dict[str, Any]) -> dict[str, Any] | None:
    # Audit-corrected rates are per dataset (not pooled): drawn when the arm was evaluated on one dataset.
    per = [v for k, v in arm.items() if k != "all"]
    return per[0].get("corrected") if len(per) == 1 else None


def _followup_panel(ax: Any, summary: dict[str, Any]) -> None:
    arms = list(summary["arms"])
    width = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        r = summary["arms"][arm]["all"]["followup"]
        vals = [r[d]["rate"] if r[d]["n"] else 0 for d in DECODINGS]
        err = yerr(vals, [r[d]["ci"][0] for d in DECODINGS], [r[d]["ci"][1] for d in DECODINGS])
        ax.bar(np.arange(len(DECODINGS)) + j * width, vals, width, yerr=err, capsize=3, label=f"{arm}, judge only")
        c = _corrected_of(summary["arms"][arm])
        for i, d in enumerate(DECODINGS):
            e = (c or {}).get(d)
            if e and math.isfinite(e["point"]):
                ax.errorbar(i + j * width + width * 0.3, e["point"],
                            yerr=yerr([e["point"]], [e["lo"]], [e["hi"]]),
                            fmt="D", color="crimson", ms=5, capsize=4,
                            label=None if CORRECTED in ax.get_legend_handles_labels()[1] else CORRECTED)
    ax.set_xticks(np.arange(len(DECODINGS)) + width * (len(arms) - 1) / 2, list(DECODINGS))
    ax.set_ylabel("genuine follow-up rate (95% CI)")
    _legend_below(ax, 2)


def _shift_panel(ax: Any, shifts: dict[str, list[dict[str, Any]]]) -> None:
    for name, rows in shifts.items():
        if not rows:
            continue
        ls = [r["layer"] for r in rows]
        ax.plot(ls, [r["shift_gap"] for r in rows], marker="o", ms=3, label=name)
        ax.fill_between(ls, [r["ci_gap"][0] for r in rows], [r["ci_gap"][1] for r in rows], alpha=0.2)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("residual index")
    ax.set_ylabel("boundary shift on base diff-of-means (class gaps)")
    if any(shifts.values()):
        _legend_below(ax, 3)
    else:
        ax.text(0.5, 0.5, "no base direction (no positive labels)", ha="center", transform=ax.transAxes)


def plot_eval(summary: dict[str, Any], shifts: dict[str, list[dict[str, Any]]], out: Path, model: str,
              what: str = "post-trained") -> Path:
    """Left: follow-up rates per arm and decoding with Wilson CIs (bars judge only; audit-corrected diamonds
    where an arm's run is audited). Right: boundary shift per layer. Title: :func:`eval_title`."""
    plt = _pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    _followup_panel(ax, summary)
    _shift_panel(ax2, shifts)
    fig.suptitle(eval_title(summary, model, what), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
