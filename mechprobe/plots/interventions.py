"""The intervention study's figure: each arm's rate of genuine follow-up under both readings, and its paired
difference against the base arm, with the intervals the table gives.

Plain data in (a study's ``table.json`` as :func:`mechprobe.audit.arms.study_table` writes it), a PNG out, so a
committed table redraws its figure without the runs. The rates are the two blind model-written labellers'
consensus: no judge decides them and no audit corrects them, and the title says so (with the model, the plan and
the items per arm), because a figure travels without its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.plots.extents import yerr
from mechprobe.plots.post_train import _pyplot

__all__ = ["patching_figure_title", "plot_patching_profile", "plot_study_arms", "study_figure_title"]

READINGS = ("strict", "lenient")
COLOURS = {"strict": "#1f4e79", "lenient": "#9dc3e6"}


def study_figure_title(model: str, plan: str, n_items: int) -> str:
    """``model · plan · n items per arm · labels: two blind model-written labellers (both agree) · no judge, not
    corrected`` (the figure rule: model, judge, n and correction named)."""
    return (f"{model} · {plan} · n = {n_items} items per arm · labels: two blind model-written labellers (both "
            "agree) · no judge, not corrected")


def plot_study_arms(table: dict[str, Any], arms: Sequence[str], out: str | Path, title: str,
                    base: str = "base") -> Path:
    """Two panels: the rate per arm (strict and lenient bars, Clopper-Pearson intervals over items) and each
    arm's paired difference against ``base`` (item bootstrap intervals), in points.

    Args:
        table: ``table.json`` of a study (its ``arms``: per arm and reading ``rate``, ``lo``, ``hi``, ``n`` and
            ``vs_base`` with ``diff``, ``lo``, ``hi``).
        arms: the arms to draw, in order (the plan's order).
        out: the PNG to write.
        title: :func:`study_figure_title`.
        base: the arm the differences are against (drawn as a zero line, no bar).
    Returns:
        ``out``.
    """
    plt = _pyplot()
    arms = [a for a in arms if a in table["arms"]]
    x = np.arange(len(arms))
    others = [a for a in arms if a != base]
    w = 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(9.0, 1.6 * len(arms) + 4), 4.6))
    for j, reading in enumerate(READINGS):
        cells = [table["arms"][a][reading] for a in arms]
        pts = [100 * c["rate"] for c in cells]
        ax1.bar(x + (j - 0.5) * w, pts, w, color=COLOURS[reading], label=f"{reading} reading",
                yerr=yerr(pts, [100 * c["lo"] for c in cells], [100 * c["hi"] for c in cells]), capsize=3)
        for xi, c, p in zip(x, cells, pts):
            ax1.annotate(f"{c['k']}/{c['n']}", (xi + (j - 0.5) * w, p), textcoords="offset points", xytext=(0, 2),
                         ha="center", fontsize=6.5)
        xo = np.arange(len(others), dtype=float)
        diffs = [table["arms"][a][reading].get("vs_base") or {} for a in others]
        d = [100 * v.get("diff", np.nan) for v in diffs]
        ax2.bar(xo + (j - 0.5) * w, d, w, color=COLOURS[reading], label=f"{reading} reading",
                yerr=yerr(d, [100 * v.get("lo", np.nan) for v in diffs], [100 * v.get("hi", np.nan) for v in diffs]),
                capsize=3)
    ax1.set_ylabel("genuine follow-up, % of items\n(95% Clopper-Pearson)")
    ax2.set_ylabel(f"difference vs {base}, points\n(95% paired item bootstrap)")
    ax2.axhline(0, color="black", lw=0.8)
    for ax, names in ((ax1, arms), (ax2, others)):
        ax.set_xticks(np.arange(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, fontsize=8, frameon=False)
    ax1.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=8.5)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


def patching_figure_title(model: str, adapter: str, n_items: int) -> str:
    """``model · adapter patched into the base · n items · teacher-forced log-likelihood, no labels, no judge``."""
    return (f"{model} · {adapter}'s boundary residual patched into the base · n = {n_items} items · "
            "teacher-forced log-likelihood of its own turns · no labels, no judge, not corrected")


def plot_patching_profile(patching: dict[str, Any], out: str | Path, title: str) -> Path:
    """The fraction of the post-trained model's log-likelihood gain on its own turns that patching its boundary
    residual into the base recovers, per layer, with item-bootstrap 95% intervals; the two best layers marked.

    Args:
        patching: ``post_training/patching.json`` (``by_layer``: layer -> ``fraction``, ``lo``, ``hi``;
            ``best_layers``).
        out: the PNG to write.
        title: :func:`patching_figure_title`.
    Returns:
        ``out``.
    """
    plt = _pyplot()
    layers = sorted(patching["by_layer"], key=int)
    x = [int(r) for r in layers]
    f = [patching["by_layer"][r]["fraction"] for r in layers]
    lo = [patching["by_layer"][r]["lo"] for r in layers]
    hi = [patching["by_layer"][r]["hi"] for r in layers]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ax.errorbar(x, f, yerr=yerr(f, lo, hi), fmt="o-", color=COLOURS["strict"], capsize=3, label="recovered fraction")
    best = [int(r) for r in patching.get("best_layers", [])]
    ax.scatter(best, [patching["by_layer"][str(r)]["fraction"] for r in best], s=140, facecolors="none",
               edgecolors="#c00000", label="two best layers", zorder=3)
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_xticks(x)
    ax.set_xlabel("layer patched (residual entering block r, boundary position only)")
    ax.set_ylabel("share of the post-trained model's\nlog-likelihood gain recovered")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out
