"""The linear-probe experiment over a run: build or reuse the stages, probe every layer, write probes/ and figures.

Takes a typed :class:`LinearProbeConfig` (the command line builds it in :mod:`mechprobe.cli.linear_probe`) and
returns a :class:`~mechprobe.linear.result.LinearProbeResult` the command prints. The turn target runs here; the
item-level propensity target in :mod:`mechprobe.linear.propensity.driver`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from threadpoolctl import threadpool_limits

from mechprobe.io import write_json
from mechprobe.linear.fit import InsufficientPositives, to_jsonable
from mechprobe.linear.propensity.driver import propensity_experiment
from mechprobe.linear.propensity.load import choose_target
from mechprobe.linear.report import no_fit_md, turn_metrics_md
from mechprobe.linear.result import LinearProbeResult
from mechprobe.linear.turn import (
    LabelledActivations,
    controls,
    directions,
    figures_dir,
    load_labelled_activations,
    modal_c,
    multiclass_confusion,
    results_table,
    sweep_layers,
    transfer_matrix,
)
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.linear import plot_layer_auroc, plot_no_curve
from mechprobe.plots.titles import figure_title
from mechprobe.stages import (
    PASSTHROUGH,
    ensure_stages,
    ensure_transfer_runs,
    finding_preset,
    finding_presets,
    resolve_run,
)
from mechprobe.turns.pipeline import ProbeConfig


@dataclass
class LinearProbeConfig:
    """Every setting of the command, typed (built from the command line by :mod:`mechprobe.cli`)."""

    model: str | None = None  # default: the run's model, else the embedded default model
    dataset: str | None = None  # default: gsm8k when ../shared/data is found, else builtin
    datasets: list[str] = field(default_factory=lambda: [])  # several datasets: one run each (runs/<model>-<dataset>), propensity probes on the pooled i…
    target: str = 'auto'  # propensity: one row per item, target = fraction of its samples at --propensity-temperature…
    propensity_temperature: float = 1.0  # temperature whose samples define the propensity (default 1.0)
    include_truncated: bool = False  # judge summaries keep turns after truncated assistant answers in the rates
    min_samples: int = 2  # propensity target: drop items with fewer judged samples than this (judge errors skipped)
    run: str | None = None  # run directory (default runs/<model>-<dataset>)
    new: bool = False  # --run names a run to build from nothing
    judge: str = 'auto'  # auto (default: the judge of the run's labels; else offline for the embedded default model,…
    layers: str | list[str] = 'all'  # all, or residual indices like 0 6 12 (or 0,6,12; 0 is always added): r = input of block r …
    relabel: bool = False  # labels.jsonl is from another judge (or judge version): move it aside and relabel
    backend: str = 'hooks'
    limit: int | None = None  # items per run (default: 60 for the embedded default model; for other models 200 items in a…
    samples: int | None = None
    temperatures: list[float] | None = None
    max_assistant_tokens: int | None = None
    max_user_tokens: int | None = None
    batch_size: int | None = None
    engine: str | None = None  # generation engine (default hf; llamacpp = CPU over the GGUF, see docs/cpu_speed.md)
    dtype: str | None = None  # HF weights dtype for generation and caching (default: fp32 on CPU, bf16 on CUDA)
    folds: int = 5
    n_boot: int = 1000  # item-bootstrap draws for the 95%% CIs
    no_shuffled: bool = False  # skip the shuffled-label probe (halves probe time)
    seed: int = 0
    transfer_datasets: list[str] = field(default_factory=lambda: [])  # also build runs of these datasets with the same config and report a transfer matrix
    transfer_runs: list[str] = field(default_factory=lambda: [])  # existing runs (same model) for the transfer matrix
    figures: str | None = None  # folder for the figure (default: <run>/figures, inside the ignored run directory, so a run …

    @classmethod
    def from_namespace(cls, a: Any) -> LinearProbeConfig:
        """Keep only this config's fields of an argparse namespace (the CLI adds its own keys)."""
        return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)})


def _transfer(a: LinearProbeConfig, run: Path, cfg: ProbeConfig, data: LabelledActivations, layer: int
             ) -> dict[str, Any] | None:
    """Stack this run with the transfer runs (same model) at one layer and train-on-A / test-on-B.

    ``--transfer-datasets`` runs use this run's probe config with only the dataset changed, and live
    beside it (``<parent>/<model>-<dataset>``), so their labels mean the same thing.
    """

    runs = ensure_transfer_runs(a.transfer_runs, a.transfer_datasets, run, cfg, a.judge, a.backend, a.relabel,
                                a.include_truncated)
    if not runs:
        return None
    xs, ys, gs, ds = [data.stack[:, data.layers.index(layer)]], [data.y], [data.groups], [data.datasets]
    for r in runs:
        other = load_labelled_activations(r, str(layer))
        if other.meta["identity"]["weight_hash"] != data.meta["identity"]["weight_hash"]:
            raise ValueError(f"{r} was cached from another model; transfer needs one model")
        xs.append(other.stack[:, other.layers.index(layer)])
        ys.append(other.y)
        gs.append(other.groups)
        ds.append(other.datasets)
    tm = transfer_matrix(np.concatenate(xs).astype(np.float64), np.concatenate(ys), np.concatenate(ds).tolist(),
                         np.concatenate(gs), n_splits=a.folds, seed=a.seed, n_boot=a.n_boot)
    return {**tm, "layer": layer, "runs": [str(run), *map(str, runs)]}


