"""Cohen's kappa: the one definition behind the agreement command, the audit's judge-vs-labeller tables and the
judge benchmarks."""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence

from sklearn.metrics import cohen_kappa_score

__all__ = ["cohen_kappa"]


def cohen_kappa(a: Sequence[Hashable], b: Sequence[Hashable], labels: Sequence[Hashable] | None = None) -> float:
    """Cohen's kappa = (p_o - p_e) / (1 - p_e) of two paired ratings; NaN when p_e = 1.

    ``labels`` fixes the classes (default: those either rater used). With no ratings, or when both raters
    used one and the same class, chance agreement is 1 and kappa is 0/0: NaN, never a warning or an error.

    Example:
        >>> cohen_kappa(["a", "b"], ["a", "b"])
        1.0
    """
    if len(a) != len(b):
        raise ValueError(f"kappa needs paired ratings, got {len(a)} and {len(b)}")
    if len(a) == 0 or len(set(a) | set(b)) < 2:
        return float("nan")
    labs = list(labels) if labels is not None else sorted(set(a) | set(b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(cohen_kappa_score(list(a), list(b), labels=labs))
