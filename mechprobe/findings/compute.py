"""Recompute every number a finding quotes from committed files: audits, post-training summaries, the labelled set.

Why: a finding's rate is only as good as the path from the labels to the quoted number. Every audit keeps its
sample (record ids), both labellers' labels and its report in ``reports/``; the run directories that held the
turns and the judge's verdicts per turn (``runs/``) are not committed. So what depends on the labels alone is
recomputed here with the package's own statistics (a stratum where every turn was audited, the labellers' kappa,
a steering difference where every item was audited in both conditions), and compared with the committed report:
a difference is a *mismatch*. What needs the judge's verdict per turn (judge-only rates, prediction-powered rates
of a partly audited stratum, judge-vs-labeller kappas) is read from the committed report and marked ``read``.

Intervals follow the audit: Wilson per turn where each item has one audited turn in a stratum (also at 0 of n),
the item-cluster bootstrap where an item has several (:mod:`mechprobe.stats.clustered`; its spread over five seeds
is kept beside it), and, for a difference between two conditions on the same items, both the audit's own
unpaired Newcombe interval (named so) and a paired item bootstrap. The re-labelled sets (``reports/relabel_v2``)
use Wilson with Clopper-Pearson at 0 or n, as their script does, and their kappas and judge rates are recomputed
from the per-turn ``evidence.jsonl``.

"Strict" is the codebook v2 reading only where the labels carry a ``strict`` field (every ``genuine_followup`` row
of every labeller). Label files without it get a different key, ``audited_unflagged``: both labellers say genuine
and neither ticks borderline, a stand-in that is never called strict.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mechprobe.audit.agreement import kappa_with_ci
from mechprobe.audit.blind_sets import load_blind_sets
from mechprobe.audit.estimate import audit_only_difference, audit_only_rate
from mechprobe.audit.judge_table import (
    ROUNDS_FILE,
    VERDICTS_FILE,
    judge_table,
    read_all_verdicts,
    round_groups,
)
from mechprobe.audit.labels import LabellerLabels, read_labellers_file
from mechprobe.audit.readings import STRICT, genuine_under
from mechprobe.audit.sample import AuditSample
from mechprobe.errors import UsageError
from mechprobe.io import finite, read_json
from mechprobe.stats import wilson
from mechprobe.stats.clustered import clopper_pearson, paired_cluster_bootstrap
from mechprobe.taxonomy import GENUINE

from .interventions import intervention_values
from .values import PERCENT, RAW, READ, RECOMPUTED, Value

__all__ = ["AUDITS", "POST_TRAIN_AUDITS", "Findings", "compute_findings", "findings_markdown", "findings_json",
           "audit_record_item", "audit_strata", "short_name", "load_audit", "KNOWN_MISMATCHES", "FEW_ITEMS"]

# finding name -> committed audit folder (sample.json, labels/*.json, report.json)
AUDITS: dict[str, str] = {
    "gsm8k_1.5b": "reports/audit/qwen2.5-coder-1.5b-instruct-gsm8k",
    "mt_bench_1.5b": "reports/audit/qwen2.5-coder-1.5b-instruct-mt_bench",
    "steering_1.5b": "reports/audit/qwen2.5-coder-1.5b-instruct-gsm8k-steering",
    "gsm8k_0.5b": "reports/audit/qwen2.5-coder-0.5b-instruct-gsm8k",
    "mt_bench_0.5b": "reports/audit/qwen2.5-coder-0.5b-instruct-mt_bench",
}
POST_TRAIN = "post_train_0.5b"
POST_TRAIN_PREFIX = "reports/post_train/qwen2.5-coder-0.5b-instruct"
# post-training arm -> its audit folder (sample.json, labeller-*.csv, report.md); "pairs" is the DPO pairs run
POST_TRAIN_AUDITS: dict[str, str] = {arm: f"{POST_TRAIN_PREFIX}_audit/{d}-gsm8k"
                                     for arm, d in (("base", "base"), ("sft", "post"), ("dpo", "dpo"),
                                                    ("pairs", "pairs"))}
RELABEL_DIR = "reports/relabel_v2"
LABELLED_SET = "reports/labelled_turns"
JUDGE_TABLE = "reports/judge/table.json"
BASE = "none"  # the unsteered condition of a steering audit
ALPHA = 0.05
N_BOOT_KAPPA, N_BOOT_RATE, SEED = 500, 2000, 0  # what `mechprobe audit` uses, so a recomputation is draw for draw
N_BOOT_PAIRED, SEEDS = 20000, (0, 1, 2, 3, 4)  # the paired item bootstrap; seeds over which a spread is kept
FEW_ITEMS = 20  # an estimate on fewer items says so beside it (the docs check enforces it)
# Recomputed numbers that differ from the committed report they reproduce, and why the difference is understood.
# Any other mismatch fails `mechprobe findings --check`.
_KAPPA_REPORT = ("the committed report.json's kappa bootstrap interval was drawn by an earlier version of the "
                 "kappa bootstrap; kappa and agreements are equal, the interval's ends differ in the third "
                 "decimal; the recomputed interval is the one quoted")
KNOWN_MISMATCHES: dict[str, str] = {
    f"{a}.kappa.labellers.{k}": _KAPPA_REPORT for a in ("gsm8k_0.5b", "mt_bench_0.5b") for k in ("binary", "labels8")}
TOLERANCE = 1e-6  # a recomputed number and the committed report's may differ by float noise, not more
ROUNDED_TOLERANCE = 0.005 + 1e-9  # against a report.md that shows two decimals


@dataclass
class Findings:
    """Every value under its key, the notes (what was skipped and why), and the mismatches with committed reports."""

    values: dict[str, Value] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def add(self, v: Value) -> None:
        if v.key in self.values:
            raise ValueError(f"two findings under one key {v.key!r}")
        self.values[v.key] = v

    def compare(self, v: Value, committed: dict[str, Any] | None, where: str) -> None:
        """Record a mismatch when the recomputed ``v`` differs from the committed estimate (point, lo, hi)."""
        if committed is None:
            return
        got = (v.point, v.lo, v.hi)
        want = (committed.get("point", committed.get("kappa")), committed.get("lo"), committed.get("hi"))
        tol = ROUNDED_TOLERANCE if committed.get("rounded") else TOLERANCE
        for g, w in zip(got, want):
            if g is None or w is None:
                continue
            both_nan = not math.isfinite(g) and not math.isfinite(w)
            if not both_nan and not (math.isfinite(g) and math.isfinite(w) and abs(g - w) <= tol):
                line = f"{v.key}: recomputed {v.text()}, {where} says {_fmt_committed(committed, v.unit)}"
                if v.key in KNOWN_MISMATCHES:
                    self.notes.append(f"known difference: {line} ({KNOWN_MISMATCHES[v.key]})")
                else:
                    self.mismatches.append(line)
                return


def _fmt_committed(c: dict[str, Any], unit: str) -> str:
    point = c.get("point", c.get("kappa"))
    scale = 100 if unit == PERCENT else 1
    lo, hi = c.get("lo"), c.get("hi")
    ci = f" [{scale * lo:.4g}, {scale * hi:.4g}]" if lo is not None and hi is not None else ""
    return f"{scale * point:.4g}{unit}{ci}"


def short_name(model: str, dataset: str) -> str:
    """``mt_bench_1.5b`` for (``qwen2.5-coder-1.5b-instruct``, ``mt_bench``): the finding's name in keys."""
    m = re.search(r"(?<![0-9.])(\d+(?:\.\d+)?[bm])(?![a-z])", model.lower())
    return f"{dataset}_{m.group(1) if m else model}"


