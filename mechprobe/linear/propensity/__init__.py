"""Item-level propensity probes: the generation-free awareness score.

The boundary state (residual stream at the last token of the user-role header) is read *before* any
user-turn token exists, so it is one vector per item, shared by the greedy turn and every sampled turn.
A probe on it cannot say which sample of an item will be a genuine follow-up; it can only predict the
item's **propensity** to be followed up: the fraction of its ``k`` sampled turns (at one temperature)
the judge calls genuine. That is the target here, with one row per item:

* **ridge** (StandardScaler + Ridge, alpha by inner CV on training items) predicts the propensity;
  Spearman rho between its out-of-fold score and the held-out propensity is the headline metric;
* **logistic** probes (:func:`mechprobe.linear.turn.fit_logreg`) predict "propensity above the median" and
  the greedy turn's label (AUROC);
* **nested layer choice**: inside each outer fold the layer is picked by inner-CV score on training
  items only, as :func:`mechprobe.linear.turn.sweep_layers` does for the turn-level probe;
* **controls** on the same folds: propensities shuffled between items (at each layer, and the best of
  all layers under shuffling: the null for "best layer"), random directions (sign fitted per fold),
  the embedding layer, a text-only ridge on TF-IDF of prompt + response, and response length;
* **split-half ceiling**: the propensity is itself a noisy estimate from ``k`` samples. Its reliability
  ``R`` (the correlation of two independent ``k``-sample estimates) is what
  :func:`split_half_reliability` estimates (split each item's samples in halves, Spearman over items,
  Spearman-Brown corrected to full ``k``, averaged over random splits). A probe that knew each item's
  *true* propensity would correlate with the observed one at ``sqrt(R)`` (classical attenuation), so the
  ceiling printed beside the probe is ``sqrt(R)``, not ``R`` (which a good probe can exceed).

All 95% CIs are percentile bootstraps over items (one row per item, so an item bootstrap is a row
bootstrap here); they cover test-set sampling, not refitting.

One concept per module: :mod:`.targets`, :mod:`.statistics` (CIs), :mod:`.reliability` (ceiling), :mod:`.fit`
(folds, ridge, logistic), :mod:`.sweep` (layers, nested choice), :mod:`.controls`, :mod:`.transfer`, :mod:`.cost`
and :mod:`.report` (markdown) are pure (arrays in, numbers or text out); :mod:`.load` reads run directories.
The driver that writes ``probes/propensity.{json,md}`` is :func:`mechprobe.linear.propensity.driver.run_propensity`.
"""

from __future__ import annotations

from mechprobe.linear.propensity.controls import (
    length_design,
    oof_ols,
    partial_rho_metric,
    propensity_controls,
)
from mechprobe.linear.propensity.cost import cost_summary, run_cost
from mechprobe.linear.propensity.fit import (
    ALPHAS,
    InsufficientItems,
    RidgeFit,
    fit_ridge,
    make_item_folds,
    oof_logreg,
    oof_ridge,
)
from mechprobe.linear.propensity.load import (
    AUTO_MIN_SAMPLES,
    SAME_STATE_RTOL,
    ItemStates,
    choose_target,
    load_item_states,
    one_row_per_item,
    run_datasets,
)
from mechprobe.linear.propensity.reliability import (
    attenuation_ceiling,
    spearman_brown,
    split_half_reliability,
)
from mechprobe.linear.propensity.report import propensity_table
from mechprobe.linear.propensity.statistics import auroc_metric, bootstrap_indices, rho_metric
from mechprobe.linear.propensity.sweep import PropensityLayer, PropensityReport, propensity_sweep_layers
from mechprobe.linear.propensity.targets import (
    ItemTargets,
    above_median,
    concat_targets,
    item_key,
    item_targets,
)
from mechprobe.linear.propensity.transfer import modal_layer, propensity_transfer

__all__ = [
    "ALPHAS", "AUTO_MIN_SAMPLES", "SAME_STATE_RTOL", "InsufficientItems", "ItemStates", "ItemTargets",
    "PropensityLayer", "PropensityReport", "RidgeFit", "above_median", "attenuation_ceiling", "auroc_metric",
    "bootstrap_indices", "choose_target", "concat_targets", "cost_summary", "fit_ridge", "item_key", "item_targets",
    "length_design", "load_item_states", "make_item_folds", "modal_layer", "one_row_per_item", "oof_logreg", "oof_ols",
    "oof_ridge", "partial_rho_metric", "propensity_controls", "propensity_sweep_layers", "propensity_table",
    "propensity_transfer", "rho_metric", "run_cost", "run_datasets", "spearman_brown", "split_half_reliability",
]
