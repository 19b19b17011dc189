"""Every figure renders rates at 0 and 1, intervals whose bounds miss their point by float noise, zero-width
intervals, a single point and an empty series, and every error bar is drawn from non-negative extents.

Why noise on purpose: statsmodels' Wilson interval for 0/13 had a lower bound of 1.4e-17, a bootstrap quantile
can come out 1 ulp inside its point, and matplotlib refuses the resulting negative extent with a ValueError,
which ended ``steer`` in a traceback after every result was computed. The figures must not depend on every
interval function being exact at the edges.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mechprobe.linear.fit import Metric
from mechprobe.linear.propensity.sweep import PropensityLayer, PropensityReport
from mechprobe.linear.turn import LayerResult, LayerSweepReport
from mechprobe.plots import plot_layer_auroc, plot_no_curve, plot_propensity, plot_steering
from mechprobe.plots.extents import draw_figure, yerr
from mechprobe.plots.post_train import plot_eval, plot_loss
from mechprobe.plots.study import FIGURES, StudyPlotData, write_study_figures
from mechprobe.stats import Rate

ULP = 1.1e-16  # the size of the noise statsmodels and numpy quantiles leave at 0 and 1

# (point, lo, hi): at 0 with a lower bound just above it, at 1 with an upper bound just below it, zero-width,
# and an interval that misses its point (a percentile bootstrap may, in principle).
EDGES = {"zero": (0.0, 1.39e-17, 0.228), "one": (1.0, 0.772, 1 - ULP), "zero_width": (0.4, 0.4, 0.4),
         "outside": (0.5, 0.55, 0.7)}
SHAPES = ["edges", "single", "empty"]


def test_yerr_clips_every_extent_at_zero_and_draws_no_bar_for_missing_values():
    e = yerr([0.0, 1.0, 0.4, 0.5, float("nan"), None], [1.39e-17, 0.772, 0.4, 0.55, 0.1, None],
             [0.228, 1 - ULP, 0.4, 0.7, 0.2, None])
    assert e.shape == (2, 6) and np.all(e >= 0) and np.all(np.isfinite(e))
    assert e[:, 0].tolist() == [0.0, 0.228] and e[1, 1] == 0.0 and e[:, 2].tolist() == [0.0, 0.0]
    assert e[0, 3] == 0.0 and e[1, 3] == pytest.approx(0.2)  # covers the interval and its point
    assert e[:, 4].tolist() == [0.0, 0.0] and e[:, 5].tolist() == [0.0, 0.0]
    assert yerr([], [], []).shape == (2, 0)
    with pytest.raises(ValueError, match="one low and one high per point"):
        yerr([0.1, 0.2], [0.0], [0.3])


def test_draw_figure_turns_a_plotting_failure_into_one_line_naming_the_figure(tmp_path):
    out = tmp_path / "f.png"

    def broken() -> None:
        raise ValueError("'yerr' must not contain\nnegative values")

    path, line = draw_figure(out, broken)
    assert path is None and "\n" not in line
    assert line.startswith(f"figure not drawn: {out} (ValueError at test_edge_intervals.py:")
    assert "'yerr' must not contain negative values" in line
    assert draw_figure(out, lambda: out.write_bytes(b"png")) == (out, "")


def _steer_rows(shape: str) -> list[dict]:
    if shape == "empty":
        return []
    edges = list(EDGES.values())[:1] if shape == "single" else list(EDGES.values())
    rows = []
    for k in ("diff_means", "random"):
        for i, (p, lo, hi) in enumerate(edges):
            rows.append(dict(kind=k, alpha=[0.0, 0.05, 0.8, 4.0][i], followup_rate=p, ci=[lo, hi],
                             degenerate_rate=1 - p, degenerate_ci=[1 - hi, 1 - lo]))
        if shape == "single":
            break
    return rows


@pytest.mark.parametrize("shape", SHAPES)
def test_plot_steering(tmp_path, shape):
    out = plot_steering(_steer_rows(shape), tmp_path / "s.png", "title")
    assert out.stat().st_size > 5_000


def _metrics(shape: str) -> list[Metric]:
    if shape == "single":
        return [Metric(*EDGES["one"])]
    ms = [Metric(*v) for v in EDGES.values()]
    return ms + [Metric(math.nan, math.nan, math.nan)] if shape == "empty" else ms


def _sweep(shape: str) -> LayerSweepReport:
    ms = _metrics(shape)
    per = [LayerResult(i, m, m, m, shuffled_auroc=m, random_dir_auroc=None if shape == "empty" else m,
                       greedy_auroc=m) for i, m in enumerate(ms)]
    nested = {"auroc": ms[0], "bal_acc": ms[0], "fold_layers": [0]}
    return LayerSweepReport([r.layer for r in per], per, 0, nested, ms[-1], {})


@pytest.mark.parametrize("shape", SHAPES)
def test_plot_layer_auroc(tmp_path, shape):
    ms = _metrics(shape)
    ctrl = {"text_baseline": ms[0], "item_ceiling": ms[-1]}
    conf = {"confusion": [[0, 0], [0, 3]], "labels": ["a", "b"], "support": [0, 3], "balanced_accuracy": 1.0,
            "chance_balanced_accuracy": 0.5, "layer": 0}
    out = plot_layer_auroc(_sweep(shape), ctrl, tmp_path / "l.png", "title", confusion=conf)
    assert out.stat().st_size > 5_000


@pytest.mark.parametrize("shape", SHAPES)
def test_plot_propensity(tmp_path, shape):
    ms = _metrics(shape)
    per = [PropensityLayer(i, m, m, shuffled_rho=m, random_dir_rho=None if shape == "empty" else m)
           for i, m in enumerate(ms)]
    rep = PropensityReport([r.layer for r in per], per, 0, {"rho": ms[0], "fold_layers": [0]}, {})
    ctrl = {"split_half_ceiling": ms[-1], "shuffled_max": ms[0], "text_ridge": ms[0]}
    assert plot_propensity(rep, ctrl, tmp_path / "p.png", "title").stat().st_size > 5_000


@pytest.mark.parametrize("counts", [{}, {"genuine rows": 0}, {"genuine rows": 0, "items": 42}])
def test_plot_no_curve(tmp_path, counts):
    assert plot_no_curve(counts, "too few positives", tmp_path / "n.png", "title").stat().st_size > 5_000


def _rate(p: float, lo: float, hi: float, n: int = 13) -> dict:
    return {"rate": p, "n": n, "ci": [lo, hi]}


def _summary(shape: str) -> dict:
    (p0, lo0, hi0), (p1, lo1, hi1) = EDGES["zero"], EDGES["one"]
    arm = {"all": {"followup": {"greedy": _rate(p0, lo0, hi0), "sample": _rate(p1, lo1, hi1)}, "truncated": {"n": 13}},
           "gsm8k": {"corrected": {"greedy": {"point": p0, "lo": lo0, "hi": hi0},
                                   "sample": {"point": EDGES["outside"][0], "lo": 0.55, "hi": 0.7}}}}
    arms = {"base": arm}
    if shape != "single":
        arms["post"] = {"all": {"followup": {"greedy": _rate(0.4, 0.4, 0.4), "sample": _rate(0.0, 0.0, 1.0, n=0)},
                                "truncated": {"n": 0}}, "gsm8k": {}}
    if shape == "empty":
        arms["dpo"] = {"all": {"followup": {d: _rate(0.0, 0.0, 1.0, n=0) for d in ("greedy", "sample")}}, "gsm8k": {}}
    return {"judge": "offline", "arms": arms}


@pytest.mark.parametrize("shape", SHAPES)
def test_plot_eval(tmp_path, shape):
    shifts = {"post": [] if shape == "empty" else [{"layer": 3, "shift_gap": 0.0, "ci_gap": [0.0, 0.0]}]}
    out = plot_eval(_summary(shape), shifts, tmp_path / "e.png", "model")
    assert out.stat().st_size > 5_000


@pytest.mark.parametrize("log", [[], [{"step": 1, "loss": 2.0}]])
def test_plot_loss(tmp_path, log):
    out = plot_loss(log, tmp_path / "loss.png", "title", heldout=[[1, 2.1]] if log else [], chosen=1 if log else None)
    assert out.stat().st_size > 5_000


def _study(shape: str) -> StudyPlotData:
    rates = {"edges": [Rate(0, 13), Rate(13, 13), Rate(0, 11), Rate(11, 11), Rate(0, 0)],
             "single": [Rate(0, 13)], "empty": [Rate(0, 0)]}[shape]
    keys = [(f"m{i}", "gsm8k") for i in range(len(rates))]
    d = StudyPlotData(judge="offline", models=[m for m, _ in keys], t_ref=1.0, keys=keys, accuracy=rates,
                      greedy=rates, sampled=rates, variants=["full", "no_system"], labels=["genuine_followup"],
                      profiles=[{"genuine_followup": r.p if r.n else 0.0} for r in rates],
                      profile_n=[r.n for r in rates], human_datasets=["hh"])
    for m, _ in keys:
        d.temperature[m] = ([0.0, 1.0][: len(rates)] if shape != "single" else [0.0], rates[:2], rates[:2])
        d.perturbations[m] = rates[:2]
    d.human = [("human", rates[:1]), *[(f"{m} T=1", rates[-1:]) for m, _ in keys]]
    return d


@pytest.mark.parametrize("shape", SHAPES)
def test_study_figures(tmp_path, shape):
    paths = write_study_figures(_study(shape), tmp_path)
    assert set(paths) == set(FIGURES) and all(p.stat().st_size > 5_000 for p in paths.values())