def _key_part(stratum: str) -> str:
    """A stratum as a key segment: ``diff_means|L18|a0.2`` -> ``diff_means_L18_a0.2``."""
    return re.sub(r"[|/ ]+", "_", stratum)


def audit_record_item(record_id: str) -> str:
    """The item of an audited record id: ``gsm8k-0012|T1|s3`` (probe turn) or ``steering.../alpha_...jsonl#gsm8k-0603``
    (steered turn); the same item the run's table gave it."""
    return record_id.rsplit("#", 1)[1] if "#" in record_id else record_id.split("|", 1)[0]


def audit_strata(sample: AuditSample) -> dict[str, list[str]]:
    """Stratum -> its record ids. ``draw_sample`` writes the record ids stratum by stratum in sorted stratum order,
    ``per_stratum[s]`` of each, so the sample alone gives every turn's stratum."""
    out, i = {}, 0
    for s in sorted(sample.per_stratum):
        out[s] = list(sample.record_ids[i:i + sample.per_stratum[s]])
        i += sample.per_stratum[s]
    if i != len(sample.record_ids):
        raise UsageError(f"sample {sample.sample_id}: per_stratum adds up to {i}, not its {len(sample.record_ids)} "
                         f"record ids; the sample file is not one `mechprobe audit` wrote")
    return out


def load_audit(folder: Path) -> tuple[AuditSample, list[LabellerLabels]]:
    """An audit folder's sample and labellers (``labels/*.json`` as `mechprobe audit` stores them, or the
    ``labeller-*.csv`` files a post-training audit keeps), in name order."""
    sample = AuditSample.from_dict(read_json(folder / "sample.json"))
    labs: list[LabellerLabels] = []
    for p in sorted((folder / "labels").glob("*.json")):
        labs.append(LabellerLabels.from_dict(read_json(p), str(p)))
    for p in sorted(folder.glob("labeller-*.csv")):
        labs += read_labellers_file(p, kind="model")
    if len(labs) < 2:
        raise UsageError(f"{folder}: {len(labs)} labeller file(s); an audit finding needs two")
    return sample, sorted(labs, key=lambda lab: lab.name)


def _joined(sample: AuditSample, labs: list[LabellerLabels]) -> dict[str, dict[str, str]]:
    """record id -> {labeller: label} for every sampled turn (a labeller who skipped a turn is absent from it)."""
    by = [(lab.name, lab.by_row()) for lab in labs]
    return {rid: {name: rows[sample.row_key(rid)].label for name, rows in by if sample.row_key(rid) in rows}
            for rid in sample.record_ids}


UNFLAGGED = "audited_unflagged"  # key suffix of the stand-in: both genuine, neither borderline (never "strict")
STRICT_KEY = "audited_strict"  # key suffix of the codebook v2 strict reading (labels with a strict field)


