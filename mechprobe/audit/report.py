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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.io import shell_arg
from mechprobe.stats.clustered import cluster_ppi_paired_difference, has_repeats, paired_cluster_bootstrap
from mechprobe.taxonomy import GENUINE, LABELS

from .agreement import Kappa, kappa_with_ci
from .codebook import CODEBOOK_VERSION
from .estimate import (
    Estimate,
    corrected_paired_difference,
    corrected_rate,
    judge_only_difference,
    judge_only_rate,
)
from .identify import identification_markdown
from .labels import LabellerLabels
from .readings import LENIENT, READINGS, STRICT, label_under
from .sample import AuditSample, audit_dir
from .store import write_audit_text, write_json_atomic
from .table import BASE_CONDITION, TurnTable

__all__ = ["AuditRow", "audit_rows", "build_report", "report_markdown", "write_report", "NO_MAJORITY",
           "BASE_FOR_DIFFERENCES", "check_report_args", "check_sample_judged", "MIN_N_BOOT"]

NO_MAJORITY = "no_majority"
BASE_FOR_DIFFERENCES = "none"  # the unsteered condition of a steering run
_ASSUMPTIONS = ("audited turns are a seeded random sample of their stratum, drawn without looking at any label "
                "(spread over items: equal chances per turn when every item has as many turns in the stratum); "
                "the labellers' consensus (mean of their genuine calls) is taken as the truth, under the lenient "
                "and under the strict reading of the codebook; corrected = PPI++ (ppi_py) with the judge's verdicts "
                "on the non-audited turns as the unlabelled set; CLT intervals where every item has one turn in "
                "the stratum, item-cluster bootstrap intervals where items repeat; with no audited follow-up (or "
                "only follow-ups) the interval includes the exact Clopper-Pearson one of the audit alone; "
                "unreliable with fewer than ~30 audited turns")
MIN_N_BOOT = 20  # fewer bootstrap draws give no usable percentile interval (none at all below one)


def check_report_args(alpha: float, n_boot: int) -> None:
    """Refuse an ``alpha`` or ``n_boot`` that would fill the report with NaN or inverted intervals.

    Why here and not only in the CLI: ``alpha`` outside (0, 1) gives ``[inf%, -inf%]`` Wilson bounds and NaN
    quantiles without any error, so every caller of :func:`build_report` needs the check.
    """
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0 < alpha < 1):
        raise UsageError(f"alpha={alpha}: must be a number strictly between 0 and 1 (1 - confidence level); "
                         f"pass alpha=0.05 for 95% intervals")
    if not isinstance(n_boot, int) or n_boot < MIN_N_BOOT:
        raise UsageError(f"n_boot={n_boot}: the kappa intervals need at least {MIN_N_BOOT} bootstrap draws; pass "
                         f"n_boot=500 (the default)")


def check_sample_judged(sample: AuditSample, table: TurnTable, run: str | Path = "RUN") -> None:
    """Refuse when a sampled turn has no judge label now (re-judged as ``judge_error``, or removed).

    Why before anything is imported: the report compares every audited turn with the judge's label; a
    sampled turn without one cannot be compared, and dropping it would bias the stratum's audit.
    """
    missing = [r for r in sample.record_ids if not table.has(r)]
    if missing:
        raise UsageError(f"{len(missing)} sampled turn(s) have no judge label in the run now (first {missing[0]!r}: "
                         f"a judge_error or a removed turn); re-run `mechprobe judge {shell_arg(run)}` (judge errors are "
                         f"retried), or draw a new sample with redraw=True; nothing was imported")


@dataclass(frozen=True)
class AuditRow:
    """One sampled turn joined with its labels: judge's label and each labeller's (None: not labelled).

    ``labels`` are the labels as given (the lenient reading); ``strict_labels`` the same labellers' labels under
    the codebook's strict reading (:mod:`mechprobe.audit.readings`); empty means "as ``labels``".
    """

    record_id: str
    item_id: str
    stratum: str
    judge_label: str
    labels: dict[str, str]
    strict_labels: dict[str, str] = field(default_factory=dict)

    def labels_under(self, reading: str = LENIENT) -> dict[str, str]:
        """Each labeller's label under ``reading`` (``lenient`` or ``strict``)."""
        return (self.strict_labels or self.labels) if reading == STRICT else self.labels

    def consensus_under(self, reading: str = LENIENT) -> float | None:
        """Share of the labellers who labelled this turn that call it genuine under ``reading``; None if nobody did."""
        got = list(self.labels_under(reading).values())
        return sum(x == GENUINE for x in got) / len(got) if got else None

    @property
    def consensus(self) -> float | None:
        """Share of the labellers who labelled this turn that call it genuine (lenient reading); None if nobody did."""
        return self.consensus_under(LENIENT)

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
        strict = {name: label_under(rows[key], STRICT) for name, rows in by if key in rows}
        out.append(AuditRow(rid, t.item_id, t.stratum(sample.by), t.judge_label, labels, strict))
    return out


