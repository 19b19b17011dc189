"""The study's report: tables, claims and figures as a pure function of the run directories.

Nothing here generates or judges; :func:`collect` reads ``ROOT/<model>/<dataset>/`` (probe run),
``.../variants/<variant>/`` (perturbations), ``ROOT/_human/<dataset>/`` (real next human turns) and
``ROOT/plan.json`` (what was asked, which models were unavailable), and :func:`write_report` turns them
into ``README.md`` and ``study_*.png``. Same runs in, same README out (bootstrap seeds are fixed, every
iteration is sorted, no clock is read), so ``--report-only`` can be re-run at any time.

Every rate is the share of *judged* user turns labelled ``genuine_followup`` (``judge_error`` rows and
unjudged rows excluded) by the judge named in the report's header.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.io import read_json, read_jsonl
from mechprobe.records import truncated_item_ids, truncation_note
from mechprobe.stats import Rate, bootstrap_diff, mcnemar_exact, paired_bootstrap
from mechprobe.taxonomy import GENUINE, JUDGE_ERROR, LABELS

HUMAN_DIR = "_human"
PLAN = "plan.json"
STAGES = "study_stages.jsonl"
T_REF = 1.0  # the sampled temperature of studies 1, 3 and 5 and of the claims
DEGENERATE = "empty_or_degenerate"
N_BOOT = 2000

# Decision thresholds of the claims table (stated in the report; see decide_* below).
GREEDY_ZERO = 0.10  # "greedy ~ 0": the greedy follow-up rate is at most 10%
MIN_LIFT = 0.02  # sampling "does not lift" when the lift is below 2 points with 95% confidence
MOVE_BAND = 0.05  # a perturbation "does not move" the rate when its change is within +-5 points
DECOUPLED_BAND = 0.10  # "decoupled": correct vs wrong items differ by less than 10 points in follow-up rate
FAMILY_TVD = 0.10  # "profiles differ": total variation distance between label distributions above 0.10
ALPHA = 0.05
MIN_GROUP = 3  # items per group below which a comparison is inconclusive by rule
# Paired items below which a bootstrap decides nothing: with a handful of items the resampled CI collapses
# onto the observed value (3 items all at 0 give [0, 0]) and would "decide" from noise.
MIN_PAIRED = 10


@dataclass
class Turn:
    item_id: str
    decoding: str
    temperature: float
    label: str | None  # None: not judged (or a judge error)
    stop_reason: str


@dataclass
class RunData:
    """One run directory's items, judged turns and judges (the unit every table aggregates)."""

    model: str
    dataset: str
    variant: str
    path: str
    scores: dict[str, float | None]  # item -> task score of the assistant turn
    answer_stops: dict[str, str]  # item -> stop reason of the assistant turn
    turns: list[Turn]
    judges: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    n_truncated_turns: int = 0  # user turns after a truncated answer, left out of ``turns`` (0 when included)


def labels_file_for(judge: str) -> str:
    """``labels_<judge>.jsonl``: one file per judge spec, so a second judge never mixes into the first's."""
    import re

    return "labels_" + re.sub(r"[^A-Za-z0-9.]+", "_", judge).strip("_") + ".jsonl"


def load_run_data(run: Path, labels_file: str, model: str, dataset: str, variant: str = "full",
                  include_truncated: bool = False) -> RunData | None:
    """One run's data; user turns after a truncated assistant answer are left out unless ``include_truncated``
    (counted in ``n_truncated_turns``; the answers themselves stay in ``answer_stops``)."""
    if not (run / "user_turns.jsonl").exists():
        return None
    a = read_jsonl(run / "assistant.jsonl", key="item_id")
    cut = set() if include_truncated else truncated_item_ids(a)
    labels = {r["record_id"]: r for r in read_jsonl(run / labels_file, key="record_id")}
    turns = []
    n_cut = 0
    for u in read_jsonl(run / "user_turns.jsonl", key="record_id"):
        if u["item_id"] in cut:
            n_cut += 1
            continue
        lab = labels.get(u["record_id"], {}).get("label")
        turns.append(Turn(u["item_id"], u["decoding"], float(u["temperature"]),
                          None if lab in (None, JUDGE_ERROR) else lab, u["stop_reason"]))
    man = run / "manifest.json"
    cfg = read_json(man).get("config", {}) if man.exists() else {}
    return RunData(model=model, dataset=dataset, variant=variant, path=str(run),
                   scores={r["item_id"]: r.get("score") for r in a},
                   answer_stops={r["item_id"]: r.get("stop_reason", "") for r in a}, turns=turns,
                   judges=sorted({r.get("judge", "?") for r in labels.values()}), config=cfg, n_truncated_turns=n_cut)