def has_strict_field(labs: list[LabellerLabels]) -> bool:
    """Every labeller gave the codebook v2 ``strict`` entry on every row it labelled ``genuine_followup``."""
    rows = [r for lab in labs for r in lab.rows if r.label == GENUINE]
    return bool(rows) and all(r.strict is not None for r in rows)


def _both_genuine(sample: AuditSample, labs: list[LabellerLabels]) -> tuple[str, dict[str, float]]:
    """(key suffix, record id -> 1.0 when every labeller calls the turn genuine under it, else 0.0).

    With a ``strict`` field on every genuine row the reading is the codebook's strict one (:data:`STRICT_KEY`);
    without it, the stand-in "genuine and not ticked borderline" (:data:`UNFLAGGED`). Only turns every labeller
    labelled count.
    """
    strict = has_strict_field(labs)
    by = [lab.by_row() for lab in labs]
    out: dict[str, float] = {}
    for rid in sample.record_ids:
        rows = [rows_of.get(sample.row_key(rid)) for rows_of in by]
        if all(r is not None for r in rows):
            out[rid] = float(all(genuine_under(r, STRICT) if strict else (r.label == GENUINE and not r.borderline)
                                 for r in rows))
    return (STRICT_KEY if strict else UNFLAGGED), out


def _items(rids: Iterable[str]) -> int:
    return len({audit_record_item(r) for r in rids})


def _seed_spread(y: list[float], items: list[str]) -> float | None:
    """Largest move of an item-cluster bootstrap interval's ends over :data:`SEEDS` (None: no bootstrap)."""
    if len(set(items)) == len(items):
        return None
    ends = [audit_only_rate(y, ALPHA, items, N_BOOT_RATE, s) for s in SEEDS]
    return max(max(e.lo for e in ends) - min(e.lo for e in ends), max(e.hi for e in ends) - min(e.hi for e in ends))


def _add_both(out: Findings, key: str, rids: list[str], both: dict[str, float], source: str) -> None:
    """The rate of one stratum under the both-labellers reading (item-clustered where items repeat)."""
    y = [both[r] for r in rids if r in both]
    items = [audit_record_item(r) for r in rids if r in both]
    if y:
        est = audit_only_rate(y, ALPHA, items, N_BOOT_RATE, SEED).to_dict()
        if key.endswith(UNFLAGGED):
            est["method"] = f"both labellers genuine, neither borderline (no strict field); {est.get('method', '')}"
        out.add(replace(_est(key, est, RECOMPUTED, source, sum(y), len(y)), items=len(set(items)),
                        seed_spread=_seed_spread(y, items)))


def _consensus(labels: dict[str, str]) -> float | None:
    return sum(x == GENUINE for x in labels.values()) / len(labels) if labels else None


def _est(key: str, est: dict[str, Any], how: str, source: str, k: float | None = None, n: int | None = None,
         signed: bool = False) -> Value:
    """A Value from an :class:`~mechprobe.audit.estimate.Estimate` dict (``point``, ``lo``, ``hi``, ``method``)."""
    return Value(key, float(est["point"]), _f(est.get("lo")), _f(est.get("hi")), k, n, PERCENT, how, source,
                 str(est.get("method", "")), signed)


def _f(x: Any) -> float | None:
    return None if x is None else float(x)


def _paired(key: str, a: dict[str, float], b: dict[str, float], source: str) -> Value:
    """``rate(b) - rate(a)`` over the items audited in both, with a paired item bootstrap (:data:`N_BOOT_PAIRED`
    draws, seed 0) and the largest move of its ends over :data:`SEEDS`."""
    aa, bb = {i: [y] for i, y in a.items()}, {i: [y] for i, y in b.items()}
    runs = [paired_cluster_bootstrap(aa, bb, ALPHA, N_BOOT_PAIRED, s) for s in SEEDS]
    c = runs[0]
    spread = max(max(r.lo for r in runs) - min(r.lo for r in runs), max(r.hi for r in runs) - min(r.hi for r in runs))
    return Value(key, float(c.point), float(c.lo), float(c.hi), None, None, PERCENT, RECOMPUTED, source,
                 f"{c.method}, {N_BOOT_PAIRED} draws, seed {SEEDS[0]}", True, c.n_clusters, float(spread))


