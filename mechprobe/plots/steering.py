"""The steering figure: held-out follow-up and degeneration rates against alpha, one line per vector kind."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mechprobe.plots.extents import yerr  # noqa: E402
from mechprobe.plots.titles import figure_title  # noqa: E402


def steering_title(model: str, judge: str, n_heldout: int, layer: int, positions: str) -> str:
    """The steering figure's title; its rates are the judge's labels as they are (judge only)."""
    return figure_title(model, judge, f"{n_heldout} held-out items", f"layer {layer}", positions)


def plot_steering(rows: Sequence[dict[str, Any]], out: str | Path, title: str,
                  xlabel: str = "alpha (multiplies the raw difference-of-means vector)") -> Path:
    """Held-out rates vs alpha, one line per vector kind: follow-up (left) and degeneration (right), both
    with Wilson 95% CIs. Side by side because a rising follow-up rate only counts where the text still
    reads: the right panel says where it stops reading."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    kinds = sorted({r["kind"] for r in rows})
    span = (max(r["alpha"] for r in rows) - min(r["alpha"] for r in rows)) if rows else 0.0
    pos = sorted({abs(r["alpha"]) for r in rows if r["alpha"]})
    # A geometric ladder (0.05 .. 4) crowds into the left edge on a linear axis: symlog when it spans >= 10x.
    log = len(pos) >= 2 and pos[-1] / pos[0] >= 10
    for i, k in enumerate(kinds):
        rs = sorted((r for r in rows if r["kind"] == k), key=lambda r: r["alpha"])
        # Kinds share alphas (and alpha 0 is one condition): a small horizontal offset keeps each kind's
        # points and CI bars visible instead of drawn over one another.
        off = i - (len(kinds) - 1) / 2
        if log:
            a = [r["alpha"] * (1 + 0.05 * off) if r["alpha"] else 0.05 * off * pos[0] for r in rs]
        else:
            a = [r["alpha"] + off * 0.012 * (span or 1.0) for r in rs]
        f = [r["followup_rate"] for r in rs]
        ax.errorbar(a, f, yerr=yerr(f, [r["ci"][0] for r in rs], [r["ci"][1] for r in rs]),
                    marker="o", capsize=3, color=f"C{i}", label=k)
        d = [r["degenerate_rate"] for r in rs]
        dci = [r.get("degenerate_ci", [x, x]) for r, x in zip(rs, d)]
        ax2.errorbar(a, d, yerr=yerr(d, [c[0] for c in dci], [c[1] for c in dci]),
                     marker="s", ls=":", capsize=3, color=f"C{i}", label=k)
    for axis, ylab in ((ax, "genuine follow-up rate"), (ax2, "degenerate rate")):
        if log:
            ticks = sorted({r["alpha"] for r in rows})
            axis.set_xscale("symlog", linthresh=pos[0])
            axis.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
            axis.minorticks_off()
        axis.set_xlabel(xlabel + (" (symlog)" if log else ""), fontsize=8)
        axis.set_ylabel(f"{ylab} (held-out, greedy)")
        axis.set_ylim(-0.02, 1.02)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
