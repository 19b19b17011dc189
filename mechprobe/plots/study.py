"""The study's figures, drawn from plain data (:class:`StudyPlotData`: rates per model, dataset, temperature and
variant), so this module never reads a run.

Every title names the model(s), the judge, n (judged user turns, or items where the panel counts items) and
that the rates are judge only (the study has no audit correction). Accuracy and follow-up rates never share an
axis: the accuracy figure has one panel for each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.plots.extents import yerr
from mechprobe.stats import Rate

FIGURES = ("accuracy", "temperature", "perturbations", "profiles", "human")


@dataclass
class StudyPlotData:
    """What the five study figures show.

    ``keys`` are the (model, dataset) runs in table order; the per-key lists follow it."""

    judge: str  # the judge (or judges) whose labels every rate counts
    models: list[str]
    t_ref: float  # the sampled temperature of the accuracy, perturbation and human figures
    keys: list[tuple[str, str]] = field(default_factory=list)
    accuracy: list[Rate] = field(default_factory=list)
    greedy: list[Rate] = field(default_factory=list)
    sampled: list[Rate] = field(default_factory=list)
    # model -> (temperatures, follow-up rate per temperature, degeneration rate per temperature)
    temperature: dict[str, tuple[list[float], list[Rate], list[Rate]]] = field(default_factory=dict)
    variants: list[str] = field(default_factory=list)  # "full" first, then the perturbations
    perturbations: dict[str, list[Rate]] = field(default_factory=dict)  # model -> sampled rate per variant
    labels: list[str] = field(default_factory=list)
    profiles: list[dict[str, float]] = field(default_factory=list)  # per key: label -> share
    profile_n: list[int] = field(default_factory=list)  # per key: judged turns
    human_datasets: list[str] = field(default_factory=list)
    human: list[tuple[str, list[Rate]]] = field(default_factory=list)  # series name -> rate per human dataset


def _pyplot() -> Any:
    import matplotlib  # lazy: module otherwise light; pyplot loads when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: module otherwise light; pyplot loads when a figure is drawn

    return plt


def _yerr(rs: Sequence[Rate]) -> Any:
    """Clipped extents of each rate's Wilson interval; no bar for a rate of nothing (n = 0, drawn at 0)."""
    if not rs:
        return None
    return yerr([r.p if r.n else 0.0 for r in rs], [r.ci[0] if r.n else 0.0 for r in rs],
                [r.ci[1] if r.n else 0.0 for r in rs])


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})


def _title(d: StudyPlotData, what: str, n: str) -> str:
    return f"{what}\nmodels: {', '.join(d.models)}; judge {d.judge}; {n}; judge only (no audit correction)"


def _n(rs: Sequence[Rate]) -> int:
    return sum(r.n for r in rs)


def _legend_right(ax: Any, fontsize: int = 7) -> None:
    """Outside the axes, on the right: a legend never covers a bar or a point."""
    ax.legend(fontsize=fontsize, bbox_to_anchor=(1.01, 1), loc="upper left")


def plot_accuracy(d: StudyPlotData, path: Path) -> Path:
    """Two panels, one per quantity: task accuracy (items) and the greedy / T_REF follow-up rates (turns)."""
    plt = _pyplot()
    keys = d.keys
    fig, (ax_acc, ax_f) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(keys) + 4), 4.2),
                                       gridspec_kw={"width_ratios": [1, 2]})
    ticks = [f"{m}\n{ds}" for m, ds in keys]
    ax_acc.bar(range(len(keys)), [r.p if r.n else 0 for r in d.accuracy], 0.6, yerr=_yerr(d.accuracy), capsize=2,
               color="tab:gray")
    ax_acc.set_xticks(range(len(keys)), ticks, rotation=30, ha="right", fontsize=7)
    ax_acc.set_ylabel("task accuracy (scored items)")
    ax_acc.set_ylim(0, 1)
    ax_acc.set_title(f"accuracy, n={_n(d.accuracy)} scored items", fontsize=8)
    for j, (lab, rs) in enumerate((("greedy", d.greedy), (f"T={d.t_ref:g}", d.sampled))):
        ax_f.bar([i + 0.4 * (j - 0.5) for i in range(len(keys))], [r.p if r.n else 0 for r in rs], 0.4, label=lab,
                 yerr=_yerr(rs), capsize=2)
    ax_f.set_xticks(range(len(keys)), ticks, rotation=30, ha="right", fontsize=7)
    ax_f.set_ylabel("genuine follow-up rate (judged user turns)")
    ax_f.set_ylim(0, 1)
    ax_f.set_title(f"follow-up, n={_n(d.greedy)} greedy + {_n(d.sampled)} sampled turns", fontsize=8)
    _legend_right(ax_f, 8)
    fig.suptitle(_title(d, "Accuracy vs awareness (95% Wilson CIs)",
                        f"n={_n(d.greedy) + _n(d.sampled)} judged turns"), fontsize=8, y=1.05)
    _save(fig, path)
    plt.close(fig)
    return path