def run_linear_probe(a: LinearProbeConfig) -> LinearProbeResult:
    """probe -> judge -> cache (reused when complete), then the probes; exit code 3 when the run is too small to fit."""

    t0 = time.time()

    datasets = list(getattr(a, "datasets", None) or [])
    over = {k: getattr(a, k) for k in PASSTHROUGH}
    preset = finding_preset(a.model)
    presets = [preset] * max(1, len(datasets))
    if preset is not None:
        presets = finding_presets(preset, datasets, a.limit)
        print(f"new runs of {a.model} (not the embedded default) use the finding settings: "
              f"{preset['samples']} samples at T=1, caps {preset['max_assistant_tokens']}/{preset['max_user_tokens']} "
              f"tokens, engine {preset['engine']}{', ' + preset['dtype'] if preset.get('dtype') else ''}, items "
              f"{' + '.join(str(p['limit'] if a.limit is None else a.limit) for p in presets)}; existing runs keep their "
              "own, options override")
    new = bool(a.new) or a.run is None
    resolved = [resolve_run(a.run, a.model, ds, preset=pr, new=new, **over)
                for ds, pr in zip(datasets or [a.dataset], presets, strict=True)]

    picks = [choose_target(getattr(a, "target", "turn"), c.samples, c.temperatures,
                           getattr(a, "propensity_temperature", 1.0)) for _, c in resolved]
    target, why = next((p for p in picks if p[0] == "turn"), picks[0])  # every run must support propensity
    print(f"target: {target} ({why})")
    if target == "propensity":
        return propensity_experiment(a, resolved, why, t0)
    if len(resolved) > 1:
        a.transfer_datasets = [*a.transfer_datasets, *[c.dataset for _, c in resolved[1:]]]
        print(f"turn target with several datasets: probing {resolved[0][1].dataset}, transfer to "
              f"{a.transfer_datasets}")
    run, cfg = resolved[0]
    timings, judge_name = ensure_stages(run, cfg, a.judge, a.backend, a.relabel,
                                        include_truncated=a.include_truncated)

    t_an = time.time()
    # Small dense problems (hundreds of rows): one BLAS thread is as fast, and multi-threaded BLAS on a
    # busy 2-core machine was measured ~10x slower (threads spinning against other processes).
    with threadpool_limits(limits=1):
        return _analyse(a, run, cfg, timings, judge_name, t0, t_an)


def label_counts(data: LabelledActivations) -> dict[str, int]:
    """What a turn-level fit rests on: rows and items of each class, and the rows no label could be used for."""
    y, groups = data.y, data.groups
    counts = {"genuine rows": int(y.sum()), "not genuine rows": int(len(y) - y.sum()),
              "items": int(len(set(groups))), "items with a genuine row": int(len(set(groups[y == 1]))),
              "unlabelled or judge-error rows": int(data.n_unlabelled)}
    counts.update({f"label {k}": int(n) for k, n in sorted(Counter(data.labels).items())})
    return counts


def _no_fit(out_dir: Path, fig_path: Path, base: dict[str, Any], counts: dict[str, int], reason: str,
            title: str, t0: float) -> LinearProbeResult:
    """Too few positives to fit: metrics.json/.md with the label counts and the reason, a figure saying why."""
    write_json(out_dir / "metrics.json", {**base, "status": "insufficient_positives", "reason": reason,
                                          "label_counts": counts, "total_seconds": round(time.time() - t0, 1)})
    (out_dir / "metrics.md").write_text(no_fit_md(Path(base["run"]).name, title, counts, reason))
    fig, failed = draw_figure(fig_path, lambda: plot_no_curve(counts, reason, fig_path, title))
    msg = (f"\nNot reporting probe metrics: {reason}\n(wrote {out_dir}/metrics.json and metrics.md with the label "
           f"counts and the reason{f', and {fig}' if fig else ''}; everything computed so far is kept: the run's "
           "turns, labels and activations are reused when you re-run)" + (f"\nmechprobe: error: {failed}" if failed else ""))
    return LinearProbeResult("insufficient_positives", out_dir, fig, message=msg, exit_code=3)