@dataclass
class StudyData:
    root: str
    labels_file: str
    full: dict[tuple[str, str], RunData]
    variants: dict[tuple[str, str, str], RunData]
    human: dict[str, RunData]
    plan: dict[str, Any]
    stages: dict[tuple[str, str], dict[str, float]]
    include_truncated: bool = False

    def models(self) -> list[str]:
        return sorted({m for m, _ in self.full})

    def datasets(self, model: str | None = None) -> list[str]:
        return sorted({d for m, d in self.full if model is None or m == model})

    def judges(self) -> list[str]:
        runs = [*self.full.values(), *self.variants.values(), *self.human.values()]
        return sorted({j for r in runs for j in r.judges})


def collect(root: str | Path, labels_file: str, include_truncated: bool = False) -> StudyData:
    """Read every run under ``root`` (sorted, so the report does not depend on directory order); user turns
    after truncated assistant answers are left out unless ``include_truncated``."""
    root = Path(root)
    full: dict[tuple[str, str], RunData] = {}
    variants: dict[tuple[str, str, str], RunData] = {}
    human: dict[str, RunData] = {}
    stages: dict[tuple[str, str], dict[str, float]] = {}
    for mdir in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        for ddir in sorted(p for p in mdir.iterdir() if p.is_dir()):
            if mdir.name == HUMAN_DIR:
                rd = load_run_data(ddir, labels_file, "human", ddir.name, "human", include_truncated)
                if rd is not None:
                    human[ddir.name] = rd
                continue
            rd = load_run_data(ddir, labels_file, mdir.name, ddir.name, include_truncated=include_truncated)
            if rd is None:
                continue
            full[(mdir.name, ddir.name)] = rd
            vroot = ddir / "variants"
            for vdir in sorted(p for p in vroot.iterdir() if p.is_dir()) if vroot.exists() else []:
                vd = load_run_data(vdir, labels_file, mdir.name, ddir.name, vdir.name, include_truncated)
                if vd is not None:
                    variants[(mdir.name, ddir.name, vdir.name)] = vd
            secs: dict[str, float] = {}
            for r in read_jsonl(ddir / STAGES):
                secs[r["stage"]] = round(secs.get(r["stage"], 0.0) + float(r["seconds"]), 1)
                if "cpu_seconds" in r:  # recorded since 2026-11-24; older rows have wall time only
                    k = "cpu:" + r["stage"]
                    secs[k] = round(secs.get(k, 0.0) + float(r["cpu_seconds"]), 1)
            stages[(mdir.name, ddir.name)] = secs
    plan = read_json(root / PLAN) if (root / PLAN).exists() else {}
    return StudyData(str(root), labels_file, full, variants, human, plan, stages, include_truncated)


# --------------------------------------------------------------------------- small aggregates


def _judged(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t.label is not None]


def rate(turns: list[Turn], label: str = GENUINE) -> Rate:
    j = _judged(turns)
    return Rate(sum(t.label == label for t in j), len(j))


def greedy(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t.decoding == "greedy"]


def sampled(turns: list[Turn], temperature: float = T_REF) -> list[Turn]:
    return [t for t in turns if t.decoding == "sample" and math.isclose(t.temperature, temperature)]


def accuracy(rd: RunData) -> Rate:
    s = [v for v in rd.scores.values() if v is not None]
    return Rate(int(sum(v >= 1.0 for v in s)), len(s))


def answers_at_cap(runs: list[RunData]) -> Rate:
    stops = [s for r in runs for s in r.answer_stops.values()]
    return Rate(sum(s == "max_tokens" for s in stops), len(stops))


def turns_at_cap(turns: list[Turn]) -> Rate:
    return Rate(sum(t.stop_reason == "max_tokens" for t in turns), len(turns))


def keyed(rd: RunData) -> list[tuple[str, Turn]]:
    """Turns keyed by (dataset|item), so items of two datasets never pair up when a model's runs are pooled."""
    return [(f"{rd.dataset}|{t.item_id}", t) for t in rd.turns]