def read_text(path: Path) -> str:
    """A committed text file, or a one-line :class:`UsageError` naming it when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 (byte {e.start}: {e.reason}); restore the committed file") from None


def _kappa_value(key: str, k: dict[str, Any], how: str, source: str) -> Value:
    return Value(key, float(k["kappa"]) if k.get("kappa") is not None else float("nan"), _f(k.get("lo")),
                 _f(k.get("hi")), k.get("agree"), k.get("n"), RAW, how, source,
                 "cohen kappa, item bootstrap" if how == RECOMPUTED else "")


def _labeller_kappas(out: Findings, prefix: str, sample: AuditSample, labs: list[LabellerLabels],
                     joined: dict[str, dict[str, str]], source: str, committed: dict[str, Any] | None,
                     where: str) -> None:
    """Binary and 8-label kappa of the first two labellers on the turns both labelled, as the report computes them."""
    a, b = labs[0].name, labs[1].name
    rids = [r for r in sample.record_ids if a in joined[r] and b in joined[r]]
    xa, xb = [joined[r][a] for r in rids], [joined[r][b] for r in rids]
    items = [audit_record_item(r) for r in rids]
    for kind, binary in (("binary", True), ("labels8", False)):
        k = kappa_with_ci(xa, xb, items, binary, N_BOOT_KAPPA, SEED, ALPHA).to_dict()
        v = _kappa_value(f"{prefix}.kappa.labellers.{kind}", k, RECOMPUTED, source)
        out.add(v)
        out.compare(v, (committed or {}).get(kind), where)


def _audit(out: Findings, root: Path, name: str, rel: str) -> None:
    folder = root / rel
    if not (folder / "sample.json").exists():
        out.notes.append(f"{name}: {rel}/sample.json not found; skipped")
        return
    sample, labs = load_audit(folder)
    joined = _joined(sample, labs)
    suffix, both = _both_genuine(sample, labs)
    strata = audit_strata(sample)
    rep_path = folder / "report.json"
    rep = read_json(rep_path) if rep_path.exists() else {}
    where = f"{rel}/report.json"
    src_labels = f"{rel}/sample.json + {rel}/labels/"
    rates = rep.get("rates", {})
    audit_by_item: dict[str, dict[str, float]] = {}
    for s, rids in strata.items():
        ks = _key_part(s)
        aud = [(r, _consensus(joined[r])) for r in rids if joined[r]]
        y = [c for _, c in aud if c is not None]
        items = [audit_record_item(r) for r, _ in aud]
        audit_by_item[s] = {audit_record_item(r): c for r, c in aud if c is not None}
        est = audit_only_rate(y, ALPHA, items, N_BOOT_RATE, SEED).to_dict()
        out.add(replace(_est(f"{name}.{ks}.audited", est, RECOMPUTED, src_labels, sum(y), len(y)),
                        items=len(set(items)), seed_spread=_seed_spread(y, items)))
        _add_both(out, f"{name}.{ks}.{suffix}", rids, both, src_labels)
        r = rates.get(s)
        if r is None:
            out.notes.append(f"{name}.{ks}: no report.json rate; judge-only and corrected rates not available")
            continue
        n_turns = int(r["n_turns"])
        if len(y) == n_turns:  # every turn audited: the corrected rate is the audit's own, from the labels alone
            v = replace(_est(f"{name}.{ks}.corrected", est, RECOMPUTED, src_labels, sum(y), len(y)),
                        items=len(set(items)), seed_spread=_seed_spread(y, items))
            out.compare(v, r["corrected"], where)
        else:
            v = _est(f"{name}.{ks}.corrected", r["corrected"], READ, where, n=None)
        out.add(v)
        jo = r["judge_only"]
        out.add(_est(f"{name}.{ks}.judge_only", jo, READ, where, _judge_k(jo, n_turns), n_turns))
    _judge_summary(out, name, folder, rel)
    inter = rep.get("inter_labeller") or [{}]
    _labeller_kappas(out, name, sample, labs, joined, src_labels, inter[0], where)
    for j in rep.get("judge_vs_labeller", []):
        for kind in ("binary", "labels8"):
            out.add(_kappa_value(f"{name}.kappa.judge_vs_{j['labeller']}.{_key_part(j['stratum'])}.{kind}",
                                 j[kind], READ, where))
    for d in rep.get("differences", []):
        cond, base = d["condition"], d["base"]
        key = f"{name}.{_key_part(cond)}.vs_{_key_part(base)}"
        a, b = audit_by_item.get(base, {}), audit_by_item.get(cond, {})
        every = (rates.get(base, {}).get("n_turns") == len(a) and rates.get(cond, {}).get("n_turns") == len(b)
                 and set(a) == set(b))
        if every:  # every item audited in both conditions: the audit's own difference
            est = audit_only_difference(a, b, ALPHA).to_dict()
            est["method"] = "unpaired Newcombe hybrid score (ignores the pairing: conservative)"
            v = replace(_est(f"{key}.corrected", est, RECOMPUTED, src_labels, signed=True), items=len(a))
            out.compare(v, d["corrected"], where)
            out.add(_paired(f"{key}.paired", a, b, src_labels))
        else:
            v = _est(f"{key}.corrected", d["corrected"], READ, where, signed=True)
        out.add(v)
        out.add(_est(f"{key}.judge_only", d["judge_only"], READ, where, signed=True))


_SUMMARY_ROW = re.compile(r"^\| (?P<dec>greedy|sample) \| (?P<t>[\d.]+) \| (?P<n>\d+) \| (?P<p>\d+\.\d)% \| "
                          r"\[(?P<lo>\d+\.\d)%, (?P<hi>\d+\.\d)%\] \|")


def _judge_summary(out: Findings, name: str, folder: Path, rel: str) -> None:
    """The run's judge summary (``judge_summary.md``: judge only, turns after a capped answer left out), read."""
    p = folder / "judge_summary.md"
    if not p.exists():
        return
    for line in read_text(p).splitlines():
        m = _SUMMARY_ROW.match(line.strip())
        if m:
            n, point = int(m["n"]), float(m["p"]) / 100
            k = round(point * n)
            stratum = "greedy" if m["dec"] == "greedy" else f"T{float(m['t']):g}"
            out.add(Value(f"{name}.{stratum}.judge_summary", point, float(m["lo"]) / 100, float(m["hi"]) / 100,
                          k if abs(point * n - k) <= 0.0005 * n + 1e-9 else None, n, PERCENT, READ,
                          f"{rel}/judge_summary.md", "judge-only wilson, turns after a capped answer left out"))


