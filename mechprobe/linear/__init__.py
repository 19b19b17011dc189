"""Linear probes on the boundary activations: does the state before the user turn predict a follow-up?

:mod:`.fit` (folds grouped by item, logistic and ridge fits, AUROC with bootstraps, the random-direction band
and the text baseline) · :mod:`.turn` (the layer sweep on row-level labels) · :mod:`.propensity` (item-level
follow-up propensity from one forward) · :mod:`.linear_probe` (``fit_probe`` and ``LinearProbe``, the public
research API) · :mod:`.experiment` (the ``probes`` command's driver).
"""
