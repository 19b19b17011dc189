"""Small statistics shared by every report (one definition, so two tables never disagree).

One module per concept: :mod:`~mechprobe.stats.proportions` (the Wilson interval, ``Rate``),
:mod:`~mechprobe.stats.paired` (the paired-test family: exact McNemar on per-item outcomes, the item
bootstrap on per-item rates), :mod:`~mechprobe.stats.bootstrap` (two unpaired groups of items),
:mod:`~mechprobe.stats.distributions` (label shares, total variation distance) and
:mod:`~mechprobe.stats.agreement` (Cohen's kappa) and :mod:`~mechprobe.stats.clustered` (item-clustered
intervals: cluster bootstrap, cluster PPI, paired item bootstrap, Clopper-Pearson).
"""

from __future__ import annotations

from mechprobe.stats import clustered  # noqa: F401  item-clustered intervals: mechprobe.stats.clustered
from mechprobe.stats.agreement import cohen_kappa
from mechprobe.stats.bootstrap import bootstrap_diff
from mechprobe.stats.distributions import label_shares, tvd, tvd_bootstrap
from mechprobe.stats.paired import (
    PairedOutcomes,
    PairedRates,
    mcnemar_exact,
    paired_bootstrap,
    paired_outcomes,
    paired_rates,
)
from mechprobe.stats.proportions import Rate, wilson

__all__ = ["PairedOutcomes", "PairedRates", "Rate", "bootstrap_diff", "cohen_kappa", "label_shares", "mcnemar_exact",
           "paired_bootstrap", "paired_outcomes", "paired_rates", "tvd", "tvd_bootstrap", "wilson"]
