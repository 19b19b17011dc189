"""The audit report: labeller agreement, judge-vs-labeller agreement, and judge-only vs corrected rates.

Why: every follow-up rate in the study comes from a judge. This report says how far the judge can be
trusted on this run (kappa against blind labellers, per stratum, with the confusion matrix) and what the
rates become once the judge's errors are corrected with the audit (prediction-powered inference, see
:mod:`mechprobe.audit.estimate`), side by side with the judge-only numbers. Written to
``<run>/audit/report.md`` (short tables) and ``report.json`` (everything).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.taxonomy import GENUINE, LABELS

from .agreement import Kappa, kappa_with_ci
from .estimate import (
    Estimate,
    corrected_paired_difference,
    corrected_rate,
    judge_only_difference,
    judge_only_rate,
)
from .identify import identification_markdown
from .labels import LabellerLabels
from .sample import AuditSample, audit_dir
from .store import write_json_atomic, write_text_atomic
from .table import TurnTable

__all__ = ["AuditRow", "audit_rows", "build_report", "report_markdown", "write_report", "NO_MAJORITY",
           "BASE_FOR_DIFFERENCES", "check_report_args", "check_sample_judged", "MIN_N_BOOT"]

NO_MAJORITY = "no_majority"
BASE_FOR_DIFFERENCES = "none"  # the unsteered condition of a steering run
_ASSUMPTIONS = ("audited turns are a seeded random sample of their stratum, drawn without looking at any label; "
                "the labellers' consensus (mean of their genuine calls) is taken as the truth; corrected = PPI++ "
                "(ppi_py) with the judge's verdicts on the non-audited turns as the unlabelled set; CLT intervals, "
                "unreliable with fewer than ~30 audited turns or no audited positive")
MIN_N_BOOT = 20  # fewer bootstrap draws give no usable percentile interval (none at all below one)


def check_report_args(alpha: float, n_boot: int) -> None:
    """Refuse an ``alpha`` or ``n_boot`` that would fill the report with NaN or inverted intervals.

    Why here and not only in the CLI: ``alpha`` outside (0, 1) gives ``[inf%, -inf%]`` Wilson bounds and NaN
    quantiles without any error, so every caller of :func:`build_report` needs the check.
    """
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0 < alpha < 1):
        raise UsageError(f"--alpha {alpha}: must be a number strictly between 0 and 1 (1 - confidence level); "
                         f"pass --alpha 0.05 for 95% intervals")
    if not isinstance(n_boot, int) or n_boot < MIN_N_BOOT:
        raise UsageError(f"--n-boot {n_boot}: the kappa intervals need at least {MIN_N_BOOT} bootstrap draws; pass "
                         f"--n-boot 500 (the default)")


def check_sample_judged(sample: AuditSample, table: TurnTable, run: str | Path = "RUN") -> None:
    """Refuse when a sampled turn has no judge label now (re-judged as ``judge_error``, or removed).

    Why before anything is imported: the report compares every audited turn with the judge's label; a
    sampled turn without one cannot be compared, and dropping it would bias the stratum's audit.
    """
    missing = [r for r in sample.record_ids if not table.has(r)]
    if missing:
        raise UsageError(f"{len(missing)} sampled turn(s) have no judge label in the run now (first {missing[0]!r}: "
                         f"a judge_error or a removed turn); re-run `mechprobe judge {run}` (judge errors are "
                         f"retried), or draw a new sample with --redraw; nothing was imported")


@dataclass(frozen=True)
class AuditRow:
    """One sampled turn joined with its labels: judge's label and each labeller's (None: not labelled)."""

    record_id: str
    item_id: str
    stratum: str
    judge_label: str
    labels: dict[str, str]

    @property
    def consensus(self) -> float | None:
        """Share of the labellers who labelled this turn that call it genuine; None if nobody did."""
        got = list(self.labels.values())
        return sum(x == GENUINE for x in got) / len(got) if got else None

    @property
    def majority(self) -> str | None:
        """The label most labellers gave; :data:`NO_MAJORITY` on a tie; None if nobody labelled it."""
        got = Counter(self.labels.values()).most_common()
        if not got:
            return None
        if len(got) > 1 and got[0][1] == got[1][1]:
            return NO_MAJORITY
        return got[0][0]


def audit_rows(sample: AuditSample, table: TurnTable, labellers: list[LabellerLabels]) -> list[AuditRow]:
    """Every sampled turn with the judge's label and each labeller's label (joined on the sheet's row key)."""
    by = [(lab.name, lab.by_row()) for lab in labellers]
    out = []
    for rid in sample.record_ids:
        t = table.get(rid)
        key = sample.row_key(rid)
        labels = {name: rows[key].label for name, rows in by if key in rows}
        out.append(AuditRow(rid, t.item_id, t.stratum(sample.by), t.judge_label, labels))
    return out


def _pairs(rows: list[AuditRow], a: str, b: str | None) -> tuple[list[str], list[str], list[str]]:
    """Labels of ``a`` and ``b`` (None = the judge) on the turns both labelled, and their item ids."""
    xa, xb, items = [], [], []
    for r in rows:
        if a in r.labels and (b is None or b in r.labels):
            xa.append(r.labels[a])
            xb.append(r.judge_label if b is None else r.labels[b])
            items.append(r.item_id)
    return xa, xb, items


def _kappas(a: list[str], b: list[str], items: list[str], n_boot: int, seed: int) -> dict[str, Any]:
    return {"binary": kappa_with_ci(a, b, items, True, n_boot, seed).to_dict(),
            "labels8": kappa_with_ci(a, b, items, False, n_boot, seed).to_dict()}


def _unique_per_item(table: TurnTable, by: str, stratum: str) -> dict[str, str] | None:
    """``item_id -> record_id`` of a stratum with one turn per item (a greedy steering condition), else None."""
    out: dict[str, str] = {}
    for r in table.strata(by).get(stratum, []):
        if r.item_id in out:
            return None
        out[r.item_id] = r.record_id
    return out


def build_report(table: TurnTable, sample: AuditSample, labellers: list[LabellerLabels], alpha: float = 0.05,
                 n_boot: int = 500, seed: int = 0) -> dict[str, Any]:
    """Everything the audit says about the judge and the rates, as one JSON-ready dict.

    Args:
        table: the run's judged turns; sample: its recorded sample; labellers: the imported labels.
        alpha: 1 - confidence level of every interval; n_boot, seed: the kappa bootstraps.
    Returns:
        ``{"sample", "labellers", "inter_labeller", "judge_vs_labeller", "confusion", "rates", "differences",
        "assumptions"}``; rates hold ``judge_only`` and ``corrected`` (consensus) and ``corrected_by_labeller``.
    Example:
        >>> rep = build_report(load_run_table(run), load_sample(run), load_labellers(run, sample))
        >>> rep["rates"]["none"]["corrected"]["point"]
    """
    check_report_args(alpha, n_boot)
    check_sample_judged(sample, table)
    rows = audit_rows(sample, table, labellers)
    names = [lab.name for lab in labellers]
    strata = sorted(table.strata(sample.by))
    rep: dict[str, Any] = {
        "sample": {"sample_id": sample.sample_id, "by": sample.by, "n": len(sample.record_ids), "seed": sample.seed,
                   "judges": list(sample.judges), "labels_changed_since_sample": table.labels_sha256 != sample.labels_sha256},
        "labellers": [{"name": lab.name, "kind": lab.kind, "n_labelled": len(lab.rows),
                       "borderline": sum(r.borderline for r in lab.rows)} for lab in labellers],
        "assumptions": _ASSUMPTIONS, "alpha": alpha,
    }
    rep["inter_labeller"] = [{"a": a, "b": b, **_kappas(*_pairs(rows, a, b), n_boot, seed)}
                             for a, b in itertools.combinations(names, 2)]
    jvl: list[dict[str, Any]] = []
    for name in names:
        for s in [*strata, "all"]:
            sub = [r for r in rows if s == "all" or r.stratum == s]
            jvl.append({"labeller": name, "stratum": s, **_kappas(*_pairs(sub, name, None), n_boot, seed)})
    rep["judge_vs_labeller"] = jvl
    cols = [*LABELS, NO_MAJORITY]
    conf = {j: dict.fromkeys(cols, 0) for j in LABELS}
    for r in rows:
        if r.majority is not None:
            conf[r.judge_label][r.majority] += 1
    rep["confusion"] = {"rows": "judge", "columns": "labeller majority", "counts": conf}

    audited = {r.record_id: r for r in rows if r.consensus is not None}
    rates: dict[str, Any] = {}
    for s, turns in table.strata(sample.by).items():
        judge_u = [int(t.judge_genuine) for t in turns if t.record_id not in audited]
        aud = [audited[t.record_id] for t in turns if t.record_id in audited]
        entry = {"n_turns": len(turns), "n_audited": len(aud),
                 "audited_genuine": sum(r.consensus or 0.0 for r in aud),
                 "judge_only": judge_only_rate([int(t.judge_genuine) for t in turns], alpha).to_dict(),
                 "judge_on_audited": judge_only_rate([int(r.judge_label == GENUINE) for r in aud], alpha).to_dict(),
                 "corrected": corrected_rate(judge_u, [int(r.judge_label == GENUINE) for r in aud],
                                             [r.consensus for r in aud], alpha).to_dict(),
                 "corrected_by_labeller": []}
        for name in names:
            mine = [r for r in aud if name in r.labels]
            judge_u_l = judge_u + [int(r.judge_label == GENUINE) for r in aud if name not in r.labels]
            est = corrected_rate(judge_u_l, [int(r.judge_label == GENUINE) for r in mine],
                                 [int(r.labels[name] == GENUINE) for r in mine], alpha)
            entry["corrected_by_labeller"].append({"labeller": name, **est.to_dict()})
        rates[s] = entry
    rep["rates"] = rates
    rep["differences"] = _differences(table, sample, audited, alpha, seed) if sample.by.startswith("condition") else []
    return rep


def _differences(table: TurnTable, sample: AuditSample, audited: dict[str, AuditRow], alpha: float,
                 seed: int) -> list[dict[str, Any]]:
    """Paired condition-minus-``none`` differences, judge-only and corrected (steering runs only)."""
    base = _unique_per_item(table, "condition", BASE_FOR_DIFFERENCES)
    if base is None:
        return []
    out = []
    for cond in sorted(table.strata("condition")):
        if cond == BASE_FOR_DIFFERENCES:
            continue
        other = _unique_per_item(table, "condition", cond)
        if other is None:
            continue

        def judge(m: dict[str, str]) -> dict[str, float]:
            return {it: float(table.get(rid).judge_genuine) for it, rid in m.items()}

        def audit(m: dict[str, str]) -> dict[str, float]:
            return {it: float(audited[rid].consensus) for it, rid in m.items() if rid in audited}  # type: ignore[arg-type]

        ja, jb = judge(base), judge(other)
        out.append({"condition": cond, "base": BASE_FOR_DIFFERENCES,
                    "judge_only": judge_only_difference(ja, jb, seed).to_dict(),
                    "corrected": corrected_paired_difference(ja, jb, audit(base), audit(other), alpha).to_dict()})
    return out


def _est(d: dict[str, Any]) -> str:
    return Estimate(**d).cell()


def _md(s: str) -> str:
    """A markdown table cell: condition names such as ``diff_means|L14|a0.8`` contain pipes."""
    return s.replace("|", "\\|")


def report_markdown(rep: dict[str, Any]) -> str:
    """Short markdown tables: "judge only" next to "corrected (n audited)" for every rate and difference."""
    s = rep["sample"]
    pct = round(100 * (1 - rep["alpha"]))
    lines = [f"# Judge audit ({s['sample_id']})", "",
             f"Sample: {s['n']} turns by {s['by']}, seed {s['seed']}; judge {', '.join(s['judges']) or '?'}; "
             f"labellers: " + (", ".join(f"{lab['name']} ({lab['kind']}, {lab['n_labelled']} labelled, "
                                         f"{lab['borderline']} borderline)" for lab in rep["labellers"]) or "none"),
             ""]
    if s["labels_changed_since_sample"]:
        lines += ["**Note:** the run's judge labels changed since the sample was drawn; the audit compares "
                  "the labellers with the labels as they are now.", ""]
    lines += [f"## Follow-up rate per {s['by']} ({pct}% CIs)", "",
              f"| {s['by']} | turns | judge only | corrected (n audited) |", "|---|---|---|---|"]
    weak = False
    for k, r in rep["rates"].items():
        c = r["corrected"]
        mark = " †" if c["n_audited"] < 30 or not r["audited_genuine"] else ""
        weak = weak or bool(mark)
        lines.append(f"| {_md(k)} | {r['n_turns']} | {_est(r['judge_only'])} | {_est(c)} (n={c['n_audited']}){mark} |")
    if weak:
        lines += ["", "† fewer than 30 audited turns or no audited follow-up: the corrected interval is a CLT "
                  "interval and can be too narrow; audit more turns of that stratum."]
    if rep["differences"]:
        lines += ["", f"## Paired difference vs `{rep['differences'][0]['base']}` (same items)", "",
                  "| condition | items | judge only | corrected (n items audited in both) |", "|---|---|---|---|"]
        for d in rep["differences"]:
            c = d["corrected"]
            lines.append(f"| {_md(d['condition'])} | {d['judge_only']['n_total']} | {_est(d['judge_only'])} | "
                         f"{_est(c)} (n={c['n_audited']}) |")

    if rep["inter_labeller"]:
        lines += ["", "## Inter-labeller agreement (Cohen's kappa, item bootstrap)", "",
                  "| labellers | binary (genuine) | 8-label |", "|---|---|---|"]
        for k in rep["inter_labeller"]:
            lines.append(f"| {k['a']} vs {k['b']} | {Kappa(**k['binary']).cell()} | {Kappa(**k['labels8']).cell()} |")
    if rep["judge_vs_labeller"]:
        lines += ["", f"## Judge vs labeller per {s['by']}", "",
                  f"| labeller | {s['by']} | binary (genuine) | 8-label |", "|---|---|---|---|"]
        for k in rep["judge_vs_labeller"]:
            lines.append(f"| {k['labeller']} | {_md(k['stratum'])} | {Kappa(**k['binary']).cell()} | "
                         f"{Kappa(**k['labels8']).cell()} |")
    conf = rep["confusion"]["counts"]
    used = [c for c in [*LABELS, NO_MAJORITY] if any(conf[j][c] for j in conf)]
    if used:
        lines += ["", "## Confusion: judge (rows) x labeller majority (columns)", "",
                  "| judge \\ labellers | " + " | ".join(used) + " |", "|---" * (len(used) + 1) + "|"]
        for j in LABELS:
            if any(conf[j][c] for c in used):
                lines.append(f"| {j} | " + " | ".join(str(conf[j][c]) for c in used) + " |")
    lines += identification_markdown(rep)
    lines += ["", f"Assumptions: {rep['assumptions']}.", ""]
    return "\n".join(lines)


def write_report(run: str | Path, rep: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``<run>/audit/report.md`` and ``report.json`` (each whole or not at all); returns their paths."""
    d = audit_dir(run)
    md, js = d / "report.md", d / "report.json"
    write_json_atomic(js, rep)
    write_text_atomic(md, report_markdown(rep))
    return md, js