def _pairs(rows: list[AuditRow], a: str, b: str | None, reading: str = LENIENT
           ) -> tuple[list[str], list[str], list[str]]:
    """Labels of ``a`` and ``b`` (None = the judge) under ``reading`` on the turns both labelled, and their items."""
    xa, xb, items = [], [], []
    for r in rows:
        got = r.labels_under(reading)
        if a in got and (b is None or b in got):
            xa.append(got[a])
            xb.append(r.judge_label if b is None else got[b])
            items.append(r.item_id)
    return xa, xb, items


def _kappas(rows: list[AuditRow], a: str, b: str | None, n_boot: int, seed: int) -> dict[str, Any]:
    """Binary and 8-label kappa under the lenient reading (top level) and under the strict one (``strict``)."""
    out: dict[str, Any] = {}
    for reading in READINGS:
        xa, xb, items = _pairs(rows, a, b, reading)
        k = {"binary": kappa_with_ci(xa, xb, items, True, n_boot, seed).to_dict(),
             "labels8": kappa_with_ci(xa, xb, items, False, n_boot, seed).to_dict()}
        if reading == LENIENT:
            out.update(k)
        else:
            out[reading] = k
    return out


def _unequal_turns(turns: list[Any]) -> bool:
    """True when items hold different numbers of turns in a stratum (then one-per-item sampling does not give
    every turn the same chance to be audited)."""
    return len(set(Counter(t.item_id for t in turns).values())) > 1