def _judge_k(est: dict[str, Any], n: int) -> int | None:
    """The judge's count behind a judge-only rate (a whole number of turns), when the point gives one."""
    k = float(est["point"]) * n if est.get("point") is not None else float("nan")
    if not math.isfinite(k):
        return None
    return int(round(k)) if abs(k - round(k)) < 1e-6 else None


_MD_KAPPA = re.compile(r"^\| (?P<lab>labeller-\S+) \| (?P<s>\S+) \| (?P<b>-?\d\.\d+) \[(?P<blo>-?\d\.\d+), "
                       r"(?P<bhi>-?\d\.\d+)\] \((?P<ba>\d+)/(?P<bn>\d+) agree\) \| (?P<l>-?\d\.\d+) \[(?P<llo>-?\d\.\d+), "
                       r"(?P<lhi>-?\d\.\d+)\] \((?P<la>\d+)/(?P<ln>\d+) agree\) \|$")
_MD_RATE = re.compile(r"^\| (?P<s>\S+) \| (?P<n>\d+) \| (?P<p>\d+\.\d)% \[(?P<lo>\d+\.\d)%, (?P<hi>\d+\.\d)%\] \| ")


def _post_train(out: Findings, root: Path) -> None:
    """The 0.5B post-training findings: eval summaries (read), and each audit's labeller kappa and audited rates."""
    sft, dpo = root / f"{POST_TRAIN_PREFIX}_eval_summary.json", root / f"{POST_TRAIN_PREFIX}_dpo_eval_summary.json"
    for path, arms in ((sft, {"base": "base", "post": "sft"}), (dpo, {"dpo": "dpo"})):
        if not path.exists():
            out.notes.append(f"{POST_TRAIN}: {path.relative_to(root)} not found; its arms skipped")
            continue
        rel = path.relative_to(root).as_posix()
        summ = read_json(path)
        for arm, name in arms.items():
            g = summ["arms"][arm]["gsm8k"]
            for dec in ("greedy", "sample"):
                f = g["followup"][dec]
                out.add(Value(f"{POST_TRAIN}.{name}.{dec}.judge_only", f["rate"], f["ci"][0], f["ci"][1], f["k"],
                              f["n"], PERCENT, READ, rel, "judge-only wilson"))
                if "corrected" in g:
                    out.add(_est(f"{POST_TRAIN}.{name}.{dec}.corrected", g["corrected"][dec], READ, rel))
            acc = g["accuracy"]
            out.add(Value(f"{POST_TRAIN}.{name}.accuracy", acc["rate"], acc["ci"][0], acc["ci"][1], acc["k"],
                          acc["n"], PERCENT, READ, rel, "wilson"))
            if arm == "base":
                continue
            for dec, pair in summ.get("corrected_paired", {}).get(f"base vs {arm}", {}).get("gsm8k", {}).items():
                for kind in ("corrected", "judge_only"):
                    out.add(_est(f"{POST_TRAIN}.{name}.vs_base.{dec}.{kind}", pair[kind], READ, rel, signed=True))
            for m in summ.get("paired", {}).get(f"base vs {arm}", {}).get("gsm8k", []):
                out.add(Value(f"{POST_TRAIN}.{name}.vs_base.{m['decoding']}.mcnemar_p", float(m["p"]), unit=RAW,
                              how=READ, source=rel, method=f"exact McNemar, judge only: +{m['only_b']}/-{m['only_a']} "
                                                           f"of {m['n']} items"))
            for b in summ.get("boundary_shift", {}).get(f"{arm} gsm8k", []):
                out.add(Value(f"{POST_TRAIN}.{name}.boundary_shift.L{b['layer']}", float(b["shift_gap"]),
                              float(b["ci_gap"][0]), float(b["ci_gap"][1]), unit=RAW, how=READ, source=rel,
                              method="shift along the base arm's genuine-minus-other direction, in class gaps",
                              signed=True))
        if path == dpo:
            pairs = summ.get("judge_error_on_pairs") or read_json(root / f"{POST_TRAIN_PREFIX}_dpo_pairs_manifest.json"
                                                                   ).get("judge_error_on_pairs")
            if pairs:
                for k in ("chosen_not_genuine", "rejected_genuine", "pairs_wrong_order"):
                    x = pairs[k]
                    out.add(Value(f"{POST_TRAIN}.pairs.{k}", x["rate"], x["ci"][0], x["ci"][1], x["k"], x["n"],
                                  PERCENT, READ, rel, "wilson (clopper-pearson at 0 or n)"))
    for arm, rel in POST_TRAIN_AUDITS.items():
        folder = root / rel
        if not (folder / "sample.json").exists():
            out.notes.append(f"{POST_TRAIN}.{arm}: {rel}/sample.json not found; skipped")
            continue
        sample, labs = load_audit(folder)
        joined = _joined(sample, labs)
        src = f"{rel}/sample.json + {rel}/labeller-*.csv"
        md = read_text(folder / "report.md") if (folder / "report.md").exists() else ""
        for s, rids in audit_strata(sample).items():
            y = [c for c in (_consensus(joined[r]) for r in rids) if c is not None]
            items = [audit_record_item(r) for r in rids if joined[r]]
            est = audit_only_rate(y, ALPHA, items, N_BOOT_RATE, SEED).to_dict()
            out.add(replace(_est(f"{POST_TRAIN}.{arm}.{_key_part(s)}.audited", est, RECOMPUTED, src, sum(y), len(y)),
                            items=len(set(items)), seed_spread=_seed_spread(y, items)))
            suffix, both = _both_genuine(sample, labs)
            _add_both(out, f"{POST_TRAIN}.{arm}.{_key_part(s)}.{suffix}", rids, both, src)
        _labeller_kappas(out, f"{POST_TRAIN}.{arm}", sample, labs, joined, src, _md_inter(md), f"{rel}/report.md")
        for line in md.splitlines():
            m = _MD_KAPPA.match(line.strip())
            if m:
                for kind, p in (("binary", "b"), ("labels8", "l")):
                    out.add(Value(f"{POST_TRAIN}.{arm}.kappa.judge_vs_{m['lab']}.{m['s']}.{kind}", float(m[p]),
                                  float(m[p + "lo"]), float(m[p + "hi"]), int(m[p + "a"]), int(m[p + "n"]), RAW,
                                  READ, f"{rel}/report.md", "rounded to 2 decimals in the report"))
            m = _MD_RATE.match(line.strip())
            if m:
                out.add(Value(f"{POST_TRAIN}.{arm}.{m['s']}.judge_only.all_turns", float(m["p"]) / 100,
                              float(m["lo"]) / 100, float(m["hi"]) / 100, None, int(m["n"]), PERCENT, READ,
                              f"{rel}/report.md", "judge-only wilson over every judged turn, rounded in the report"))


