"""The study's statistics: paired tests of each perturbation against the full conversation, the per-model
aggregates the claims table decides from, and the decision rules (``decide_*``) of that table.

The tests themselves are the package's paired-test family (:mod:`mechprobe.stats.paired`); this module pairs
the study's turns by (dataset, item) and applies the thresholds below. Bootstrap seeds are fixed and every
iteration is sorted, so the same runs always give the same verdicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mechprobe.stats import Rate, bootstrap_diff, label_shares, paired_outcomes, paired_rates, tvd_bootstrap
from mechprobe.study.data import N_BOOT, T_REF, StudyData, Turn, greedy, keyed, per_item, rate
from mechprobe.taxonomy import GENUINE, LABELS

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
    """A variant against the full conversation on the same (dataset, item) keys: exact McNemar on the greedy
    labels, the item bootstrap on the sampled (T_REF) rates (:mod:`mechprobe.stats.paired`)."""
    gf = {k: t.label == GENUINE for k, t in full if t.decoding == "greedy" and t.label is not None}
    gv = {k: t.label == GENUINE for k, t in var if t.decoding == "greedy" and t.label is not None}
    g = paired_outcomes(gf, gv)
    sf = per_item([(k, t) for k, t in full if t.decoding == "sample" and math.isclose(t.temperature, T_REF)])
    sv = per_item([(k, t) for k, t in var if t.decoding == "sample" and math.isclose(t.temperature, T_REF)])
    s = paired_rates(sf, sv, N_BOOT, seed)
    return PairedResult(variant, g.rate_a, g.rate_b, g.only_a, g.only_b, g.p, s.rate_a, s.rate_b, s.diff,
                        (s.lo, s.hi), s.p, len((set(gf) & set(gv)) | (set(sf) & set(sv))))


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
    return label_shares([t.label for t in turns], LABELS)


def turns_tvd(a: dict[str, list[Turn]], b: dict[str, list[Turn]], n_boot: int = N_BOOT,
              seed: int = 0) -> tuple[float, float, float]:
    """TVD between the label distributions of two groups of items' turns over the taxonomy's labels, with a 95%
    CI resampling items within each side (:func:`mechprobe.stats.tvd_bootstrap` on the turns' labels)."""
    return tvd_bootstrap({k: [t.label for t in v] for k, v in a.items()},
                          {k: [t.label for t in v] for k, v in b.items()}, LABELS, n_boot, seed)


def aggregate_model(data: StudyData, model: str) -> ModelAggregate:
    runs = [data.full[(model, d)] for d in data.datasets(model)]
    full = [kt for rd in runs for kt in keyed(rd)]
    g = per_item([(k, t) for k, t in full if t.decoding == "greedy"])
    s = per_item([(k, t) for k, t in full if t.decoding == "sample" and math.isclose(t.temperature, T_REF)])
    lift_test = paired_rates(g, s, N_BOOT, 0)
    lift = lift_test.as_tuple()
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
        tv = turns_tvd(mine, theirs)
    all_turns = [t for _, t in full]
    return ModelAggregate(model, rate(greedy(all_turns)), lift, lift_test.n_items, paired, coupling, len(correct), len(wrong),
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
