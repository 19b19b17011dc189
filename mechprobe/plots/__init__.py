"""Figures people look at (matplotlib, Agg backend, written to ``figures/``): one module per experiment.

:mod:`mechprobe.plots.linear` (linear probes), :mod:`mechprobe.plots.steering` (steering),
:mod:`mechprobe.plots.post_train`, :mod:`mechprobe.plots.study`, :mod:`mechprobe.plots.titles` (the title every
figure carries) and :mod:`mechprobe.plots.extents` (every error bar's clipped, non-negative extents, and
``draw_figure``: drivers draw a figure last, and a plotting failure becomes one line naming it). Re-exported here
so ``from mechprobe.plots import plot_steering`` keeps working.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from mechprobe.plots.linear import plot_layer_auroc, plot_no_curve, plot_propensity  # noqa: E402
from mechprobe.plots.steering import plot_steering, steering_title  # noqa: E402
from mechprobe.plots.titles import figure_title  # noqa: E402

__all__ = ["figure_title", "plot_layer_auroc", "plot_no_curve", "plot_propensity", "plot_steering", "steering_title"]
