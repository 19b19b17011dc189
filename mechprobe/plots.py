"""Figures people look at (matplotlib, Agg backend, written to ``figures/``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_layer_auroc(results: Sequence[Any], ctrl: dict[str, Any], out: str | Path, title: str) -> Path:
    """AUROC by residual index with 95% CI bands; controls as dashed lines; embedding layer marked."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    layers = [r.layer for r in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for attr, name, color in (("logreg_auroc", "logistic probe", "C0"), ("dom_auroc", "diff-of-means", "C1")):
        v = [getattr(r, attr).value for r in results]
        lo = [getattr(r, attr).lo for r in results]
        hi = [getattr(r, attr).hi for r in results]
        ax.plot(layers, v, color=color, marker="o", ms=3, label=name)
        ax.fill_between(layers, lo, hi, color=color, alpha=0.2)
    styles = {"shuffled_labels": ("C3", "shuffled labels"), "random_direction": ("C7", "random direction"),
              "text_baseline": ("C2", "text-only baseline")}
    for k, m in ctrl.items():
        c, name = styles.get(k, ("k", k))
        ax.axhline(m.value, color=c, ls="--", lw=1, label=f"{name} ({m.value:.2f})")
        ax.axhspan(m.lo, m.hi, color=c, alpha=0.07)
    if 0 in layers:
        ax.annotate("embeddings", (0, results[layers.index(0)].logreg_auroc.value), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.axhline(0.5, color="k", lw=0.5)
    ax.set_xlabel("residual index (0 = embeddings, r = after block r)")
    ax.set_ylabel("AUROC (grouped CV, 95% CI)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0.2, 1.0)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_steering(rows: Sequence[dict[str, Any]], out: str | Path, title: str) -> Path:
    """Follow-up rate (Wilson 95% CI) vs alpha, one line per vector kind; degeneration rate dotted."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    kinds = sorted({r["kind"] for r in rows})
    for i, k in enumerate(kinds):
        rs = sorted((r for r in rows if r["kind"] == k), key=lambda r: r["alpha"])
        a = [r["alpha"] for r in rs]
        ax.errorbar(a, [r["followup_rate"] for r in rs],
                    yerr=[[r["followup_rate"] - r["ci"][0] for r in rs], [r["ci"][1] - r["followup_rate"] for r in rs]],
                    marker="o", capsize=3, color=f"C{i}", label=f"{k}: genuine follow-up")
        ax.plot(a, [r["degenerate_rate"] for r in rs], ls=":", color=f"C{i}", label=f"{k}: degenerate")
    ax.set_xlabel("alpha (multiplies the raw difference-of-means vector)")
    ax.set_ylabel("rate (held-out items, greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