def per_item(pairs: list[tuple[str, Turn]]) -> dict[str, tuple[int, int]]:
    """item -> (genuine, judged) over the given turns."""
    out: dict[str, list[int]] = {}
    for key, t in pairs:
        if t.label is None:
            continue
        c = out.setdefault(key, [0, 0])
        c[0] += t.label == GENUINE
        c[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


# --------------------------------------------------------------------------- paired tests and claims


@dataclass
class PairedResult:
    """Variant vs full for one model: exact McNemar on greedy labels, paired bootstrap on sampled rates."""

    variant: str
    greedy_full: Rate
    greedy_variant: Rate
    b: int  # genuine under full only
    c: int  # genuine under the variant only
    p_mcnemar: float
    sampled_full: Rate
    sampled_variant: Rate
    diff: float
    ci: tuple[float, float]
    p_boot: float
    n_items: int


def paired_variant_test(full: list[tuple[str, Turn]], var: list[tuple[str, Turn]], variant: str,
                seed: int = 0) -> PairedResult:
    gf = {k: t.label == GENUINE for k, t in full if t.decoding == "greedy" and t.label is not None}
    gv = {k: t.label == GENUINE for k, t in var if t.decoding == "greedy" and t.label is not None}
    both = sorted(set(gf) & set(gv))
    b = sum(gf[k] and not gv[k] for k in both)
    c = sum(gv[k] and not gf[k] for k in both)
    sf = per_item([(k, t) for k, t in full if t.decoding == "sample" and math.isclose(t.temperature, T_REF)])
    sv = per_item([(k, t) for k, t in var if t.decoding == "sample" and math.isclose(t.temperature, T_REF)])
    items = sorted(set(sf) & set(sv))
    d, lo, hi, p = paired_bootstrap([sf[i][0] for i in items], [sf[i][1] for i in items],
                                    [sv[i][0] for i in items], [sv[i][1] for i in items], N_BOOT, seed)
    return PairedResult(variant, Rate(sum(gf[k] for k in both), len(both)), Rate(sum(gv[k] for k in both), len(both)),
                        b, c, mcnemar_exact(b, c),
                        Rate(sum(sf[i][0] for i in items), sum(sf[i][1] for i in items)),
                        Rate(sum(sv[i][0] for i in items), sum(sv[i][1] for i in items)), d, (lo, hi), p,
                        len(set(both) | set(items)))


@dataclass
class ModelAggregate:
    """What the claims table decides from, for one model (all numbers pooled over its datasets)."""

    model: str
    greedy: Rate
    lift: tuple[float, float, float, float]  # sampled(T_REF) - greedy per item: diff, lo, hi, p
    n_lift_items: int
    paired: list[PairedResult]
    coupling: tuple[float, float, float]  # rate(correct items) - rate(wrong items): diff, lo, hi
    n_correct: int
    n_wrong: int
    tvd: tuple[float, float, float] | None  # vs the other family's models on common datasets; None: no other family
    other_family: list[str] = field(default_factory=list)


def family(model: str) -> str:
    """The model family by name (the study's models: smollm2 vs qwen2.5)."""
    name = model.lower()
    for fam in ("smollm", "qwen", "llama", "gemma", "mistral", "phi"):
        if fam in name:
            return fam
    return name.split("-")[0]


def label_dist(turns: list[Turn]) -> dict[str, float]:
    c = Counter(t.label for t in turns if t.label is not None)
    n = sum(c.values())
    return {lab: c.get(lab, 0) / n for lab in LABELS} if n else {}


def tvd(p: dict[str, float], q: dict[str, float]) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in LABELS)


def tvd_bootstrap(a: dict[str, list[Turn]], b: dict[str, list[Turn]], n_boot: int = N_BOOT,
                  seed: int = 0) -> tuple[float, float, float]:
    """TVD between two label distributions with a 95% CI, resampling items within each side."""
    import random

    ka, kb = sorted(a), sorted(b)
    if not ka or not kb:
        nan = float("nan")
        return nan, nan, nan

    def dist(keys: list[str], src: dict[str, list[Turn]]) -> dict[str, float]:
        return label_dist([t for k in keys for t in src[k]])

    d0 = tvd(dist(ka, a), dist(kb, b))
    rng = random.Random(seed)
    boots = sorted(tvd(dist([ka[rng.randrange(len(ka))] for _ in ka], a), dist([kb[rng.randrange(len(kb))] for _ in kb], b))
                   for _ in range(n_boot))
    return d0, boots[int(0.025 * (n_boot - 1))], boots[int(round(0.975 * (n_boot - 1)))]


def aggregate_model(data: StudyData, model: str) -> ModelAggregate:
    runs = [data.full[(model, d)] for d in data.datasets(model)]
    full = [kt for rd in runs for kt in keyed(rd)]
    g = per_item([(k, t) for k, t in full if t.decoding == "greedy"])
    s = per_item([(k, t) for k, t in full if t.decoding == "sample" and math.isclose(t.temperature, T_REF)])
    items = sorted(set(g) & set(s))
    lift = paired_bootstrap([g[i][0] for i in items], [g[i][1] for i in items], [s[i][0] for i in items],
                            [s[i][1] for i in items], N_BOOT, 0)
    paired = []
    for v in sorted({v for m, _, v in data.variants if m == model}):
        var = [kt for (m, d, vv), rd in sorted(data.variants.items()) if m == model and vv == v for kt in keyed(rd)]
        paired.append(paired_variant_test(full, var, v))
    correct, wrong = [], []
    for rd in runs:
        for iid, sc in sorted(rd.scores.items()):
            key = f"{rd.dataset}|{iid}"
            if sc is None or key not in s:
                continue
            (correct if sc >= 1.0 else wrong).append(s[key])
    coupling = bootstrap_diff(wrong, correct, N_BOOT, 0)
    others = sorted(m for m in data.models() if family(m) != family(model))
    common = [d for d in data.datasets(model) if any((o, d) in data.full for o in others)]
    tv = None
    if others and common:
        mine: dict[str, list[Turn]] = {}
        theirs: dict[str, list[Turn]] = {}
        for d in common:
            for k, t in keyed(data.full[(model, d)]):
                mine.setdefault(k, []).append(t)
            for o in others:
                if (o, d) in data.full:
                    for k, t in keyed(data.full[(o, d)]):
                        theirs.setdefault(f"{o}|{k}", []).append(t)
        tv = tvd_bootstrap(mine, theirs)
    all_turns = [t for _, t in full]
    return ModelAggregate(model, rate(greedy(all_turns)), lift, len(items), paired, coupling, len(correct), len(wrong),
                          tv, others)


