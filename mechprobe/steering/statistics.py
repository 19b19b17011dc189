"""Per-condition statistics of the held-out table beyond the rates: judge-only and audit-corrected columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mechprobe.audit.rates import AuditTruth, difference_columns, rate_columns
from mechprobe.steering.vector import SteeringVector


def audited_columns(run: Path, audit: AuditTruth | None, path: Path, g: dict[str, bool], base_path: Path,
                    base_g: dict[str, bool], seed: int) -> dict[str, Any]:
    """Judge-only and (with audit labels) corrected follow-up rate and paired difference vs alpha 0 of one
    condition, by :mod:`mechprobe.audit` (turns are named as the audit names them: ``<file>#<item>``)."""

    def ids(p: Path) -> str:
        return p.resolve().relative_to(run.resolve()).as_posix() if audit is not None else p.name

    rel, base_rel = ids(path), ids(base_path)
    j, c = rate_columns({f"{rel}#{i}": v for i, v in g.items()}, audit)
    out: dict[str, Any] = {"followup_judge_only": j.to_dict(), "followup_corrected": c.to_dict() if c else None,
                           "diff_vs_alpha0_judge_only": None, "diff_vs_alpha0_corrected": None}
    if path.resolve() == base_path.resolve():
        return out
    ta = tb = None
    if audit is not None:
        ta = {i: audit.truth[f"{base_rel}#{i}"] for i in base_g if f"{base_rel}#{i}" in audit.truth}
        tb = {i: audit.truth[f"{rel}#{i}"] for i in g if f"{rel}#{i}" in audit.truth}
    dj, dc = difference_columns(base_g, g, ta, tb, seed=seed)
    out.update(diff_vs_alpha0_judge_only=dj.to_dict(), diff_vs_alpha0_corrected=dc.to_dict() if dc else None)
    return out


def heldout_row(r: dict[str, Any], vec: SteeringVector, alpha: float, *, layer: int, unit: str, raw: SteeringVector,
                mcnemar: dict[str, Any], task_accuracy: float | None, run: Path, audit: AuditTruth | None, path: Path,
                g: dict[str, bool], base_path: Path, base_g: dict[str, bool], seed: int) -> dict[str, Any]:
    """One row of the held-out table: the condition's summary ``r`` with the push it got (|delta| in absolute,
    residual-norm and raw diff-of-means units), its paired test vs alpha 0, task accuracy and audit columns.

    Why every unit: kinds are compared at equal |delta|, and a reader of the CAA literature thinks in raw alphas.
    """
    dn = abs(alpha) * vec.norm
    resid_norm = raw.resid_norm
    return {**r, "kind": vec.kind, "layer": layer, "alpha_unit": unit, "resid_norm": resid_norm,
            "delta_norm": dn, "delta_over_resid": dn / resid_norm if resid_norm else None,
            "raw_alpha_equiv": dn / raw.norm if raw.norm else None,
            "mcnemar": mcnemar, "task_accuracy": task_accuracy,
            **audited_columns(run, audit, path, g, base_path, base_g, seed)}