def build_report(table: TurnTable, sample: AuditSample, labellers: list[LabellerLabels], alpha: float = 0.05,
                 n_boot: int = 500, seed: int = 0) -> dict[str, Any]:
    """Everything the audit says about the judge and the rates, as one JSON-ready dict.

    Args:
        table: the run's judged turns; sample: its recorded sample; labellers: the imported labels.
        alpha: 1 - confidence level of every interval; n_boot, seed: the kappa bootstraps (the item-cluster
            bootstraps of rates and differences use at least 2000 draws).
    Returns:
        ``{"sample", "labellers", "inter_labeller", "judge_vs_labeller", "confusion", "rates", "differences",
        "assumptions"}``. Rates hold ``judge_only``, ``corrected`` (consensus) and ``corrected_by_labeller`` under
        the lenient reading, and the same under ``rates[s]["strict"]``; kappas hold the lenient ``binary`` and
        ``labels8`` and the strict ones under ``strict``; differences hold ``corrected`` and ``corrected_strict``.
    Example:
        >>> rep = build_report(load_run_table(run), load_sample(run), load_labellers(run, sample))  # doctest: +SKIP
        >>> rep["rates"]["none"]["corrected"]["point"], rep["rates"]["none"]["strict"]["corrected"]["point"]  # doctest: +SKIP
    """
    check_report_args(alpha, n_boot)
    check_sample_judged(sample, table)
    rows = audit_rows(sample, table, labellers)
    names = [lab.name for lab in labellers]
    strata = sorted(table.strata(sample.by))
    rep: dict[str, Any] = {
        "sample": {"sample_id": sample.sample_id, "by": sample.by, "n": len(sample.record_ids), "seed": sample.seed,
                   "judges": list(sample.judges), "labels_changed_since_sample": table.labels_sha256 != sample.labels_sha256,
                   "turns_per_item": sample.turns_per_item, "codebook_version": sample.codebook_version},
        "codebook_version": CODEBOOK_VERSION,
        "readings": list(READINGS),
        "labellers": [{"name": lab.name, "kind": lab.kind, "n_labelled": len(lab.rows),
                       "borderline": sum(r.borderline for r in lab.rows),
                       "strict_given": sum(r.strict is not None for r in lab.rows),
                       "genuine": {rd: sum(label_under(r, rd) == GENUINE for r in lab.rows) for rd in READINGS}}
                      for lab in labellers],
        "assumptions": _ASSUMPTIONS, "alpha": alpha,
    }
    rep["inter_labeller"] = [{"a": a, "b": b, **_kappas(rows, a, b, n_boot, seed)}
                             for a, b in itertools.combinations(names, 2)]
    jvl: list[dict[str, Any]] = []
    for name in names:
        for s in [*strata, "all"]:
            sub = [r for r in rows if s == "all" or r.stratum == s]
            jvl.append({"labeller": name, "stratum": s, **_kappas(sub, name, None, n_boot, seed)})
    rep["judge_vs_labeller"] = jvl
    cols = [*LABELS, NO_MAJORITY]
    conf = {j: dict.fromkeys(cols, 0) for j in LABELS}
    for r in rows:
        if r.majority is not None:
            conf[r.judge_label][r.majority] += 1
    rep["confusion"] = {"rows": "judge", "columns": "labeller majority", "counts": conf}

    audited = {r.record_id: r for r in rows if r.consensus is not None}
    boot = max(2000, n_boot)
    rates: dict[str, Any] = {}
    for s, turns in table.strata(sample.by).items():
        rest = [t for t in turns if t.record_id not in audited]
        aud = [audited[t.record_id] for t in turns if t.record_id in audited]
        judge_u, items_u = [int(t.judge_genuine) for t in rest], [t.item_id for t in rest]
        judge_a = [int(r.judge_label == GENUINE) for r in aud]
        items_a = [r.item_id for r in aud]
        entry: dict[str, Any] = {
            "n_turns": len(turns), "n_items": len({t.item_id for t in turns}), "n_audited": len(aud),
            "n_audited_items": len(set(items_a)), "clustered": has_repeats([t.item_id for t in turns]),
            "unequal_turns_per_item": _unequal_turns(turns),
            "judge_only": judge_only_rate([int(t.judge_genuine) for t in turns], alpha,
                                          [t.item_id for t in turns], boot, seed).to_dict(),
            "judge_on_audited": judge_only_rate(judge_a, alpha, items_a, boot, seed).to_dict()}
        for reading in READINGS:
            block: dict[str, Any] = {
                "audited_genuine": sum(r.consensus_under(reading) or 0.0 for r in aud),
                "corrected": corrected_rate(judge_u, judge_a, [r.consensus_under(reading) for r in aud], alpha,
                                            items_u, items_a, boot, seed).to_dict(),
                "corrected_by_labeller": []}
            for name in names:
                mine = [r for r in aud if name in r.labels]
                others = [r for r in aud if name not in r.labels]
                est = corrected_rate(judge_u + [int(r.judge_label == GENUINE) for r in others],
                                     [int(r.judge_label == GENUINE) for r in mine],
                                     [int(r.labels_under(reading)[name] == GENUINE) for r in mine], alpha,
                                     items_u + [r.item_id for r in others], [r.item_id for r in mine], boot, seed)
                block["corrected_by_labeller"].append({"labeller": name, **est.to_dict()})
            if reading == LENIENT:
                entry.update(block)
            else:
                entry[reading] = block
        rates[s] = entry
    rep["rates"] = rates
    rep["differences"] = (_differences(table, sample, audited, alpha, seed, boot)
                          if sample.by.startswith("condition") else [])
    return rep