@dataclass(frozen=True)
class Verdict:
    verdict: str  # held | refuted | inconclusive
    evidence: str


def _nan(*xs: float) -> bool:
    return any(x != x for x in xs)


def decide_greedy_zero(r: Rate) -> Verdict:
    """held: Wilson upper bound <= GREEDY_ZERO; refuted: lower bound > GREEDY_ZERO."""
    if not r.n:
        return Verdict("inconclusive", "no judged greedy turns")
    lo, hi = r.ci
    ev = f"greedy {r.p:.1%} [{lo:.1%}, {hi:.1%}], n={r.n}"
    if hi <= GREEDY_ZERO:
        return Verdict("held", ev)
    if lo > GREEDY_ZERO:
        return Verdict("refuted", ev)
    return Verdict("inconclusive", ev)


def decide_lift(lift: tuple[float, float, float, float], n_items: int) -> Verdict:
    """held: paired-bootstrap CI of (sampled - greedy) above 0; refuted: its upper bound below MIN_LIFT;
    inconclusive below MIN_PAIRED items."""
    d, lo, hi, _ = lift
    if _nan(d, lo, hi):
        return Verdict("inconclusive", "no item with both greedy and sampled turns")
    ev = f"sampled − greedy {d:+.1%} [{lo:+.1%}, {hi:+.1%}], {n_items} items"
    if n_items < MIN_PAIRED:
        return Verdict("inconclusive", ev + f" (< {MIN_PAIRED})")
    if lo > 0:
        return Verdict("held", ev)
    if hi < MIN_LIFT:
        return Verdict("refuted", ev)
    return Verdict("inconclusive", ev)


def decide_move(paired: list[PairedResult]) -> Verdict:
    """held: any variant's McNemar or bootstrap p below ALPHA / (2 x variants) (Bonferroni);
    refuted: none is, and every variant's sampled-rate change CI lies within +-MOVE_BAND. Bootstrap results
    count only with at least MIN_PAIRED items (the exact McNemar test is valid at any n)."""
    if not paired:
        return Verdict("inconclusive", "no perturbation runs")
    m = 2 * len(paired)
    alpha = ALPHA / m

    def boot_ok(p: PairedResult) -> bool:
        return not _nan(p.diff, p.p_boot) and p.n_items >= MIN_PAIRED

    sig = [p for p in paired if p.p_mcnemar < alpha or (boot_ok(p) and p.p_boot < alpha)]
    ev = "; ".join(f"{p.variant} {p.diff:+.1%} [{p.ci[0]:+.1%}, {p.ci[1]:+.1%}] p={p.p_boot:.3g}, McNemar p={p.p_mcnemar:.3g}"
                   if not _nan(p.diff) else f"{p.variant}: McNemar p={p.p_mcnemar:.3g}" for p in paired)
    ev += f" (threshold p < {alpha:.3g})"
    if sig:
        return Verdict("held", ev)
    if all(boot_ok(p) and -MOVE_BAND <= p.ci[0] and p.ci[1] <= MOVE_BAND for p in paired):
        return Verdict("refuted", ev)
    return Verdict("inconclusive", ev)


def decide_decoupled(coupling: tuple[float, float, float], n_correct: int, n_wrong: int) -> Verdict:
    """held: CI of rate(correct) - rate(wrong) within +-DECOUPLED_BAND; refuted: CI excludes 0;
    inconclusive below MIN_GROUP items in either group."""
    d, lo, hi = coupling
    if n_correct < MIN_GROUP or n_wrong < MIN_GROUP or _nan(d, lo, hi):
        return Verdict("inconclusive", f"{n_correct} correct / {n_wrong} wrong scored items (need {MIN_GROUP} each)")
    ev = f"correct − wrong items {d:+.1%} [{lo:+.1%}, {hi:+.1%}] ({n_correct} vs {n_wrong} items)"
    if lo > 0 or hi < 0:
        return Verdict("refuted", ev)
    if -DECOUPLED_BAND <= lo and hi <= DECOUPLED_BAND:
        return Verdict("held", ev)
    return Verdict("inconclusive", ev)


