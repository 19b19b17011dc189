"""The propensity target of ``probes``: build or reuse every run's stages, then the item-level probes on the pooled
items, writing ``probes/propensity.{json,md}`` and a figure."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from mechprobe.io import write_json
from mechprobe.linear.fit import to_jsonable
from mechprobe.linear.propensity.controls import propensity_controls
from mechprobe.linear.propensity.cost import run_cost
from mechprobe.linear.propensity.fit import InsufficientItems
from mechprobe.linear.propensity.load import load_item_states, run_datasets
from mechprobe.linear.propensity.report import cost_list_md, propensity_md, propensity_table, targets_title
from mechprobe.linear.propensity.sweep import propensity_sweep_layers
from mechprobe.linear.propensity.targets import ItemTargets
from mechprobe.linear.propensity.transfer import modal_layer, propensity_transfer
from mechprobe.linear.result import LinearProbeResult
from mechprobe.linear.turn import figures_dir
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.linear import plot_no_curve, plot_propensity
from mechprobe.plots.titles import figure_title
from mechprobe.stages import ensure_stages, ensure_transfer_runs
from mechprobe.turns.pipeline import ProbeConfig


def propensity_experiment(a: Any, resolved: list[tuple[Path, ProbeConfig]], why: str, t0: float) -> LinearProbeResult:
    """Build or reuse every run's stages, then the item-level propensity probes on the pooled items.

    One run: outputs in ``<run>/probes/``. Several (``--datasets``): in ``<parent>/<model>-<a>+<b>/probes/``
    (not a run directory: it holds only the pooled analysis). ``--transfer-runs``/``--transfer-datasets``
    join the transfer matrix only, not the pooled headline. ``a`` is the
    :class:`~mechprobe.linear.experiment.LinearProbeConfig`.
    """
    timings: dict[str, Any] = {}
    judges = []
    for run, cfg in resolved:
        t, j = ensure_stages(run, cfg, a.judge, a.backend, a.relabel, include_truncated=a.include_truncated)
        timings[run.name] = t
        judges.append(j)
    run0, cfg0 = resolved[0]
    extra = ensure_transfer_runs(a.transfer_runs, a.transfer_datasets, run0, cfg0, a.judge, a.backend, a.relabel,
                                 a.include_truncated)
    if len(resolved) == 1:
        base = run0
    else:
        base = run0.parent / f"{Path(cfg0.model).name.replace('.gguf', '')}-{'+'.join(c.dataset for _, c in resolved)}"
    fig = figures_dir(a.figures, base) / f"propensity_{base.name}.png"
    with threadpool_limits(limits=1):
        return run_propensity(a, [r for r, _ in resolved], cfg0.model, why, timings, "+".join(sorted(set(judges))),
                              extra, base / "probes", fig, t0)


def _fig_title(model: str, tg: ItemTargets, judge: str) -> str:
    return figure_title(model, judge, f"{len(tg)} items", "+".join(sorted(set(tg.datasets))),
                        f"T={tg.temperature:g}, k={'/'.join(map(str, sorted(set(tg.k.tolist()))))}")


def _no_fit(out_dir: Path, fig_path: Path, base: dict[str, Any], tg: ItemTargets, reason: str, title: str,
            t0: float) -> LinearProbeResult:
    """Too few items (or no spread) to fit: propensity.json with the counts and reason, a figure saying why."""
    write_json(out_dir / "propensity.json", {**base, "status": "insufficient_items", "reason": reason,
                                             "total_seconds": round(time.time() - t0, 1)})
    s = tg.summary()
    counts = {"items": s["items"], f"items dropped (< {tg.min_samples} judged samples)": s["dropped_items"],
              "items with any genuine sample": s["items_with_any_genuine"],
              "judge-error or unjudged rows": s["judge_errors_skipped"], "greedy turns judged": s["greedy_judged"],
              "greedy turns genuine": s["greedy_genuine"]}
    fig, failed = draw_figure(fig_path, lambda: plot_no_curve(counts, reason, fig_path, title))
    msg = (f"\nNot reporting propensity metrics: {reason}\n(wrote {out_dir}/propensity.json with the counts and the "
           f"reason{f', and {fig}' if fig else ''}; everything computed so far is kept: the runs' turns, labels and "
           "activations are reused when you re-run)" + (f"\nmechprobe: error: {failed}" if failed else ""))
    return LinearProbeResult("insufficient_items", out_dir, fig, message=msg, exit_code=3)


def _transfer(a: Any, data: Any, runs: Sequence[Path], transfer_runs: Sequence[Path], layer: int
              ) -> dict[str, Any] | None:
    """The cross-dataset matrix at ``layer`` when the pooled (or transfer) items span several datasets."""
    tg = data.targets
    if not (transfer_runs or len(set(tg.datasets)) > 1):
        return None
    pool = data if not transfer_runs else load_item_states([*runs, *transfer_runs], str(layer),
                                                           a.propensity_temperature, a.min_samples)
    li = pool.layers.index(layer)
    if len(set(pool.targets.datasets)) <= 1:
        return None
    return {**propensity_transfer(pool.stack[:, li], pool.targets, a.folds, a.seed, a.n_boot), "layer": layer,
            "runs": pool.runs}


def run_propensity(a: Any, runs: Sequence[Path], model: str, why: str, timings: Mapping[str, Any], judge: str,
                   transfer_runs: Sequence[Path], out_dir: Path, fig_path: Path, t0: float) -> LinearProbeResult:
    """Item-level propensity probes on ``runs`` (pooled), writing ``out_dir/propensity.{json,md}`` and a figure.

    Exit code 0, or 3 (with ``status: insufficient_items``, the counts and the reason in the JSON, and a
    figure saying why) when the items cannot support item-level CV.
    """
    t_an = time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_item_states(runs, a.layers, a.propensity_temperature, a.min_samples)
    tg = data.targets
    base = {"target": "propensity", "why": why, "runs": data.runs, "model": model, "judge": judge,
            "temperature": tg.temperature, "targets": tg.summary(), "layers": data.layers, "folds": a.folds,
            "stage_seconds": dict(timings), "dropped_items": tg.dropped}
    try:
        report = propensity_sweep_layers(data.stack, data.layers, tg, n_splits=a.folds, seed=a.seed,
                                         n_boot=a.n_boot, shuffled=not a.no_shuffled)
    except InsufficientItems as e:
        return _no_fit(out_dir, fig_path, base, tg, str(e), _fig_title(model, tg, judge), t0)
    ctrl = propensity_controls(report, data.stack, tg, data.texts, data.response_tokens, seed=a.seed,
                               n_boot=a.n_boot)
    tm = _transfer(a, data, runs, transfer_runs, modal_layer(report.nested["fold_layers"]))
    cost = [run_cost(Path(r), float(np.mean(tg.k[[d == ds for d in tg.datasets]])))
            for r, ds in zip(runs, run_datasets(runs))]
    analysis_s = round(time.time() - t_an, 1)
    res = {**base, "status": "ok", **report.to_dict(), "controls": to_jsonable(ctrl), "transfer": tm,
           "cost": cost, "analysis_seconds": analysis_s, "total_seconds": round(time.time() - t0, 1)}
    write_json(out_dir / "propensity.json", to_jsonable(res))
    table = propensity_table(report, ctrl, tg, tm, cost[0] if len(cost) == 1 else None)
    if len(cost) > 1:
        table += cost_list_md(cost)
    (out_dir / "propensity.md").write_text(propensity_md(out_dir.parent.name, why, targets_title(model, tg, judge),
                                                         timings, analysis_s, table))
    # The figure is the last thing written: a plotting failure costs the picture, never the files above.
    fig, failed = draw_figure(fig_path, lambda: plot_propensity(report, ctrl, fig_path, _fig_title(model, tg, judge)))
    n = report.nested
    summary = "\n".join([
        "\n" + table,
        f"\nheadline: nested layer choice Spearman rho {n['rho'].fmt()} (fold layers {n['fold_layers']}) vs "
        f"ceiling sqrt(R) {ctrl['split_half_ceiling'].fmt()} (propensity reliability R "
        f"{ctrl['split_half_reliability'].fmt()})",
        f"wrote {out_dir}/propensity.json, propensity.md" + (f" and {fig}" if fig else "")])
    if failed:
        return LinearProbeResult("ok", out_dir, None, summary=summary, message=f"mechprobe: error: {failed}",
                                 exit_code=1)
    return LinearProbeResult("ok", out_dir, fig, summary=summary)