def plot_temperature(d: StudyPlotData, path: Path) -> Path:
    """Follow-up (solid) and degeneration (dashed) rates against temperature, one colour per model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    n = 0
    for m, (temps, follow, degen) in d.temperature.items():
        n += _n(follow)
        for lab, rs, style in (("follow-up", follow, "-o"), ("degenerate", degen, "--x")):
            ax.errorbar(temps, [r.p for r in rs], yerr=_yerr(rs), fmt=style, capsize=2, label=f"{m} {lab}")
    ax.set_xlabel("temperature (0 = greedy)")
    ax.set_ylabel("share of judged user turns")
    ax.set_ylim(0, 1)
    _legend_right(ax, 6)
    ax.set_title(_title(d, "Follow-up and degeneration vs temperature (95% CIs)", f"n={n} judged turns"), fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return path


def plot_perturbations(d: StudyPlotData, path: Path) -> Path:
    """Sampled (T_REF) follow-up rate per perturbation next to the unperturbed conversation, per model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    w = 0.8 / max(1, len(d.models))
    n = 0
    for j, m in enumerate(d.models):
        rs = d.perturbations.get(m, [])
        n += _n(rs)
        ax.bar([i + w * j for i in range(len(rs))], [r.p if r.n else 0 for r in rs], w, label=m, yerr=_yerr(rs),
               capsize=2)
    ax.set_xticks([i + w * (len(d.models) - 1) / 2 for i in range(len(d.variants))], d.variants, rotation=20,
                  fontsize=8)
    ax.set_ylabel(f"follow-up rate, T={d.t_ref:g}")
    ax.set_ylim(0, 1)
    _legend_right(ax)
    ax.set_title(_title(d, f"Perturbations: sampled T={d.t_ref:g} follow-up (95% Wilson CIs)",
                        f"n={n} judged turns"), fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return path


def plot_profiles(d: StudyPlotData, path: Path) -> Path:
    """Stacked share of each label per model and dataset."""
    plt = _pyplot()
    keys = d.keys
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(keys)), 4.5))
    bottom = [0.0] * len(keys)
    for lab in d.labels:
        vals = [p.get(lab, 0.0) for p in d.profiles]
        ax.bar(range(len(keys)), vals, bottom=bottom, label=lab)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(keys)), [f"{m}\n{ds}\nn={n}" for (m, ds), n in zip(keys, d.profile_n)], rotation=30,
                  ha="right", fontsize=7)
    ax.set_ylabel("share of judged user turns")
    _legend_right(ax, 6)
    ax.set_title(_title(d, "Failure profiles: label shares", f"n={sum(d.profile_n)} judged turns"), fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return path


def plot_human(d: StudyPlotData, path: Path) -> Path:
    """Follow-up rate of the real human next turn against the models' sampled turns on the same conversations."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / max(1, len(d.human))
    n = 0
    for j, (name, rs) in enumerate(d.human):
        n += _n(rs)
        ax.bar([i + w * j for i in range(len(d.human_datasets))], [r.p if r.n else 0 for r in rs], w, label=name,
               yerr=_yerr(rs), capsize=2)
    ax.set_xticks([i + w * (len(d.human) - 1) / 2 for i in range(len(d.human_datasets))], d.human_datasets)
    ax.set_ylabel("follow-up rate")
    ax.set_ylim(0, 1)
    _legend_right(ax)
    ax.set_title(_title(d, "Human next turn vs the models' turns (95% Wilson CIs)", f"n={n} judged turns"),
                 fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return path


def write_study_figures(d: StudyPlotData, out_dir: Path, prefix: str = "study_") -> dict[str, Path]:
    """All five figures as ``out_dir/<prefix><name>.png``; returns name -> path."""
    draw = {"accuracy": plot_accuracy, "temperature": plot_temperature, "perturbations": plot_perturbations,
            "profiles": plot_profiles, "human": plot_human}
    return {k: draw[k](d, out_dir / f"{prefix}{k}.png") for k in FIGURES}