def _differences(table: TurnTable, sample: AuditSample, audited: dict[str, AuditRow], alpha: float,
                 seed: int, n_boot: int = 2000) -> list[dict[str, Any]]:
    """Paired condition-minus-``none`` differences, judge-only and corrected under both readings.

    One turn per item in both conditions (greedy steering): the judge-only paired bootstrap and PPI on per-item
    differences. Several turns of an item in either condition: a paired item bootstrap for both
    (:func:`mechprobe.stats.clustered.paired_cluster_bootstrap`, :func:`~mechprobe.stats.clustered.cluster_ppi_paired_difference`).
    """
    conds = table.strata("condition")
    if BASE_FOR_DIFFERENCES not in conds:
        return []

    def per_item(turns: list[Any]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in turns:
            out.setdefault(t.item_id, []).append(t.record_id)
        return out

    base = per_item(conds[BASE_FOR_DIFFERENCES])
    out = []
    for cond in sorted(conds):
        if cond == BASE_FOR_DIFFERENCES or cond.split(":")[0] == BASE_CONDITION:
            continue  # the probe's own turns are not a steering condition of the same items
        other = per_item(conds[cond])
        entry: dict[str, Any] = {"condition": cond, "base": BASE_FOR_DIFFERENCES}
        if all(len(v) == 1 for v in base.values()) and all(len(v) == 1 for v in other.values()):
            ja = {it: float(table.get(rids[0]).judge_genuine) for it, rids in base.items()}
            jb = {it: float(table.get(rids[0]).judge_genuine) for it, rids in other.items()}
            entry["judge_only"] = judge_only_difference(ja, jb, seed).to_dict()
            for reading in READINGS:
                def truth(m: dict[str, list[str]], rd: str = reading) -> dict[str, float]:
                    return {it: float(audited[r[0]].consensus_under(rd))  # type: ignore[arg-type]
                            for it, r in m.items() if r[0] in audited}
                key = "corrected" if reading == LENIENT else f"corrected_{reading}"
                entry[key] = corrected_paired_difference(ja, jb, truth(base), truth(other), alpha).to_dict()
        else:
            ja_l = {it: [float(table.get(r).judge_genuine) for r in rids] for it, rids in base.items()}
            jb_l = {it: [float(table.get(r).judge_genuine) for r in rids] for it, rids in other.items()}
            j = paired_cluster_bootstrap(ja_l, jb_l, alpha, n_boot, seed)
            entry["judge_only"] = Estimate(j.point, j.lo, j.hi, 0, "judge-only " + j.method, j.n_clusters).to_dict()
            for reading in READINGS:
                def pairs(m: dict[str, list[str]], rd: str = reading) -> dict[str, list[tuple[float, float]]]:
                    return {it: [(float(audited[r].consensus_under(rd)),  # type: ignore[arg-type]
                                  float(audited[r].judge_label == GENUINE)) for r in rids if r in audited]
                            for it, rids in m.items()}
                c = cluster_ppi_paired_difference(ja_l, jb_l, pairs(base), pairs(other), alpha, n_boot, seed)
                key = "corrected" if reading == LENIENT else f"corrected_{reading}"
                n_both = sum(1 for it in set(base) & set(other)
                             if any(r in audited for r in base[it]) and any(r in audited for r in other[it]))
                entry[key] = Estimate(c.point, c.lo, c.hi, n_both, c.method, c.n_clusters).to_dict()
        out.append(entry)
    return out


def _est(d: dict[str, Any]) -> str:
    return Estimate(**{k: v for k, v in d.items() if k != "labeller"}).cell()


def _md(s: str) -> str:
    """A markdown table cell: condition names such as ``diff_means|L14|a0.8`` contain pipes."""
    return s.replace("|", "\\|")


def _k(d: dict[str, Any], reading: str, kind: str) -> str:
    """A kappa cell under ``reading`` (reports written before the strict reading have only the lenient one)."""
    src = d if reading == LENIENT else d.get(reading)
    return Kappa(**src[kind]).cell() if src else "—"


def report_markdown(rep: dict[str, Any]) -> str:
    """Short markdown tables: "judge only" next to "corrected (n audited)" for every rate and difference, under the
    codebook's lenient and strict readings side by side, and each labeller's corrected rate beside the consensus."""
    s = rep["sample"]
    pct = round(100 * (1 - rep["alpha"]))
    version = rep.get("codebook_version", "v1")
    lines = [f"# Judge audit ({s['sample_id']})", "",
             f"Sample: {s['n']} turns by {s['by']}, seed {s['seed']}, at most "
             f"{s.get('turns_per_item') or 'all'} turn(s) per item and stratum; judge {', '.join(s['judges']) or '?'}; "
             f"codebook {version} (sheet drawn with {s.get('codebook_version', 'v1')}); "
             f"labellers: " + (", ".join(f"{lab['name']} ({lab['kind']}, {lab['n_labelled']} labelled, "
                                         f"{lab['borderline']} borderline, strict given on "
                                         f"{lab.get('strict_given', 0)})" for lab in rep["labellers"]) or "none"),
             ""]
    if s["labels_changed_since_sample"]:
        lines += ["**Note:** the run's judge labels changed since the sample was drawn; the audit compares "
                  "the labellers with the labels as they are now.", ""]
    if s.get("codebook_version", "v1") != version:
        lines += [f"**Note:** the sheet showed codebook {s.get('codebook_version', 'v1')}, this report reads the labels "
                  f"with {version}; labels without a strict entry use the rule for older files (strict = genuine and "
                  f"not borderline).", ""]
    lines += [f"## Follow-up rate per {s['by']} ({pct}% CIs)", "",
              "Lenient: the label as given. Strict: genuine only if coherent, in the user's voice and about something "
              "only the answer contains (codebook, \"Strict and lenient readings\").", "",
              f"| {s['by']} | turns | items | judge only | corrected (n audited), lenient | corrected, strict |",
              "|---|---|---|---|---|---|"]
    weak = clustered = False
    for k, r in rep["rates"].items():
        c = r["corrected"]
        st = r.get("strict", {}).get("corrected")
        mark = " †" if c["n_audited"] < 30 else ""
        weak = weak or bool(mark)
        clustered = clustered or bool(r.get("clustered"))
        lines.append(f"| {_md(k)} | {r['n_turns']} | {r.get('n_items', '?')} | {_est(r['judge_only'])} | "
                     f"{_est(c)} (n={c['n_audited']}){mark} | {_est(st) if st else '—'} |")
    if weak:
        lines += ["", "† fewer than 30 audited turns: the corrected interval is a large-sample approximation and can be "
                  "too narrow; audit more turns of that stratum."]
    if clustered:
        lines += ["", "Strata whose items hold several turns get item-cluster bootstrap intervals (items resampled "
                  "with all their turns); with no audited follow-up the interval includes the exact Clopper-Pearson one."]
    if any(r.get("unequal_turns_per_item") for r in rep["rates"].values()):
        lines += ["", "Some strata hold different numbers of turns per item: a sample of one turn per item gives the "
                  "turns of small items a larger chance to be audited."]
    if any(r.get("corrected_by_labeller") for r in rep["rates"].values()):
        lines += ["", "## Corrected rate per labeller (beside the consensus)", "",
                  f"| {s['by']} | labeller | lenient (n audited) | strict |", "|---|---|---|---|"]
        for k, r in rep["rates"].items():
            strict = {x["labeller"]: x for x in r.get("strict", {}).get("corrected_by_labeller", [])}
            for x in [{"labeller": "consensus", **r["corrected"]}, *r["corrected_by_labeller"]]:
                st = r.get("strict", {}).get("corrected") if x["labeller"] == "consensus" else strict.get(x["labeller"])
                lines.append(f"| {_md(k)} | {x['labeller']} | {_est(x)} (n={x['n_audited']}) | "
                             f"{_est(st) if st else '—'} |")
    if rep["differences"]:
        lines += ["", f"## Paired difference vs `{rep['differences'][0]['base']}` (same items)", "",
                  "| condition | items | judge only | corrected (n items audited in both), lenient | corrected, strict |",
                  "|---|---|---|---|---|"]
        for d in rep["differences"]:
            c = d["corrected"]
            st = d.get("corrected_strict")
            lines.append(f"| {_md(d['condition'])} | {d['judge_only']['n_total']} | {_est(d['judge_only'])} | "
                         f"{_est(c)} (n={c['n_audited']}) | {_est(st) if st else '—'} |")

    if rep["inter_labeller"]:
        lines += ["", "## Inter-labeller agreement (Cohen's kappa, item bootstrap)", "",
                  "| labellers | binary, lenient | binary, strict | 8-label, lenient | 8-label, strict |",
                  "|---|---|---|---|---|"]
        for k in rep["inter_labeller"]:
            lines.append(f"| {k['a']} vs {k['b']} | {_k(k, LENIENT, 'binary')} | {_k(k, STRICT, 'binary')} | "
                         f"{_k(k, LENIENT, 'labels8')} | {_k(k, STRICT, 'labels8')} |")
    if rep["judge_vs_labeller"]:
        lines += ["", f"## Judge vs labeller per {s['by']}", "",
                  f"| labeller | {s['by']} | binary, lenient | binary, strict | 8-label, lenient | 8-label, strict |",
                  "|---|---|---|---|---|---|"]
        for k in rep["judge_vs_labeller"]:
            lines.append(f"| {k['labeller']} | {_md(k['stratum'])} | {_k(k, LENIENT, 'binary')} | "
                         f"{_k(k, STRICT, 'binary')} | {_k(k, LENIENT, 'labels8')} | {_k(k, STRICT, 'labels8')} |")
    conf = rep["confusion"]["counts"]
    used = [c for c in [*LABELS, NO_MAJORITY] if any(conf[j][c] for j in conf)]
    if used:
        lines += ["", "## Confusion: judge (rows) x labeller majority (columns, lenient reading)", "",
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
    write_audit_text(md, report_markdown(rep))
    return md, js
