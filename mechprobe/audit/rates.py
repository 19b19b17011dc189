"""Judge-only and audit-corrected follow-up rates for the tables other commands print.

Why here: the probe-run summary and the steering results table report follow-up rates by the judge. When
the run has been audited (``<run>/audit/sample.json`` and ``<run>/audit/labels/*.json``), each rate and each
paired difference gets a corrected column beside the judge-only one, computed by the estimators of
:mod:`.estimate` (nothing is re-derived here: this module only joins a table's verdicts with the audit's
consensus on the same turns). Without audit labels the tables say "judge only".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .estimate import (
    Estimate,
    corrected_paired_difference,
    corrected_rate,
    judge_only_difference,
    judge_only_rate,
)
from .labels import load_labellers
from .report import AuditRow
from .sample import SAMPLE_FILE, audit_dir, load_sample

__all__ = ["AuditTruth", "audit_truth", "rate_columns", "difference_columns", "cells", "headers", "JUDGE_ONLY",
           "CORRECTED"]

JUDGE_ONLY = "judge only"
CORRECTED = "corrected (n audited)"


@dataclass(frozen=True)
class AuditTruth:
    """The audit's consensus (share of labellers calling a turn genuine) per audited record id of a run."""

    run: str
    sample_id: str
    labellers: tuple[str, ...]
    truth: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.truth)


def audit_truth(run: str | Path) -> AuditTruth | None:
    """The run's audit labels joined to its sample, or None when the run has no audit labels.

    Args:
        run: a run directory (the audit lives in ``<run>/audit``).
    Returns:
        record id (as :func:`mechprobe.audit.table.load_run_table` names turns) -> consensus in [0, 1], for
        every sampled turn at least one labeller labelled; None without a sample or without labels.
    """
    if not (audit_dir(run) / SAMPLE_FILE).exists():
        return None
    sample = load_sample(run)
    labellers = load_labellers(run, sample)
    if not labellers:
        return None
    by = [(lab.name, lab.by_row()) for lab in labellers]
    truth: dict[str, float] = {}
    for rid in sample.record_ids:
        key = sample.row_key(rid)
        c = AuditRow(rid, "", "", "", {name: rows[key].label for name, rows in by if key in rows}).consensus
        if c is not None:
            truth[rid] = c
    if not truth:
        return None
    return AuditTruth(str(run), sample.sample_id, tuple(lab.name for lab in labellers), truth)


def rate_columns(judge: dict[str, int | bool], audit: AuditTruth | None,
                 alpha: float = 0.05) -> tuple[Estimate, Estimate | None]:
    """(judge-only rate, corrected rate or None) of one stratum.

    Args:
        judge: record id -> the judge's verdict (genuine or not) for every turn of the stratum that counts.
        audit: the run's audit (None: no corrected number).
    Returns:
        the judge-only Wilson estimate over all turns and, with an audit, the PPI++ estimate that uses the
        audited turns of this stratum as the labelled set and the others as the unlabelled set (NaN with no
        audited turn in it).
    """
    j = judge_only_rate([int(v) for v in judge.values()], alpha)
    if audit is None:
        return j, None
    aud = [r for r in judge if r in audit.truth]
    rest = [int(judge[r]) for r in judge if r not in audit.truth]
    return j, corrected_rate(rest, [int(judge[r]) for r in aud], [audit.truth[r] for r in aud], alpha)


def difference_columns(judge_a: dict[str, int | bool], judge_b: dict[str, int | bool],
                       truth_a: dict[str, float] | None, truth_b: dict[str, float] | None, alpha: float = 0.05,
                       seed: int = 0) -> tuple[Estimate, Estimate | None]:
    """(judge-only paired difference b - a, corrected paired difference or None), keyed by item id.

    ``truth_a`` / ``truth_b``: item id -> audit consensus of the two conditions' turns (None: no audit).
    """
    ja = {k: float(v) for k, v in judge_a.items()}
    jb = {k: float(v) for k, v in judge_b.items()}
    j = judge_only_difference(ja, jb, seed)
    if truth_a is None or truth_b is None:
        return j, None
    return j, corrected_paired_difference(ja, jb, truth_a, truth_b, alpha)


def cells(j: Estimate, c: Estimate | None) -> list[str]:
    """Markdown cells: the judge-only estimate, and the corrected one with its ``n`` when there is an audit."""
    out = [j.cell()]
    if c is not None:
        out.append(f"{c.cell()} (n={c.n_audited})")
    return out


def headers(name: str, audited: bool) -> list[str]:
    """Column headers for a rate or difference ``name``: ``judge only`` and, audited, ``corrected (n audited)``."""
    return [f"{name}, {JUDGE_ONLY} [95% CI]"] + ([f"{name}, {CORRECTED}"] if audited else [])
