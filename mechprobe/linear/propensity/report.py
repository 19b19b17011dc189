"""Markdown of the propensity probes: headline beside the ceiling, controls, per-layer rows, transfer, cost."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mechprobe.linear.fit import Metric
from mechprobe.linear.propensity.sweep import PropensityReport
from mechprobe.linear.propensity.targets import ItemTargets


def _fmt(m: Metric | dict[str, Any] | None) -> str:
    if m is None:
        return "n/a"
    if isinstance(m, dict):
        m = Metric(m["value"], m["lo"], m["hi"])
    return m.fmt()


def propensity_table(report: PropensityReport, ctrl: Mapping[str, Metric], targets: ItemTargets,
                     transfer: Mapping[str, Any] | None = None, cost: Mapping[str, Any] | None = None) -> str:
    """Markdown: headline beside the split-half ceiling, controls, per-layer rows, transfer and cost."""
    n = report.nested
    best = report.layer(report.best_layer)
    s = targets.summary()
    lines = [f"{s['items']} items ({s['dropped_items']} dropped with < {targets.min_samples} judged samples; "
             f"{s['judge_errors_skipped']} judge-error/unjudged rows skipped), k per item {s['k_per_item']}, "
             f"T = {targets.temperature:g}; mean propensity {s['mean_propensity']:.3f}, "
             f"{s['items_with_any_genuine']} items with any genuine sample; median {report.counts['median_propensity']:.3f}, "
             f"{report.counts['above_median_items']} items above it. {report.counts['folds']}-fold item CV; "
             "95% CIs bootstrap over items.", "",
             "| headline | value [95% CI] |", "|---|---|",
             f"| nested layer choice: Spearman rho (layers {sorted(set(n['fold_layers']))}) | {_fmt(n['rho'])} |",
             f"| **ceiling** sqrt(R): a probe of the true propensity vs the observed one | "
             f"{_fmt(ctrl.get('split_half_ceiling'))} |",
             f"| propensity reliability R (split-half, Spearman-Brown to full k) | "
             f"{_fmt(ctrl.get('split_half_reliability'))} |",
             f"| nested layer choice: AUROC propensity > median (layers {sorted(set(n['fold_layers_auroc']))}) | "
             f"{_fmt(n['above_median_auroc'])} |",
             f"| best layer {best.layer} on the curve (optimistic): rho | {_fmt(best.rho)} |"]
    names = {"shuffled": f"shuffled propensities (layer {best.layer})",
             "shuffled_max": "shuffled propensities, best of all layers",
             "random_direction": f"random directions (layer {best.layer}; 95% over directions)",
             "embedding_layer": "embedding layer (residual 0)",
             "text_ridge": "text-only ridge (TF-IDF + length of prompt + response)",
             "response_length": "response length alone (sign fitted per fold)",
             "length_by_dataset": "response length (rank within dataset), a slope per dataset + dataset offsets, "
                                  "least squares out of fold",
             "probe_beyond_length": "**nested probe beyond length**: partial rho given length, within datasets"}
    lines += [f"| {names[k]}: rho | {_fmt(v)} |" for k, v in ctrl.items() if k in names]
    lines += ["", "| residual | rho [95% CI] | AUROC > median | greedy-label AUROC | shuffled rho | random dirs rho | "
              "alpha per fold |", "|---|---|---|---|---|---|---|"]
    for r in report.per_layer:
        sh = f"{r.shuffled_rho.value:.3f}" if r.shuffled_rho else "n/a"
        rd = f"{r.random_dir_rho.value:.3f}" if r.random_dir_rho else "n/a"
        lines.append(f"| {r.layer} | {_fmt(r.rho)} | {_fmt(r.above_median_auroc)} | {_fmt(r.greedy_auroc)} | {sh} | "
                     f"{rd} | {','.join(f'{a:g}' for a in r.fold_alpha)} |")
    if transfer:
        lines += ["", f"## Transfer (ridge at layer {transfer.get('layer', '?')}; rows: trained on; diagonal: item CV; "
                  "Spearman rho)", "", "| train \\ test | " + " | ".join(transfer["test_cols"]) + " |",
                  "|---" * (len(transfer["test_cols"]) + 1) + "|"]
        for a, row in zip(transfer["train_rows"], transfer["cells"]):
            lines.append(f"| {a} | " + " | ".join(_fmt(c.get("rho")) for c in row) + " |")
    if cost:
        lines += ["", "## Cost per item", ""]
        if cost.get("ratio") is not None:
            j = cost.get("judge_s_per_item")
            lines.append(f"one boundary forward pass {cost['boundary_forward_s_per_item']:.4f} s vs sampling "
                         f"k = {cost['k']:g} turns {cost['sample_s_per_item']:.3f} s"
                         + (f" + judging them {j:.3f} s" if j is not None else "")
                         + f": **{cost['ratio']:.1f}x** cheaper.")
        if cost.get("missing"):
            lines.append(cost["missing"])
    return "\n".join(lines)


def cost_list_md(cost: Sequence[Mapping[str, Any]]) -> str:
    """The cost section for several pooled runs: one line per run."""
    return "\n\n## Cost per item\n\n" + "\n".join(
        f"- {c['run']}: " + (f"{c['ratio']:.1f}x (forward {c['boundary_forward_s_per_item']:.4f} s vs "
                             f"{c['generate_and_judge_s_per_item']:.3f} s)" if c.get("ratio") else c.get("missing", "n/a"))
        for c in cost)


def targets_title(model: str, targets: ItemTargets, judge: str) -> str:
    """The one-line description of the pooled items (also the top line of propensity.md)."""
    tg = targets
    return (f"{model} · {'+'.join(sorted(set(tg.datasets)))} · {len(tg)} items, T={tg.temperature:g}, "
            f"k={'/'.join(map(str, sorted(set(tg.k.tolist()))))} · judge {judge}")


def propensity_md(name: str, why: str, title: str, timings: Mapping[str, Any], analysis_s: float, table: str) -> str:
    """propensity.md: what was probed and why this target, then the tables."""
    md = [f"# Item-level propensity probes: {name}", "", f"target: propensity ({why}).", "",
          f"{title}; stage seconds {json.dumps(dict(timings))}, analysis {analysis_s} s.", "", table]
    return "\n".join(md) + "\n"
