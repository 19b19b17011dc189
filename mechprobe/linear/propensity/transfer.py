"""Cross-dataset transfer of the ridge probe (train on A's items, test on B's) and the layer it is read at."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from mechprobe.linear.propensity.fit import InsufficientItems, fit_ridge, make_item_folds, oof_ridge
from mechprobe.linear.propensity.statistics import bootstrap_indices, rho_metric
from mechprobe.linear.propensity.targets import ItemTargets, above_median


def propensity_transfer(x: np.ndarray, targets: ItemTargets, n_splits: int = 5, seed: int = 0,
                        n_boot: int = 1000) -> dict[str, Any]:
    """Train the ridge probe on dataset A's items (alpha by inner CV on A), test on B's: Spearman rho with CI.

    The diagonal is A's own item-level CV rho, so a row reads "how much is lost by moving to another
    dataset". A cell is None with a reason when a side has no spread or too few items.
    """
    x = np.asarray(x, float)
    y = np.asarray(targets.propensity, float)
    ds = np.asarray(targets.datasets)
    names = sorted(set(ds.tolist()))
    cells: list[list[dict[str, Any]]] = []
    for a in names:
        tr = np.flatnonzero(ds == a)
        row: list[dict[str, Any]] = []
        fit = fit_ridge(x[tr], y[tr], seed) if np.ptp(y[tr]) > 0 and len(tr) >= 4 else None
        for b in names:
            te = np.flatnonzero(ds == b)
            if np.ptp(y[te]) == 0:
                row.append({"rho": None, "reason": f"every {b} item has propensity {y[te][0]:g}"})
                continue
            if a == b:
                try:
                    folds = make_item_folds(above_median(y[tr]).astype(str), n_splits, seed)
                except InsufficientItems as e:
                    row.append({"rho": None, "reason": str(e)})
                    continue
                s = oof_ridge(x[tr], y[tr], folds, seed)[0]
                row.append({"rho": asdict(rho_metric(y[tr], s, bootstrap_indices(len(tr), n_boot, seed)))})
                continue
            if fit is None:
                row.append({"rho": None, "reason": f"{a}: too few items or no spread in propensity to train"})
                continue
            s = fit.model.predict(x[te])
            row.append({"rho": asdict(rho_metric(y[te], s, bootstrap_indices(len(te), n_boot, seed)))})
        cells.append(row)
    sizes = {n: {"items": int((ds == n).sum()), "mean_propensity": float(y[ds == n].mean())} for n in names}
    return {"train_rows": names, "test_cols": names, "cells": cells, "sizes": sizes}


def modal_layer(fold_layers: Sequence[int]) -> int:
    """The layer the nested folds picked most often (ties: the lower): the transfer matrix's layer."""
    cnt = Counter(fold_layers)
    return min(cnt, key=lambda la: (-cnt[la], la))
