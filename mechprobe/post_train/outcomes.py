"""What an evaluation run says, read from its files: follow-up rates, task accuracy, label counts, the
audit-corrected rates and the paired test of two arms.

Paired comparisons key on ``record_id`` (``<item>|greedy|s0``, ``<item>|T1|s<k>``): the same item and the
same decoding slot in both arms, with the same per-row sampling seed, which is what McNemar's exact test
needs (:func:`mechprobe.stats.paired_outcomes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.audit.rates import audit_truth, difference_columns, rate_columns
from mechprobe.io import read_jsonl
from mechprobe.records import truncated_item_ids
from mechprobe.stats import Rate, paired_outcomes


def labels_of(run: Path) -> dict[str, dict[str, Any]]:
    """``record_id -> label row`` of a judged run (judge errors kept; ``genuine`` is None there)."""
    return {r["record_id"]: r for r in read_jsonl(run / "labels.jsonl", key="record_id")}


def turns_of(run: Path) -> dict[str, dict[str, Any]]:
    return {r["record_id"]: r for r in read_jsonl(run / "user_turns.jsonl", key="record_id")}


def truncated_of(run: Path) -> set[str]:
    """Item ids of ``run`` whose assistant answer hit the token cap."""
    return truncated_item_ids(read_jsonl(run / "assistant.jsonl", key="item_id"))


def followup_rates(run: Path, include_truncated: bool = False) -> dict[str, Rate]:
    """Genuine follow-up rate per decoding (``greedy``, ``sample``) over judged turns; turns after a truncated
    assistant answer are left out unless ``include_truncated``."""
    labels, turns = labels_of(run), turns_of(run)
    cut = set() if include_truncated else truncated_of(run)
    out: dict[str, Rate] = {}
    for dec in ("greedy", "sample"):
        g = [labels[r]["genuine"] for r, t in turns.items() if t["decoding"] == dec and r in labels
             and labels[r]["genuine"] is not None and t["item_id"] not in cut]
        out[dec] = Rate(sum(bool(x) for x in g), len(g))
    return out


def judge_verdicts(run: Path, decoding: str, include_truncated: bool = False) -> dict[str, int]:
    """record id -> the judge's verdict (1 genuine, 0 not) for the turns of ``decoding`` that count in a rate."""
    labels, turns = labels_of(run), turns_of(run)
    cut = set() if include_truncated else truncated_of(run)
    return {r: int(bool(labels[r]["genuine"])) for r, t in turns.items() if t["decoding"] == decoding
            and r in labels and labels[r]["genuine"] is not None and t["item_id"] not in cut}


def corrected_rates(run: Path, include_truncated: bool = False) -> dict[str, Any] | None:
    """Audit-corrected follow-up rate per decoding (PPI++ on the run's audited turns), or None without an audit.

    The audit is ``mechprobe audit RUN``'s sample and its imported labels; see :mod:`mechprobe.audit.rates`."""
    truth = audit_truth(run)
    if truth is None:
        return None
    out: dict[str, Any] = {"labellers": list(truth.labellers), "n_audited": len(truth)}
    for dec in ("greedy", "sample"):
        _, c = rate_columns(judge_verdicts(run, dec, include_truncated), truth)
        out[dec] = c.to_dict() if c is not None else None
    return out


def corrected_difference(run_a: Path, run_b: Path, decoding: str, include_truncated: bool = False
                         ) -> dict[str, Any] | None:
    """Audit-corrected paired difference (b - a) on the record ids both runs judged, or None unless both are audited."""
    ta, tb = audit_truth(run_a), audit_truth(run_b)
    if ta is None or tb is None:
        return None
    cut = set() if include_truncated else truncated_of(run_a) | truncated_of(run_b)
    ja = {r: v for r, v in judge_verdicts(run_a, decoding, True).items() if r.split("|")[0] not in cut}
    jb = {r: v for r, v in judge_verdicts(run_b, decoding, True).items() if r.split("|")[0] not in cut}
    j, c = difference_columns(ja, jb, ta.truth, tb.truth)
    return {"judge_only": j.to_dict(), "corrected": c.to_dict() if c is not None else None}