def _save_directions(out_dir: Path, data: LabelledActivations, report: Any, cfg: ProbeConfig, run: Path, judge_name: str,
                     seed: int) -> None:
    """directions.safetensors/.json: each layer's probe and difference-of-means directions, for steering."""
    y = data.y
    tensors, dmeta = directions(data.stack, data.layers, y, data.groups, cs=modal_c(report), seed=seed)
    dir_meta = {"layers": data.layers, "model": cfg.model, "weight_hash": data.meta["identity"]["weight_hash"],
                "n_pos": int(y.sum()), "n_neg": int(len(y) - y.sum()), "position": "boundary",
                "layer_convention": "residual index: 0 = embeddings, r = output of block r-1",
                "probe": "StandardScaler+LogisticRegression(class_weight=balanced) coef / scaler.scale_ "
                         "(residual coordinates), fitted on all labelled rows",
                "diff_means": "mean(genuine) - mean(not genuine), raw residual units",
                "per_layer": dmeta, "source_run": str(run), "judge": judge_name}
    save_file(tensors, str(out_dir / "directions.safetensors"),
              metadata={"model": cfg.model, "weight_hash": dir_meta["weight_hash"], "n_pos": str(dir_meta["n_pos"]),
                        "n_neg": str(dir_meta["n_neg"]), "position": "boundary"})
    write_json(out_dir / "directions.json", dir_meta)


def _analyse(a: LinearProbeConfig, run: Path, cfg: ProbeConfig, timings: dict[str, float], judge_name: str,
             t0: float, t_an: float) -> LinearProbeResult:
    """Everything after the stages: probes, controls, extras, files, figure."""

    data = load_labelled_activations(run, a.layers)
    y, groups = data.y, data.groups
    out_dir = run / "probes"
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {"run": str(run), "model": cfg.model, "dataset": cfg.dataset, "judge": judge_name,
            "n_rows": int(len(y)), "n_positive": int(y.sum()), "n_items": int(len(set(groups))),
            "n_unlabelled_or_judge_error": data.n_unlabelled, "layers": data.layers, "folds": a.folds,
            "stage_seconds": timings}
    fig_path = figures_dir(a.figures, run) / f"linear_probe_{run.name}.png"
    title = figure_title(cfg.model, judge_name, f"{len(y)} turns ({int(y.sum())} genuine, "
                                                f"{len(set(groups))} items)", cfg.dataset)
    try:
        report = sweep_layers(data.stack, data.layers, y, groups, data.greedy, n_splits=a.folds, seed=a.seed,
                              n_boot=a.n_boot, shuffled=not a.no_shuffled)
    except InsufficientPositives as e:
        return _no_fit(out_dir, fig_path, base, label_counts(data), str(e), title, t0)
    ctrl = controls(report, y, groups, data.texts, seed=a.seed, n_boot=a.n_boot)
    best = report.best_layer
    bi = data.layers.index(best)
    mc = {**multiclass_confusion(data.stack[:, bi].astype(np.float64), data.labels, groups, report.folds, a.seed),
          "layer": best}
    tm = _transfer(a, run, cfg, data, best)
    _save_directions(out_dir, data, report, cfg, run, judge_name, a.seed)
    analysis_s = round(time.time() - t_an, 1)
    metrics = {**base, "status": "ok", **report.to_dict(), "controls": to_jsonable(ctrl),
               "multiclass_best_layer": mc, "transfer": tm, "analysis_seconds": analysis_s,
               "total_seconds": round(time.time() - t0, 1)}
    write_json(out_dir / "metrics.json", metrics)
    md = turn_metrics_md(run.name, cfg.model, cfg.dataset, judge_name, timings, analysis_s,
                         results_table(report, ctrl), best, mc, tm)
    (out_dir / "metrics.md").write_text("\n".join(md) + "\n")
    n = report.nested
    # The figure is the last thing written: a plotting failure costs the picture, never the files above.
    fig, failed = draw_figure(fig_path, lambda: plot_layer_auroc(report, ctrl, fig_path, title, confusion=mc))
    summary = "\n".join([
        "\n" + "\n".join(md[4:]),
        f"\nheadline: nested layer selection AUROC {n['auroc'].fmt()} (fold layers {n['fold_layers']}); "
        f"best layer on the curve {best}: {report.layer(best).logreg_auroc.fmt()}",
        "controls: " + "; ".join(f"{k} {v.fmt()}" for k, v in ctrl.items()),
        f"\nwrote {out_dir}/metrics.json, metrics.md, directions.safetensors, directions.json"
        + (f" and {fig}" if fig else ""),
        json.dumps({"stage_seconds": timings, "analysis_seconds": analysis_s,
                    "total_seconds": metrics["total_seconds"]})])
    if failed:
        return LinearProbeResult("ok", out_dir, None, summary=summary, message=f"mechprobe: error: {failed}",
                                 exit_code=1)
    return LinearProbeResult("ok", out_dir, fig, summary=summary)
