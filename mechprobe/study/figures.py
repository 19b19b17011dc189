"""What the study figures show, computed from the collected runs: :func:`plot_data` turns a
:class:`~mechprobe.study.data.StudyData` into the plain :class:`~mechprobe.plots.study.StudyPlotData` that
:mod:`mechprobe.plots.study` draws."""

from __future__ import annotations

import math
from pathlib import Path

from mechprobe.plots.study import StudyPlotData, write_study_figures
from mechprobe.stats import Rate
from mechprobe.study.claims import label_dist
from mechprobe.study.data import (
    DEGENERATE,
    T_REF,
    StudyData,
    _judged,
    _temperatures,
    accuracy,
    greedy,
    rate,
    sampled,
)
from mechprobe.taxonomy import GENUINE, LABELS


def plot_data(data: StudyData) -> StudyPlotData:
    keys = sorted(data.full)
    models = data.models()
    d = StudyPlotData(judge=", ".join(data.judges()) or "none", models=models, t_ref=T_REF, keys=keys,
                      labels=list(LABELS))
    for k in keys:
        rd = data.full[k]
        d.accuracy.append(accuracy(rd))
        d.greedy.append(rate(greedy(rd.turns)))
        d.sampled.append(rate(sampled(rd.turns)))
        d.profiles.append(label_dist(rd.turns))
        d.profile_n.append(len(_judged(rd.turns)))
    for m in models:
        turns = [t for ds in data.datasets(m) for t in data.full[(m, ds)].turns]
        temps = _temperatures(data, m)
        by_t = [[t for t in turns if math.isclose(t.temperature, x)] for x in temps]
        d.temperature[m] = (temps, [rate(tt, GENUINE) for tt in by_t], [rate(tt, DEGENERATE) for tt in by_t])
    d.variants = ["full", *sorted({v for _, _, v in data.variants})]  # one x position per variant for every model
    for m in models:
        rs = [rate(sampled([t for ds in data.datasets(m) for t in data.full[(m, ds)].turns]))]
        rs += [rate(sampled([t for (mm, _, v), rd in sorted(data.variants.items()) if mm == m and v == name
                             for t in rd.turns])) for name in d.variants[1:]]
        d.perturbations[m] = rs
    d.human_datasets = sorted(data.human)
    d.human.append(("human", [rate(data.human[ds].turns) for ds in d.human_datasets]))
    for m in models:
        d.human.append((f"{m} T={T_REF:g}", [_model_on_human(data, m, ds) for ds in d.human_datasets]))
    return d


def _model_on_human(data: StudyData, model: str, ds: str) -> Rate:
    """The model's sampled rate on the conversations the human reference covers."""
    if (model, ds) not in data.full:
        return Rate(0, 0)
    ids = {t.item_id for t in data.human[ds].turns}
    return rate(sampled([t for t in data.full[(model, ds)].turns if t.item_id in ids]))


def write_figures(data: StudyData, out_dir: Path, prefix: str = "study_") -> dict[str, Path]:
    """The five study figures under ``out_dir``; returns name -> path."""
    return write_study_figures(plot_data(data), out_dir, prefix)
