"""Linear-probe figures: AUROC (turn target) or Spearman rho (propensity target) by residual index, with every
control; and, when a run is too small to fit, a figure of its label counts saying why there is no curve."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mechprobe.plots.extents import yerr  # noqa: E402


def _band(ax: Any, res: Sequence[Any], attr: str, color: str, name: str, ls: str = "-", marker: str | None = "o",
          alpha: float = 0.2) -> None:
    """A per-layer metric (``.value``, ``.lo``, ``.hi``) as a line with its CI band; skipped when any is missing."""
    ms = [getattr(r, attr) for r in res]
    if any(m is None for m in ms):
        return
    layers = [r.layer for r in res]
    ax.plot(layers, [m.value for m in ms], color=color, ls=ls, marker=marker, ms=3, label=name)
    ax.fill_between(layers, [m.lo for m in ms], [m.hi for m in ms], color=color, alpha=alpha, lw=0)


def plot_layer_auroc(report: Any, ctrl: dict[str, Any], out: str | Path, title: str,
                     confusion: dict[str, Any] | None = None) -> Path:
    """AUROC by residual index with 95% CI bands and every control; optional confusion-matrix panel.

    Reading guide: the probe curve must clear the shuffled-label curve and the random-direction band
    at the same layer, *and* the text-only line, to say the state holds more than the text did; the
    item ceiling is the most any function of the boundary state could reach.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = report.per_layer
    layers = [r.layer for r in res]
    if confusion:
        fig, (ax, axc) = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [1.9, 1]})
    else:
        fig, ax = plt.subplots(figsize=(9, 6))

    def band(attr: str, color: str, name: str, ls: str = "-", marker: str | None = "o", alpha: float = 0.2) -> None:
        _band(ax, res, attr, color, name, ls, marker, alpha)

    band("logreg_auroc", "C0", "logistic probe")
    band("dom_auroc", "C1", "diff-of-means projection", alpha=0.0)
    band("shuffled_auroc", "C3", "probe, labels shuffled between items", ls="--", marker=None, alpha=0.07)
    band("random_dir_auroc", "C7", "random directions (95% over directions)", ls=":", marker=None, alpha=0.25)
    if all(r.greedy_auroc is not None for r in res):
        ax.plot(layers, [r.greedy_auroc.value for r in res], color="C4", ls="-.", lw=1,
                label="probe scored on greedy turns only")
    for key, color, name in (("text_baseline", "C2", "text-only baseline"), ("item_ceiling", "k", "item ceiling")):
        m = ctrl.get(key)
        if m is not None and np.isfinite(m.value):
            ax.axhline(m.value, color=color, ls="--" if key == "text_baseline" else ":", lw=1.2,
                       label=f"{name} {m.value:.2f} [{m.lo:.2f}, {m.hi:.2f}]")
            if key == "text_baseline":
                ax.axhspan(m.lo, m.hi, color=color, alpha=0.08)
    if 0 in layers:
        m0 = res[layers.index(0)].logreg_auroc
        ax.plot([0], [m0.value], marker="*", ms=12, color="C9", ls="none", label=f"embedding layer {m0.value:.2f}")
    n = report.nested
    ax.errorbar([layers[-1] + 0.6], [n["auroc"].value], yerr=yerr([n["auroc"].value], [n["auroc"].lo], [n["auroc"].hi]),
                fmt="D", color="C0", capsize=3, label=f"nested layer choice {n['auroc'].fmt()}")
    ax.axhline(0.5, color="k", lw=0.5)
    ax.set_xlabel("residual index r (0 = embeddings; r = input of block r = output of block r-1)")
    ax.set_ylabel("AUROC, item-grouped CV (95% CI, item bootstrap)")
    ax.set_title(title, fontsize=9)
    lo = min(0.3, *(r.logreg_auroc.lo for r in res))
    ax.set_ylim(max(0.0, lo - 0.02), 1.0)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
    if confusion:
        cm = np.asarray(confusion["confusion"], float)
        norm = cm / np.maximum(cm.sum(1, keepdims=True), 1)
        axc.imshow(norm, cmap="Blues", vmin=0, vmax=1)
        names = [f"{lab} ({s})" for lab, s in zip(confusion["labels"], confusion["support"])]
        axc.set_xticks(range(len(names)), [lab[:12] for lab in confusion["labels"]], rotation=60, ha="right",
                       fontsize=7)
        axc.set_yticks(range(len(names)), names, fontsize=7)
        for i in range(len(cm)):
            for j in range(len(cm)):
                if cm[i, j]:
                    axc.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=6,
                             color="white" if norm[i, j] > 0.5 else "black")
        axc.set_xlabel("predicted (out of fold)")
        axc.set_title(f"multi-class probe, layer {confusion.get('layer', '?')}: balanced acc "
                      f"{confusion['balanced_accuracy']:.2f} (chance {confusion['chance_balanced_accuracy']:.2f})",
                      fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_propensity(report: Any, ctrl: dict[str, Any], out: str | Path, title: str) -> Path:
    """Spearman rho (ridge probe vs held-out item propensity) by residual index, with its ceiling and nulls.

    Reading guide: the curve (95% item-bootstrap band) must clear the shuffled band at the same layer and
    the best-of-layers shuffled band (the null for picking the best layer), and the text-only line, to
    say the state predicts more than the text; the split-half ceiling (dashed, with its CI) is the most
    any predictor of a k-sample propensity could reach.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = report.per_layer
    layers = [r.layer for r in res]
    fig, ax = plt.subplots(figsize=(9, 6))

    def band(attr: str, color: str, name: str, ls: str = "-", marker: str | None = "o", alpha: float = 0.2) -> None:
        _band(ax, res, attr, color, name, ls, marker, alpha)

    band("rho", "C0", "ridge probe (Spearman rho vs held-out propensity)")
    band("shuffled_rho", "C3", "probe, propensities shuffled between items", ls="--", marker=None, alpha=0.08)
    band("random_dir_rho", "C7", "random directions (95% over directions)", ls=":", marker=None, alpha=0.25)
    for key, color, ls, name in (("split_half_ceiling", "k", "--", "ceiling sqrt(split-half R)"),
                                 ("shuffled_max", "C3", ":", "shuffled, best of all layers"),
                                 ("text_ridge", "C2", "-.", "text-only ridge"),
                                 ("response_length", "C5", ":", "response length")):
        m = ctrl.get(key)
        if m is not None and np.isfinite(m.value):
            ax.axhline(m.value, color=color, ls=ls, lw=1.2, label=f"{name} {m.value:.2f} [{m.lo:.2f}, {m.hi:.2f}]")
            if key in ("split_half_ceiling", "shuffled_max") and np.isfinite(m.lo):
                ax.axhspan(m.lo, m.hi, color=color, alpha=0.07)
    n = report.nested["rho"]
    if np.isfinite(n.value):
        ax.errorbar([layers[-1] + 0.6], [n.value], yerr=yerr([n.value], [n.lo], [n.hi]), fmt="D", color="C0",
                    capsize=3, label=f"nested layer choice {n.fmt()}")
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xlabel("residual index r (0 = embeddings; r = input of block r = output of block r-1)")
    ax.set_ylabel("Spearman rho, item-level CV (95% CI, item bootstrap)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(-1.0, 1.0)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_no_curve(counts: Mapping[str, int], reason: str, out: str | Path, title: str) -> Path:
    """A figure for a run too small to fit: its label counts as bars, and why no curve was drawn.

    Why a figure at all: whoever opens the figures folder after a run should find what happened there, not
    an empty folder or last run's curve; the counts say how far the run is from enough.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5))
    names, values = list(counts), [int(v) for v in counts.values()]
    bars = ax.barh(range(len(names)), values, color="C7")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    for b, v in zip(bars, values):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v}", va="center", fontsize=8)
    ax.set_xlabel("count")
    ax.set_title(title, fontsize=9)
    fig.text(0.5, 0.01, "No curve: " + textwrap.fill(reason, 120), ha="center", va="bottom", fontsize=8,
             color="C3", wrap=True)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