def _md_inter(md: str) -> dict[str, Any] | None:
    """The inter-labeller kappas of a report.md (two decimals): compared with the recomputed ones at that precision."""
    m = re.search(r"^\| labeller-\S+ vs labeller-\S+ \| (-?\d\.\d+) \[(-?\d\.\d+), (-?\d\.\d+)\] .*?\| "
                  r"(-?\d\.\d+) \[(-?\d\.\d+), (-?\d\.\d+)\]", md, flags=re.M)
    if not m:
        return None
    g = [float(x) for x in m.groups()]
    return {"binary": {"kappa": g[0], "lo": g[1], "hi": g[2], "rounded": True},
            "labels8": {"kappa": g[3], "lo": g[4], "hi": g[5], "rounded": True}}


def _rate_of(flags: list[bool]) -> dict[str, Any]:
    """scripts/relabel_set.py's rate: Wilson, Clopper-Pearson at 0 or n (one turn per item there)."""
    k, n = sum(flags), len(flags)
    lo, hi = clopper_pearson(k, n, ALPHA) if k in (0, n) else wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci": [lo, hi]}


def _rate_value(key: str, r: dict[str, Any], how: str, source: str, items: int | None = None) -> Value:
    return Value(key, float(r["rate"]), float(r["ci"][0]), float(r["ci"][1]), r["k"], r["n"], PERCENT, how, source,
                 "wilson (clopper-pearson at 0 or n)", items=items)