def label_distribution(run: Path) -> dict[str, int]:
    return dict(Counter(r["label"] for r in labels_of(run).values()).most_common())


def task_accuracy(run: Path) -> Rate:
    """Share of scored assistant turns that are correct (GSM8K exact match; MT-Bench is unscored: n = 0)."""
    scores = [r["score"] for r in read_jsonl(run / "assistant.jsonl", key="item_id") if r.get("score") is not None]
    return Rate(int(sum(s >= 0.5 for s in scores)), len(scores))


@dataclass
class Paired:
    """One decoding's paired test of arm A against arm B (the summary's ``paired`` rows)."""

    decoding: str
    n: int
    both: int
    only_a: int
    only_b: int
    p: float

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def paired_arm_test(run_a: Path, run_b: Path, keep: Callable[[str], bool] | None = None,
                    include_truncated: bool = False) -> list[Paired]:
    """McNemar exact per decoding over the record ids judged (without error) in both runs.

    ``keep(item_id)`` restricts the pairs to some items (the baked-steering arm on the items its vector was
    not built from). Items whose assistant answer was truncated in either arm are left out unless
    ``include_truncated``."""
    la, lb, ta = labels_of(run_a), labels_of(run_b), turns_of(run_a)
    cut = set() if include_truncated else truncated_of(run_a) | truncated_of(run_b)
    out = []
    for dec in ("greedy", "sample"):
        ids = [r for r, t in ta.items() if t["decoding"] == dec and r in la and r in lb
               and la[r]["genuine"] is not None and lb[r]["genuine"] is not None
               and (keep is None or keep(str(t.get("item_id", r.split("|")[0]))))
               and str(t.get("item_id", r.split("|")[0])) not in cut]
        t = paired_outcomes({r: bool(la[r]["genuine"]) for r in ids}, {r: bool(lb[r]["genuine"]) for r in ids})
        out.append(Paired(dec, t.n, t.both, t.only_a, t.only_b, t.p))
    return out


def arm_summary(runs: dict[str, Path], include_truncated: bool = False) -> dict[str, Any]:
    """Per dataset run and pooled: follow-up rates, accuracy, label distribution, truncated answers."""
    per: dict[str, Any] = {}
    pooled_f = {"greedy": Rate(0, 0), "sample": Rate(0, 0)}
    pooled_acc = Rate(0, 0)
    pooled_labels: Counter = Counter()
    pooled_cut = Rate(0, 0)
    for ds, run in runs.items():
        f = followup_rates(run, include_truncated)
        acc = task_accuracy(run)
        lab = label_distribution(run)
        cut = Rate(len(truncated_of(run)), len(read_jsonl(run / "assistant.jsonl", key="item_id")))
        pooled_cut = Rate(pooled_cut.k + cut.k, pooled_cut.n + cut.n)
        per[ds] = {"run": str(run), "followup": {k: v.to_dict() for k, v in f.items()}, "accuracy": acc.to_dict(),
                   "labels": lab, "truncated": {"k": cut.k, "n": cut.n, "excluded": not include_truncated},
                   "corrected": corrected_rates(run, include_truncated)}
        for k, v in f.items():
            pooled_f[k] = Rate(pooled_f[k].k + v.k, pooled_f[k].n + v.n)
        pooled_acc = Rate(pooled_acc.k + acc.k, pooled_acc.n + acc.n)
        pooled_labels.update(lab)
    per["all"] = {"followup": {k: v.to_dict() for k, v in pooled_f.items()}, "accuracy": pooled_acc.to_dict(),
                  "labels": dict(pooled_labels.most_common()),
                  "truncated": {"k": pooled_cut.k, "n": pooled_cut.n, "excluded": not include_truncated}}
    return per