def decide_family(tv: tuple[float, float, float] | None, others: list[str]) -> Verdict:
    """held: TVD CI lower bound > FAMILY_TVD; refuted: upper bound < FAMILY_TVD."""
    if tv is None or _nan(*tv):
        return Verdict("inconclusive", "no model of another family on a common dataset")
    d, lo, hi = tv
    ev = f"TVD {d:.2f} [{lo:.2f}, {hi:.2f}] vs {', '.join(others)}"
    if lo > FAMILY_TVD:
        return Verdict("held", ev)
    if hi < FAMILY_TVD:
        return Verdict("refuted", ev)
    return Verdict("inconclusive", ev)


CLAIMS = (
    ("greedy follow-up rate ≈ 0", lambda a: decide_greedy_zero(a.greedy)),
    ("sampling lifts it", lambda a: decide_lift(a.lift, a.n_lift_items)),
    ("the perturbations move it", lambda a: decide_move(a.paired)),
    ("accuracy and awareness are decoupled", lambda a: decide_decoupled(a.coupling, a.n_correct, a.n_wrong)),
    ("failure profiles differ by family", lambda a: decide_family(a.tvd, a.other_family)),
)

RULES = f"""Decision rules (`mechprobe/study/report.py`, `decide_*`), all at 95%:
- *greedy ≈ 0*: held if the Wilson upper bound of the greedy rate is ≤ {GREEDY_ZERO:.0%}; refuted if its lower bound is > {GREEDY_ZERO:.0%}.
- *sampling lifts it*: paired bootstrap over items of (rate at T={T_REF:g} − greedy rate); held if the CI is above 0; refuted if its upper bound is < {MIN_LIFT:.0%}.
- A bootstrap over fewer than {MIN_PAIRED} items decides nothing (its CI collapses onto the observed value); the exact McNemar test counts at any size.
- *the perturbations move it*: held if any variant's exact McNemar (greedy) or paired-bootstrap (T={T_REF:g}) p-value is below {ALPHA} / (2 × number of variants) (Bonferroni); refuted if none is and every variant's change CI lies within ±{MOVE_BAND:.0%}.
- *decoupled*: rate at T={T_REF:g} on items answered correctly minus on items answered wrongly (bootstrap over items); refuted if the CI excludes 0; held if it lies within ±{DECOUPLED_BAND:.0%}; inconclusive with fewer than {MIN_GROUP} items in a group.
- *profiles differ by family*: total variation distance between the model's label distribution and the other family's models' (common datasets, bootstrap over items); held if the CI is above {FAMILY_TVD}; refuted if below.
- Anything else is inconclusive."""


# --------------------------------------------------------------------------- report


def _fmt_secs(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *["| " + " | ".join(r) + " |" for r in rows]]


def _temperatures(data: StudyData, model: str) -> list[float]:
    return sorted({t.temperature for d in data.datasets(model) for t in data.full[(model, d)].turns})


def truncation_line(data: StudyData) -> str:
    """``k of n answers truncated, excluded`` over every run of the study, with the user turns left out."""
    runs = [*data.full.values(), *data.variants.values(), *data.human.values()]
    cap = answers_at_cap(runs)
    line = truncation_note(cap.k, cap.n, data.include_truncated)
    if data.include_truncated:
        return line + ": their user turns count in every rate."
    return line + (f": the {sum(r.n_truncated_turns for r in runs)} user turns after them are left out of every "
                   "rate and test (`--include-truncated` keeps them).")