def _relabel(out: Findings, root: Path) -> None:
    """Each ``reports/relabel_v2/<model>-<dataset>/``: every rate and kappa recomputed from its per-turn
    ``evidence.jsonl`` (labels_v2 with their ``strict_label``, labels_v1, the judge's committed verdicts) and
    compared with its report.json; without evidence.jsonl the report's numbers are read.

    The answer-identification shares of that report are not findings (the distractor is a number-changed copy,
    so they measure numbers, not a reaction to the answer) and are left out.
    """
    base = root / RELABEL_DIR
    for folder in sorted(p for p in base.glob("*") if p.is_dir()) if base.is_dir() else []:
        rel = folder.relative_to(root).as_posix()
        if not (folder / "key.json").exists():
            continue
        key = read_json(folder / "key.json")
        name = f"relabel_v2.{short_name(key['model'], key['dataset'])}"
        if not (folder / "report.json").exists():
            out.notes.append(f"{name}: {rel}/report.json not there yet (labelling in progress); skipped")
            continue
        rep = read_json(folder / "report.json")
        rows = _jsonl(folder / "evidence.jsonl") if (folder / "evidence.jsonl").exists() else None
        ev = _relabel_evidence(rows) if rows else None
        src = f"{rel}/evidence.jsonl"
        for cond, cell in rep["by_condition"].items():
            for reading in ("lenient", "strict"):
                if reading not in cell:
                    continue
                block = cell[reading]
                mine = ev.get(cond, {}).get(reading) if ev else None
                for who, r in [*block["per_labeller"].items(), ("both", block["both"]), ("either", block["either"])]:
                    k = f"{name}.{_key_part(cond)}.{reading}.{who}"
                    if mine is not None and who in mine:
                        v = _rate_value(k, mine[who], RECOMPUTED, src, mine[who]["n"])
                        out.compare(v, {"point": r["rate"], "lo": r["ci"][0], "hi": r["ci"][1]}, f"{rel}/report.json")
                    else:
                        v = _rate_value(k, r, READ, f"{rel}/report.json")
                    out.add(v)
            for extra in ("v1_lenient_both", "judge_only"):
                if extra not in cell:
                    continue
                k = f"{name}.{_key_part(cond)}.{extra}"
                mine = ev.get(cond, {}).get(extra) if ev else None
                if mine is not None:
                    v = _rate_value(k, mine, RECOMPUTED, src, mine["n"])
                    r = cell[extra]
                    out.compare(v, {"point": r["rate"], "lo": r["ci"][0], "hi": r["ci"][1]}, f"{rel}/report.json")
                else:
                    v = _rate_value(k, cell[extra], READ, f"{rel}/report.json")
                out.add(v)
        kappas = _relabel_kappas(rows) if rows else {}
        for reading, ks in rep.get("kappa", {}).items():
            for who, committed in (ks.items() if isinstance(ks, dict) else [("", ks)]):
                k = f"{name}.kappa.{reading}" + (f".{who}" if who else "")
                mine_k = kappas.get(k[len(name) + 1:])
                if mine_k is not None:
                    v = replace(mine_k, key=k, source=src)
                    out.compare(v, {"kappa": committed}, f"{rel}/report.json")
                else:
                    v = Value(k, float(committed), unit=RAW, how=READ, source=f"{rel}/report.json",
                              method="cohen kappa")
                out.add(v)


