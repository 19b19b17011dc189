"""Check a judge against real people, with no labels at all: real vs swapped next human turns.

For conversations from HH-RLHF and Topical-Chat we know what the human actually said next. That
turn, after its own conversation, is (almost always) a grounded reaction; the same kind of turn
after a *different* conversation is not grounded in what it follows. A judge that measures
grounding calls many real turns ``genuine_followup`` and few swapped ones. Reported: both genuine
rates (Wilson 95% CIs), their difference and the AUROC of P(genuine) separating real from swapped
(both with 95% CIs by bootstrap over conversations). Judges without per-label probabilities (the
offline judge) are scored with genuine as 0/1.

Swapping: within one dataset, conversation ``i`` gets the real next turn of conversation ``i+1``
(in a seeded random order), so every turn appears once real and once swapped and the two sets
hold exactly the same texts: only the pairing differs.

    mechprobe agreement --human-reference local:qwen2.5-coder-1.5b-instruct --n 100 \\
        --out human_ref.md --save-labels human_ref_labels.jsonl
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sklearn.metrics import roc_auc_score
from tqdm.auto import tqdm

from mechprobe.io import JsonlStore, read_jsonl
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.factory import make_judge
from mechprobe.stats import wilson
from mechprobe.taxonomy import GENUINE, JUDGE_ERROR
from mechprobe.turns.datasets import load_dataset

DATASETS = ("hh_rlhf", "topical_chat")


CHUNK = 16  # turns per judge call in run(): the unit of resumption


def reference_inputs(datasets: Sequence[str] = DATASETS, n: int = 100, *, seed: int = 0, max_chars: int = 1500,
                     data_path: str | Path | None = None) -> list[JudgeInput]:
    """``n`` conversations per dataset as (real, swapped) input pairs (record ids ``...|real``/``|swapped``).

    Only conversations whose first user turn, reply and next user turn are all present and together
    at most ``max_chars`` characters are used (the first ones of the file in that order), which keeps
    a CPU judge's cost bounded; the cut is the same for real and swapped turns.
    """

    out: list[JudgeInput] = []
    for name in datasets:
        load = load_dataset(name, path=data_path, source="local")
        rows = []
        for it in load.items:
            reply = it.meta.get("original_assistant") or it.meta.get("original_reply")
            nxt = it.reference_next_user
            if not reply or not nxt or not it.prompt:
                continue
            if len(it.prompt) + len(reply) + len(nxt) > max_chars:
                continue
            rows.append((it.item_id, it.prompt, reply, nxt))
            if len(rows) == n:
                break
        if len(rows) < 2:
            raise ValueError(f"{name}: fewer than 2 usable conversations; raise max_chars= or check the data")
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        for k, i in enumerate(order):
            iid, prompt, reply, nxt = rows[i]
            other_id, other = rows[order[(k + 1) % len(order)]][0], rows[order[(k + 1) % len(order)]][3]
            # the partner is part of the swapped id, so a resumed run with another --n (another
            # pairing) never reuses a label judged on a different text
            for kind, rid, text in (("real", f"{iid}|real", nxt), ("swapped", f"{iid}|swapped<-{other_id}", other)):
                out.append(JudgeInput(record_id=rid, prompt=prompt, response=reply, raw_text=text,
                                      dataset=name, decoding=kind, item_id=iid))
    return out


def auroc_pos_neg(pos: Sequence[float], neg: Sequence[float]) -> float:
    """P(score of a random positive > a random negative), ties counting half (Mann-Whitney U), from two score
    lists: ``sklearn.metrics.roc_auc_score`` on their concatenation. NaN when either list is empty."""
    if not pos or not neg:
        return float("nan")
    return float(roc_auc_score([1] * len(pos) + [0] * len(neg), [*pos, *neg]))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


@dataclass
class ReferenceResult:
    dataset: str
    n: int
    rate_real: float
    ci_real: tuple[float, float]
    rate_swapped: float
    ci_swapped: tuple[float, float]
    gap: float
    ci_gap: tuple[float, float]
    auroc: float
    ci_auroc: tuple[float, float]
    n_errors: int


def evaluate(rows: Sequence[dict[str, Any]], dataset: str = "all", n_boot: int = 1000,
             seed: int = 0) -> ReferenceResult:
    """Rates, gap and AUROC from label rows of real/swapped pairs (rows: record_id, label, probs)."""
    pairs: dict[str, dict[str, dict[str, Any]]] = {}
    n_err = 0
    for r in rows:
        if r["label"] == JUDGE_ERROR:
            n_err += 1
            continue
        iid, kind = r["record_id"].rsplit("|", 1)
        kind = kind.split("<-", 1)[0]
        pairs.setdefault(iid, {})[kind] = r
    full = [(p["real"], p["swapped"]) for p in pairs.values() if "real" in p and "swapped" in p]

    def score(r: dict[str, Any]) -> float:
        probs = r.get("probs")
        return float(probs[GENUINE]) if probs else float(r["label"] == GENUINE)

    def stats(ps: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[float, float, float]:
        gr = sum(a["label"] == GENUINE for a, _ in ps) / len(ps)
        gs = sum(b["label"] == GENUINE for _, b in ps) / len(ps)
        return gr, gs, auroc_pos_neg([score(a) for a, _ in ps], [score(b) for _, b in ps])

    n = len(full)
    if n == 0:
        nan = float("nan")
        return ReferenceResult(dataset, 0, nan, (nan, nan), nan, (nan, nan), nan, (nan, nan), nan, (nan, nan), n_err)
    gr, gs, au = stats(full)
    rng = random.Random(seed)
    gaps, aus = [], []
    for _ in range(n_boot):  # resample conversations: real and swapped of one conversation stay together
        s = [full[rng.randrange(n)] for _ in range(n)]
        a, b, c = stats(s)
        gaps.append(a - b)
        aus.append(c)
    kr = round(gr * n)
    ks = round(gs * n)
    return ReferenceResult(dataset, n, gr, wilson(kr, n), gs, wilson(ks, n), gr - gs,
                           (_pct(gaps, 0.025), _pct(gaps, 0.975)), au, (_pct(aus, 0.025), _pct(aus, 0.975)), n_err)


def report(results: Sequence[ReferenceResult], judge: str, seconds: float | None = None,
           n_judged: int | None = None) -> str:
    """Markdown table of :func:`evaluate` results."""
    def f(x: float) -> str:
        return "—" if x != x else f"{x:.2f}"

    lines = [f"Judge `{judge}`: real next human turn after its own conversation vs after another one.", "",
             "| dataset | n pairs | genuine rate, real | genuine rate, swapped | gap | AUROC P(genuine) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.dataset} | {r.n} | {f(r.rate_real)} [{f(r.ci_real[0])}, {f(r.ci_real[1])}] | "
                     f"{f(r.rate_swapped)} [{f(r.ci_swapped[0])}, {f(r.ci_swapped[1])}] | {f(r.gap)} "
                     f"[{f(r.ci_gap[0])}, {f(r.ci_gap[1])}] | {f(r.auroc)} [{f(r.ci_auroc[0])}, "
                     f"{f(r.ci_auroc[1])}] |")
    lines += ["", "95% CIs: Wilson for rates; bootstrap over conversations for gap and AUROC."]
    if seconds is not None and n_judged:
        lines.append(f"Judged {n_judged} turns in {seconds:.0f} s ({n_judged / seconds:.2f} turns/s).")
    errs = sum(r.n_errors for r in results if r.dataset == "all")
    if errs:
        lines.append(f"{errs} judge errors excluded.")
    return "\n".join(lines) + "\n"


def run(judge_spec: str, *, n: int = 100, datasets: Sequence[str] = DATASETS, save: str | Path | None = None,
        max_chars: int = 1500, seed: int = 0, progress: bool = True, **opts: Any) -> tuple[str, list[ReferenceResult]]:
    """Judge real and swapped turns (resumably, when ``save`` is given) and return (markdown, results)."""
    inputs = reference_inputs(datasets, n, seed=seed, max_chars=max_chars)
    judge = make_judge(judge_spec, **opts)
    store = JsonlStore(save, key="record_id") if save else None
    if store is not None:
        other = sorted({r.get("judge") for r in read_jsonl(save)} - {judge.name})
        if other:
            raise ValueError(f"{save} holds labels from {other}, not {judge.name!r}: pass another save_labels=")
    todo = [i for i in inputs if store is None or not store.has(i.record_id)]
    got: list[dict[str, Any]] = []
    t0 = time.time()
    bar = tqdm(total=len(todo), desc=f"judge {judge.name}", disable=not progress)
    # Chunks, so that a judge that scores its whole input before yielding (the trained judge computes every
    # feature row first) still writes as it goes and a killed run resumes from the last chunk.
    for start in range(0, len(todo), CHUNK):
        for rec in judge.label_many(todo[start:start + CHUNK]):
            d = rec.to_dict()
            got.append(d)
            if store is not None:
                store.append(d)
            bar.update(1)
    bar.close()
    secs = time.time() - t0
    rows = read_jsonl(save) if store is not None else got
    ids = {i.record_id for i in inputs}
    rows = [r for r in rows if r["record_id"] in ids]
    by_ds = {i.record_id: i.dataset for i in inputs}
    results = [evaluate([r for r in rows if by_ds[r["record_id"]] == d], d) for d in datasets]
    results.append(evaluate(rows, "all"))
    return report(results, judge.name, secs if todo else None, len(todo)), results