def build_report(data: StudyData, figures: dict[str, str]) -> str:
    """The README markdown (deterministic in ``data``); ``figures`` maps figure key -> relative path."""
    judges = data.judges()
    jtxt = ", ".join(f"`{j}`" for j in judges) or "none yet"
    plan = data.plan
    L = [f"# Study: interaction awareness across the embedded models ({plan.get('profile', '?')} profile)", "",
         "Regenerate: `python experiments/study.py --report-only"
         + (" --quick" if plan.get("profile") == "quick" else "") + "` (a pure function of the runs under "
         f"`{plan.get('root', data.root)}`). Every rate below is the share of judged user turns labelled "
         f"`genuine_followup` by the judge **{jtxt}** (judge spec `{plan.get('judge', '?')}`, labels file "
         f"`{data.labels_file}`), with 95% Wilson CIs unless stated.", ""]
    if len(judges) > 1:
        L += [f"**Warning:** the labels come from more than one judge ({jtxt}); rates mix instruments.", ""]
    for m, why in sorted(plan.get("unavailable", {}).items()):
        L.append(f"- **{m} skipped**: {why}")
    for key, why in sorted(plan.get("errors", {}).items()):
        L.append(f"- **{key} failed**: {why}")
    if plan.get("unavailable") or plan.get("errors"):
        L.append("")
    if not data.full:
        return "\n".join(L + ["No runs yet: run `python experiments/study.py` first.", ""])
    L += ["Settings: " + "; ".join(
        f"`{m}` — {data.full[(m, data.datasets(m)[0])].config.get('engine', '?')} engine, "
        f"caps {data.full[(m, data.datasets(m)[0])].config.get('max_assistant_tokens', '?')}/"
        f"{data.full[(m, data.datasets(m)[0])].config.get('max_user_tokens', '?')} tokens (answer/user turn), "
        f"{data.full[(m, data.datasets(m)[0])].config.get('samples', '?')} samples per temperature"
        for m in data.models()) + (f"; greedy + {plan['variant_samples']} sample(s) at T={T_REF:g} per perturbation "
                                    "variant" if "variant_samples" in plan else "") + ".", "",
          "An answer that hit its token cap (`stop_reason == max_tokens`) is itself truncated: every table gives "
          "the share of such answers. " + truncation_line(data), ""]

    # 1. accuracy vs awareness
    L += ["## 1. Accuracy vs awareness", "",
          f"Task accuracy (exact match for GSM8K/MATH-500, IFEval prompt-level strict; unscored datasets —) beside "
          f"the follow-up rate of greedy and sampled (T={T_REF:g}) user turns.", ""]
    rows = []
    for (m, d), rd in sorted(data.full.items()):
        acc = accuracy(rd)
        rows.append([m, d, str(len(rd.scores)), acc.cell() if acc.n else "—", answers_at_cap([rd]).cell(),
                     rate(greedy(rd.turns)).cell(), rate(sampled(rd.turns)).cell(),
                     turns_at_cap(rd.turns).cell()])
    L += _table(["model", "dataset", "items", "accuracy", "answers at cap", "greedy follow-up", f"sampled T={T_REF:g}",
                 "user turns at cap"], rows)
    L += ["", f"![accuracy vs awareness]({figures['accuracy']})", "",
          f"*Per model and dataset: task accuracy next to the greedy and T={T_REF:g} follow-up rates, 95% Wilson CIs.*",
          ""]

    # 2. temperature
    L += ["## 2. Follow-up rate vs temperature", "",
          "Pooled over each model's datasets; `±` is the CI half-width. Degeneration = label `empty_or_degenerate`.", ""]
    rows = []
    for m in data.models():
        runs = [data.full[(m, d)] for d in data.datasets(m)]
        turns = [t for r in runs for t in r.turns]
        for temp in _temperatures(data, m):
            tt = [t for t in turns if math.isclose(t.temperature, temp)]
            rows.append([m, "greedy" if temp == 0 else f"{temp:g}", rate(tt).cell(half=True),
                         rate(tt, DEGENERATE).cell(half=True), turns_at_cap(tt).cell(), answers_at_cap(runs).cell()])
    L += _table(["model", "T", "follow-up rate", "degenerate", "user turns at cap", "answers at cap"], rows)
    L += ["", f"![temperature]({figures['temperature']})", "",
          "*Follow-up rate (solid) and degeneration rate (dashed) against temperature, one line per model, 95% CIs.*",
          ""]

    # 3. perturbations
    aggs = {m: aggregate_model(data, m) for m in data.models()}
    L += ["## 3. Perturbations (change vs `full`)", "",
          f"Each variant reuses the same assistant records. Greedy: rates on items with both greedy labels and the "
          f"exact McNemar p (b = genuine only in full, c = only in the variant). Sampled (T={T_REF:g}): paired "
          f"bootstrap over items ({N_BOOT} resamples) of the variant's rate minus full's.", ""]
    rows = []
    for m, a in aggs.items():
        cap = answers_at_cap([data.full[(m, d)] for d in data.datasets(m)]).cell()
        for p in a.paired:
            diff = "—" if _nan(p.diff) else f"{p.diff:+.1%} [{p.ci[0]:+.1%}, {p.ci[1]:+.1%}], p={p.p_boot:.3g}"
            rows.append([m, p.variant, str(p.n_items), f"{p.greedy_full.p:.1%} → {p.greedy_variant.p:.1%}"
                         if p.greedy_full.n else "—", f"{p.b}/{p.c}, p={p.p_mcnemar:.3g}",
                         f"{p.sampled_full.p:.1%} → {p.sampled_variant.p:.1%}" if p.sampled_full.n else "—", diff, cap])
    L += _table(["model", "variant", "items", "greedy full → variant", "McNemar b/c", "sampled full → variant",
                 "change [95% CI]", "answers at cap"], rows) if rows else ["No perturbation runs."]
    L += ["", f"![perturbations]({figures['perturbations']})", "",
          f"*Sampled (T={T_REF:g}) follow-up rate per perturbation next to the unperturbed conversation, per model, "
          "95% Wilson CIs.*", ""]

    # 4. failure profiles
    L += ["## 4. Failure profiles", "", "Label distribution of all user turns (every decoding) per model and dataset.",
          ""]
    rows = []
    for (m, d), rd in sorted(data.full.items()):
        dist = label_dist(rd.turns)
        n = len(_judged(rd.turns))
        rows.append([m, d, str(n), *[f"{dist.get(lab, 0.0):.0%}" if n else "—" for lab in LABELS],
                     answers_at_cap([rd]).cell()])
    L += _table(["model", "dataset", "n", *LABELS, "answers at cap"], rows)
    L += ["", f"![failure profiles]({figures['profiles']})", "",
          "*Stacked share of each label per model and dataset: what the models write instead of a follow-up.*", ""]

    # 5. human reference
    L += ["## 5. Human reference", "",
          "The real next human turn of HH-RLHF / Topical-Chat conversations (after the *original* reply), judged by "
          "the same judge, beside each model's generated turns on the same conversations (after its own reply).", ""]
    rows = []
    for ds, hd in sorted(data.human.items()):
        hk = {t.item_id: t for t in hd.turns}
        for m in data.models():
            rd = data.full.get((m, ds))
            if rd is None:
                continue
            ids = sorted(set(hk) & set(rd.scores))
            mt = [t for t in rd.turns if t.item_id in set(ids)]
            rows.append([ds, m, str(len(ids)), rate([hk[i] for i in ids]).cell(), rate(greedy(mt)).cell(),
                         rate(sampled(mt)).cell(), answers_at_cap([rd]).cell()])
    L += _table(["dataset", "model", "conversations", "human next turn", "model greedy", f"model T={T_REF:g}",
                 "answers at cap"], rows) if rows else ["No human-reference runs (needs hh_rlhf or topical_chat)."]
    L += ["", f"![human reference]({figures['human']})", "",
          "*Follow-up rate of the real human next turn against the models' generated turns on the same conversations.*",
          ""]

    # 6. claims
    L += ["## 6. Claims", "", f"Judge: {jtxt}.", ""]
    rows = []
    for name, fn in CLAIMS:
        cells = []
        for m in data.models():
            v = fn(aggs[m])
            cells.append(f"**{v.verdict}** — {v.evidence}")
        rows.append([name, *cells])
    L += _table(["claim", *data.models()], rows)
    L += ["", RULES, ""]

    # stage times
    L += ["## Stage times", "", "Wall seconds summed over every command that did work on the run (from "
          "`study_stages.jsonl` in each run directory).", ""]
    stage_names = sorted({s for v in data.stages.values() for s in v if not s.startswith("cpu:")})
    rows = [[m, d, *[_fmt_secs(data.stages[(m, d)][s]) if s in data.stages[(m, d)] else "—" for s in stage_names]]
            for (m, d) in sorted(data.stages)]
    L += _table(["model", "dataset", *stage_names], rows) if stage_names else ["No stage times recorded."]
    wall = sum(v for st in data.stages.values() for k, v in st.items() if not k.startswith("cpu:"))
    cpu = sum(v for st in data.stages.values() for k, v in st.items() if k.startswith("cpu:"))
    if stage_names:
        L += ["", f"Total wall time {_fmt_secs(wall)}. Wall time also counts any time a command was stopped or shared "
              "the CPU with other jobs; process CPU time (all threads), recorded for later commands only: "
              f"{_fmt_secs(cpu) if cpu else 'not recorded'}."]
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------- figures