def _relabel_evidence(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """condition -> reading -> labeller|both|either -> rate, and condition -> v1_lenient_both | judge_only -> rate,
    from a relabel evidence.jsonl (``labels_v2``, ``labels_v1``, ``judge``)."""
    out: dict[str, dict[str, Any]] = {}
    for cond in sorted({r["condition"] for r in rows}):
        sub = [r for r in rows if r["condition"] == cond]
        names = sorted(sub[0]["labels_v2"])
        out[cond] = {}
        for reading, fld in (("lenient", "label"), ("strict", "strict_label")):
            calls = {n: [r["labels_v2"][n][fld] == GENUINE for r in sub] for n in names}
            cell = {n: _rate_of(c) for n, c in calls.items()}
            cell["both"] = _rate_of([all(calls[n][i] for n in names) for i in range(len(sub))])
            cell["either"] = _rate_of([any(calls[n][i] for n in names) for i in range(len(sub))])
            out[cond][reading] = cell
        if all("labels_v1" in r for r in sub):
            out[cond]["v1_lenient_both"] = _rate_of([all(x["label"] == GENUINE for x in r["labels_v1"].values())
                                                     for r in sub])
        judged = [r["judge"]["label"] for r in sub if (r.get("judge") or {}).get("label") is not None]
        if judged:
            out[cond]["judge_only"] = _rate_of([x == GENUINE for x in judged])
    return out


def _relabel_kappas(rows: list[dict[str, Any]]) -> dict[str, Value]:
    """Binary kappas of a relabel evidence.jsonl, under the keys its report.json uses: labeller vs labeller over
    every turn, the judge vs each labeller over the judged turns, per reading, and the v1 labellers'."""
    out: dict[str, Value] = {}
    names = sorted(rows[0]["labels_v2"])
    items = [r.get("item_id", r["turn_id"]) for r in rows]  # one turn per item where no item is given

    def put(k: str, a: list[str], b: list[str], its: list[str]) -> None:
        est = kappa_with_ci(a, b, its, True, N_BOOT_KAPPA, SEED, ALPHA).to_dict()
        out[k] = replace(_kappa_value(k, est, RECOMPUTED, ""), items=len(set(its)))

    for reading, fld in (("lenient", "label"), ("strict", "strict_label")):
        lab = {n: [r["labels_v2"][n][fld] for r in rows] for n in names}
        if len(names) >= 2:
            put(f"kappa.{reading}.labellers", lab[names[0]], lab[names[1]], items)
        judged = [i for i, r in enumerate(rows) if (r.get("judge") or {}).get("label") is not None]
        for n in names:
            put(f"kappa.{reading}.judge_vs_{n}", [rows[i]["judge"]["label"] for i in judged],
                [lab[n][i] for i in judged], [items[i] for i in judged])
    if all("labels_v1" in r for r in rows):
        v1 = sorted(rows[0]["labels_v1"])
        if len(v1) >= 2:
            put("kappa.v1_lenient_labellers", [r["labels_v1"][v1[0]]["label"] for r in rows],
                [r["labels_v1"][v1[1]]["label"] for r in rows], items)
    return out


def _judge_table(out: Findings, root: Path) -> None:
    """The judge table's test cells and each fit's once-scored test cells (all datasets), recomputed from the committed blind labels and verdicts
    (:mod:`mechprobe.audit.judge_table`) and compared with the committed ``reports/judge/table.json``."""
    vfile = root / VERDICTS_FILE
    if not vfile.exists():
        out.notes.append(f"judge_table: {VERDICTS_FILE} not found (run mechprobe judges evaluate); skipped")
        return
    blind = load_blind_sets(root)
    committed = {}
    if (root / JUDGE_TABLE).exists():
        committed = {r["finding"]: r for r in read_json(root / JUDGE_TABLE)["rows"] if r["dataset"] == "all"}
    rows = judge_table(blind, read_all_verdicts(root) + blind.verdicts, splits=("test",), n_boot=N_BOOT_KAPPA,
                       seed=SEED, groups=round_groups(root / ROUNDS_FILE))
    for r in rows:
        if r["dataset"] != "all":
            continue
        nan = float("nan")
        v = Value(r["finding"], nan if r["kappa"] is None else r["kappa"], nan if r["lo"] is None else r["lo"],
                  nan if r["hi"] is None else r["hi"], r["agree"], r["n"], RAW, RECOMPUTED,
                  f"{VERDICTS_FILE} + the blind-labelled sets", "cohen kappa, binary; item bootstrap",
                  items=r["items"])
        c = committed.get(r["finding"])
        if c is not None and c["kappa"] is not None:
            out.compare(v, {"kappa": c["kappa"], "lo": c["lo"], "hi": c["hi"]}, JUDGE_TABLE)
        out.add(v)


def _labelled_set(out: Findings, root: Path) -> None:
    """Labeller a vs b kappa on the committed labelled set, overall and per subject model (as in its labels.md)."""
    d = root / LABELLED_SET
    if not (d / "turns.jsonl").exists():
        out.notes.append(f"labelled_set: {LABELLED_SET}/turns.jsonl not found; skipped")
        return
    turns = {r["turn_id"]: r for r in _jsonl(d / "turns.jsonl")}
    a, b = ({r["row"]: r for r in read_json(d / "labels" / f"{n}.json")["rows"]} for n in ("labeller-a", "labeller-b"))
    both = sorted(a.keys() & b.keys())
    src = f"{LABELLED_SET}/turns.jsonl + {LABELLED_SET}/labels/"
    for m in ["all", *sorted({r["model"] for r in turns.values()})]:
        ids = [t for t in both if m == "all" or turns[t]["model"] == m]
        items = [turns[t]["item_key"] for t in ids]
        la, lb = [a[t]["label"] for t in ids], [b[t]["label"] for t in ids]
        for kind, binary in (("binary", True), ("labels8", False)):
            k = kappa_with_ci(la, lb, items, binary).to_dict()
            who = "all" if m == "all" else short_name(m, "").strip("_")
            out.add(_kappa_value(f"labelled_set.{who}.kappa.labellers.{kind}", k, RECOMPUTED, src))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a committed JSONL file; a line that is not JSON (or a file that is not UTF-8) is one line, exit 2."""
    out = []
    for i, x in enumerate(read_text(path).splitlines(), start=1):
        if x.strip():
            try:
                out.append(json.loads(x))
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{i} is not JSON ({e.msg}); restore the committed file") from None
    return out


def compute_findings(root: str | Path = ".") -> Findings:
    """Every finding's numbers from the committed files under ``root`` (the repository).

    Returns:
        the values by key, notes on what was skipped, and mismatches between a recomputed number and the committed
        report that quotes it (none when the committed reports reproduce).
    Example:
        >>> f = compute_findings(".")
        >>> f.values["steering_1.5b.none.corrected"].text()
        '1/60 = 1.7% [0.3, 8.9]'
    """
    root = Path(root)
    if not (root / "reports").is_dir():
        raise UsageError(f"{root}/reports not found; run the command from the repository root or pass root=")
    out = Findings()
    for name, rel in AUDITS.items():
        _audit(out, root, name, rel)
    _post_train(out, root)
    _relabel(out, root)
    _labelled_set(out, root)
    vals, notes = intervention_values(root)
    for v, committed, where in vals:
        out.add(v)
        out.compare(v, committed, where)
    out.notes += notes
    _judge_table(out, root)
    out.values = dict(sorted(out.values.items()))
    return out


def findings_markdown(f: Findings) -> str:
    """The table the command prints: key, value, how (recomputed or read) and source."""
    lines = ["| key | value | how | source |", "|---|---|---|---|"]
    lines += [f"| `{v.key}` | {v.text()} | {v.how} | {v.source} |" for v in f.values.values()]
    if f.notes:
        lines += ["", "Notes:", *[f"- {n}" for n in f.notes]]
    if f.mismatches:
        lines += ["", "Recomputed numbers that differ from the committed report:", *[f"- {m}" for m in f.mismatches]]
    return "\n".join(lines) + "\n"


def findings_json(f: Findings) -> dict[str, Any]:
    """``reports/findings.json``: every value with its text, and the notes and mismatches (no timestamps, so the
    committed file changes only when a number does; an undefined number, such as a kappa with one class, is null)."""
    return finite({"format": "mechprobe-findings-v1",
                   "values": {k: {**v.to_dict(), "text": v.text()} for k, v in f.values.items()},
                   "notes": f.notes, "mismatches": f.mismatches})
