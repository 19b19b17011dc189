"""The studies over every embedded chat model: accuracy, greedy vs sampled follow-up, perturbations.

:mod:`.run` (driver, resumable per model and dataset) · :mod:`.data` (collect the runs) · :mod:`.claims`
(paired tests and decision rules) · :mod:`.figures` (plot data) · :mod:`.report` (markdown).
"""