def _err(r: Rate) -> tuple[float, float]:
    lo, hi = r.ci
    return (r.p - lo, hi - r.p) if r.n else (0.0, 0.0)


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})


def write_figures(data: StudyData, out_dir: Path, prefix: str = "study_") -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {k: out_dir / f"{prefix}{k}.png" for k in ("accuracy", "temperature", "perturbations", "profiles", "human")}
    keys = sorted(data.full)
    # 1
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(keys)), 4))
    for j, (lab, fn) in enumerate((("accuracy", lambda rd: accuracy(rd)), ("greedy", lambda rd: rate(greedy(rd.turns))),
                                   (f"T={T_REF:g}", lambda rd: rate(sampled(rd.turns))))):
        rs = [fn(data.full[k]) for k in keys]
        ax.bar([i + 0.27 * (j - 1) for i in range(len(keys))], [r.p if r.n else 0 for r in rs], 0.27, label=lab,
               yerr=list(zip(*[_err(r) for r in rs])) if rs else None, capsize=2)
    ax.set_xticks(range(len(keys)), [f"{m}\n{d}" for m, d in keys], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    _save(fig, paths["accuracy"])
    plt.close(fig)
    # 2
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in data.models():
        turns = [t for d in data.datasets(m) for t in data.full[(m, d)].turns]
        temps = _temperatures(data, m)
        for lab, style in ((GENUINE, "-o"), (DEGENERATE, "--x")):
            rs = [rate([t for t in turns if math.isclose(t.temperature, x)], lab) for x in temps]
            ax.errorbar(temps, [r.p for r in rs], yerr=list(zip(*[_err(r) for r in rs])), fmt=style, capsize=2,
                        label=f"{m} {'follow-up' if lab == GENUINE else 'degenerate'}")
    ax.set_xlabel("temperature (0 = greedy)")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6)
    _save(fig, paths["temperature"])
    plt.close(fig)
    # 3
    fig, ax = plt.subplots(figsize=(7, 4))
    models = data.models()
    names = ["full", *sorted({v for _, _, v in data.variants})]  # one x position per variant for every model
    for j, m in enumerate(models):
        rs = [rate(sampled([t for d in data.datasets(m) for t in data.full[(m, d)].turns]))]
        rs += [rate(sampled([t for (mm, _, v), rd in sorted(data.variants.items()) if mm == m and v == name
                             for t in rd.turns])) for name in names[1:]]
        w = 0.8 / max(1, len(models))
        ax.bar([i + w * j for i in range(len(names))], [r.p if r.n else 0 for r in rs], w, label=m,
               yerr=list(zip(*[_err(r) for r in rs])), capsize=2)
        ax.set_xticks([i + w * (len(models) - 1) / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
    ax.set_ylabel(f"follow-up rate, T={T_REF:g}")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    _save(fig, paths["perturbations"])
    plt.close(fig)
    # 4
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(keys)), 4.5))
    bottom = [0.0] * len(keys)
    for lab in LABELS:
        vals = [label_dist(data.full[k].turns).get(lab, 0.0) for k in keys]
        ax.bar(range(len(keys)), vals, bottom=bottom, label=lab)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(keys)), [f"{m}\n{d}" for m, d in keys], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("share of user turns")
    ax.legend(fontsize=6, bbox_to_anchor=(1.01, 1), loc="upper left")
    _save(fig, paths["profiles"])
    plt.close(fig)
    # 5
    fig, ax = plt.subplots(figsize=(6, 4))
    dss = sorted(data.human)
    series = [("human", lambda ds, ids: rate([t for t in data.human[ds].turns if t.item_id in ids]))]
    for m in models:
        series.append((f"{m} T={T_REF:g}", lambda ds, ids, m=m: rate(sampled(
            [t for t in data.full[(m, ds)].turns if t.item_id in ids])) if (m, ds) in data.full else Rate(0, 0)))
    w = 0.8 / len(series)
    for j, (name, fn) in enumerate(series):
        rs = []
        for ds in dss:
            ids = {t.item_id for t in data.human[ds].turns}
            rs.append(fn(ds, ids))
        ax.bar([i + w * j for i in range(len(dss))], [r.p if r.n else 0 for r in rs], w, label=name,
               yerr=list(zip(*[_err(r) for r in rs])) if rs else None, capsize=2)
    ax.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(dss))], dss)
    ax.set_ylabel("follow-up rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    _save(fig, paths["human"])
    plt.close(fig)
    return paths


def write_report(root: str | Path, labels_file: str, report_dir: str | Path, figures_dir: str | Path,
                 include_truncated: bool = False) -> Path:
    """Collect the runs under ``root`` and write ``report_dir/README.md`` and ``figures_dir/study_*.png``.

    With no runs under ``root`` (a fresh clone, a mistyped ``--root``) an existing report is never replaced
    by an empty one: that is a :class:`~mechprobe.errors.UsageError` naming the root, and nothing is written.
    """
    import os

    data = collect(root, labels_file, include_truncated)
    report_dir, figures_dir = Path(report_dir), Path(figures_dir)
    if not data.full and (report_dir / "README.md").exists():
        raise UsageError(f"no runs with labels {labels_file} under {root}, so the report would be empty; refusing "
                         f"to overwrite {report_dir / 'README.md'}. Check --root (and --quick/--judge), or run the "
                         "study first")
    paths = write_figures(data, figures_dir) if data.full else {}
    rel = {k: os.path.relpath(p, report_dir) for k, p in paths.items()} or {
        k: "" for k in ("accuracy", "temperature", "perturbations", "profiles", "human")}
    report_dir.mkdir(parents=True, exist_ok=True)
    out = report_dir / "README.md"
    out.write_text(build_report(data, rel), encoding="utf-8")
    return out
