"""Arms labelled blind on the same items: the table, a pure function of the sheet's key and the labellers' (and
judges') labels; reading a labeller's filled sheet; the pre-registered tests.

Why in the audit layer: the study computes the table and ``mechprobe findings`` recomputes it from the committed
files; both must run the same code, and findings sits below the study.

Pre-registered reading (plan ``metrics``): a turn counts as genuine under a reading when *both* labellers say so
under that reading (per-labeller rates are reported beside it). Each arm holds one turn per item, so a rate's
interval is Clopper-Pearson over items, and an arm is compared with another on the same items: the paired
difference with a paired item bootstrap interval (resampling items, both arms' turns of an item together) and the
exact McNemar p-value on the discordant items.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.audit.agreement import kappa_with_ci
from mechprobe.audit.labels import read_labellers_file
from mechprobe.audit.readings import LENIENT, STRICT, genuine_under
from mechprobe.errors import UsageError
from mechprobe.stats.agreement import cohen_kappa
from mechprobe.stats.clustered import clopper_pearson
from mechprobe.stats.paired import mcnemar_exact
from mechprobe.taxonomy import GENUINE

__all__ = ["arm_outcomes", "study_table", "paired_difference", "clustered_difference", "pooled_tests",
           "table_markdown", "read_sheet_labels", "study_outcome"]

READINGS = ("strict", "lenient")


def arm_outcomes(key: Mapping[str, Mapping[str, Any]], labels: Sequence[Mapping[str, Mapping[str, Any]]],
                 reading: str) -> dict[str, dict[str, bool]]:
    """``arm -> item -> genuine`` under ``reading``, a turn counting when every labeller says genuine.

    Args:
        key: sheet row -> ``{"arm", "item_id", ...}``.
        labels: one ``row -> {strict_genuine, lenient_genuine}`` per labeller (every row labelled).
        reading: ``"strict"`` or ``"lenient"``.
    """
    f = f"{reading}_genuine"
    out: dict[str, dict[str, bool]] = {}
    for row, meta in key.items():
        out.setdefault(meta["arm"], {})[meta["item_id"]] = all(bool(lab[row][f]) for lab in labels)
    return out


def paired_difference(a: Mapping[str, bool], b: Mapping[str, bool], n_boot: int = 20000, seed: int = 0
                      ) -> dict[str, Any]:
    """``rate(b) - rate(a)`` on the items both arms have, with a paired item bootstrap CI and McNemar's exact p.

    Why 20,000 resamples: the third digit of the interval's bounds is then stable across seeds (checked by
    :func:`tests` over seeds), where 2,000 moved it.
    """
    items = sorted(set(a) & set(b))
    if not items:
        return {"n": 0, "diff": float("nan"), "lo": float("nan"), "hi": float("nan"), "p_mcnemar": float("nan")}
    x = np.array([float(a[i]) for i in items])
    y = np.array([float(b[i]) for i in items])
    d = y - x
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(items), size=(n_boot, len(items)))
    boots = d[draws].mean(1)
    lo, hi = (float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)))
    point = float(d.mean())
    lo, hi = min(lo, point), max(hi, point)
    b_only = int(((y == 1) & (x == 0)).sum())
    a_only = int(((x == 1) & (y == 0)).sum())
    return {"n": len(items), "diff": point, "lo": lo, "hi": hi, "b_only": b_only, "a_only": a_only,
            "p_mcnemar": mcnemar_exact(b_only, a_only), "method": f"paired item bootstrap ({n_boot} resamples)"}


def clustered_difference(a: Mapping[str, Sequence[bool]], b: Mapping[str, Sequence[bool]], n_boot: int = 20000,
                         seed: int = 0) -> dict[str, Any]:
    """``mean(b) - mean(a)`` where an item may hold several turns per arm (an arm pooled over training seeds): per
    item the mean of its turns, then the item-clustered bootstrap (resampling items, every turn of an item moving
    with it), so seeds never count as independent items.

    Example:
        >>> r = clustered_difference({"i1": [False], "i2": [False]}, {"i1": [True, True, False], "i2": [True] * 3})
        >>> round(r["diff"], 3), r["n"]
        (0.833, 2)
    """
    items = sorted(set(a) & set(b))
    if not items:
        return {"n": 0, "diff": float("nan"), "lo": float("nan"), "hi": float("nan")}
    d = np.array([np.mean(b[i]) - np.mean(a[i]) for i in items], dtype=float)
    draws = np.random.default_rng(seed).integers(0, len(items), size=(n_boot, len(items)))
    boots = d[draws].mean(1)
    point = float(d.mean())
    lo, hi = float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))
    return {"n": len(items), "diff": point, "lo": min(lo, point), "hi": max(hi, point),
            "method": f"item-clustered bootstrap ({n_boot} resamples)"}


def pooled_tests(outcomes: Mapping[str, Mapping[str, bool]], pooled: Sequence[str], base: str, control: str,
                 floor: str, steer: str | None = None, threshold: float = 0.10, n_boot: int = 20000, seed: int = 0
                 ) -> dict[str, Any]:
    """Part 2's tests on one reading: the pooled arm (its seeds together) against base, control and floor, each
    with its verdict (``pass``: CI excludes 0 and the point clears ``threshold`` where one applies; ``refuted``: the
    CI's upper bound is below the threshold, a powered null; else ``inconclusive``), and the steering arm's lift
    as a share of the pooled arm's (point and item-bootstrap interval; the test asks for at least half)."""
    items = sorted(set.intersection(*(set(outcomes.get(a, {})) for a in pooled))) if pooled else []
    pool = {i: [bool(outcomes[a][i]) for a in pooled] for i in items}

    def one(arm: str) -> dict[str, list[bool]]:
        return {i: [bool(v)] for i, v in outcomes.get(arm, {}).items()}

    def _verdict(r: Mapping[str, Any], thr: float) -> str:
        if r["n"] and r["lo"] > 0 and r["diff"] >= thr:
            return "pass"
        return "refuted" if r["n"] and r["hi"] < thr else "inconclusive"

    out: dict[str, Any] = {"pooled": list(pooled), "n_items": len(items)}
    for name, other, thr in (("vs_base", base, threshold), ("vs_control", control, threshold), ("vs_floor", floor, 0.0)):
        r = clustered_difference(one(other), pool, n_boot, seed)
        out[name] = {**r, "threshold": thr, "verdict": _verdict(r, thr) if thr > 0 else
                     ("pass" if r["n"] and r["lo"] > 0 else "inconclusive")}
    if steer is not None and outcomes.get(steer):
        common = sorted(set(items) & set(outcomes[steer]) & set(outcomes.get(base, {})))
        if common:
            b = np.array([float(outcomes[base][i]) for i in common])
            p = np.array([np.mean(pool[i]) for i in common])
            s = np.array([float(outcomes[steer][i]) for i in common])
            draws = np.random.default_rng(seed).integers(0, len(common), size=(n_boot, len(common)))
            num, den = (s - b)[draws].mean(1), (p - b)[draws].mean(1)
            ratio = np.where(np.abs(den) > 1e-12, num / np.where(den == 0, 1, den), np.nan)
            point = float((s - b).mean() / (p - b).mean()) if abs((p - b).mean()) > 1e-12 else float("nan")
            lo, hi = (float(x) for x in np.nanquantile(ratio, [0.025, 0.975])) if np.isfinite(ratio).any() \
                else (float("nan"), float("nan"))
            out["steer_share"] = {"arm": steer, "n": len(common), "share": point, "lo": lo, "hi": hi,
                                  "verdict": "pass" if point >= 0.5 and lo > 0 else
                                  ("refuted" if hi < 0.5 else "inconclusive")}
    return out


def _rate(outcome: Mapping[str, bool]) -> dict[str, Any]:
    k, n = sum(outcome.values()), len(outcome)
    lo, hi = clopper_pearson(k, n) if n else (float("nan"), float("nan"))
    return {"k": int(k), "n": n, "rate": k / n if n else float("nan"), "lo": float(lo), "hi": float(hi),
            "method": "clopper-pearson over items"}


def study_table(key: Mapping[str, Mapping[str, Any]], labels: Sequence[Mapping[str, Mapping[str, Any]]],
                arms: Sequence[str], base: str = "base", floor: str = "answer_removed",
                control: str = "steer_random", judges: Mapping[str, Mapping[str, bool]] | None = None
                ) -> dict[str, Any]:
    """Every number the study reports: per arm and reading, the rate, the paired difference against ``base``,
    per-labeller rates and the labellers' κ; for steering arms also against ``floor`` and ``control``.

    Args:
        key: sheet row -> ``{"arm", "item_id"}``.
        labels: the labellers' parsed labels (row -> fields), in labeller-name order.
        arms: the plan's arms, in order.
        base, floor, control: the arms compared against.
        judges: ``judge spec -> row -> genuine`` verdicts, for judge-vs-labeller κ per arm.
    """
    out: dict[str, Any] = {"arms": {}, "n_labellers": len(labels)}
    for reading in READINGS:
        oc = arm_outcomes(key, labels, reading)
        per_lab = [arm_outcomes(key, [lab], reading) for lab in labels]
        for arm in arms:
            cell = out["arms"].setdefault(arm, {})
            r: dict[str, Any] = {**_rate(oc.get(arm, {})),
                                 "per_labeller": [_rate(p.get(arm, {})) for p in per_lab]}
            if arm != base:
                r["vs_base"] = paired_difference(oc.get(base, {}), oc.get(arm, {}))
            if arm.startswith("steer") or arm == base:
                if arm != floor:
                    r["vs_floor"] = paired_difference(oc.get(floor, {}), oc.get(arm, {}))
            if arm.startswith("steer") and arm != control:
                r["vs_control"] = paired_difference(oc.get(control, {}), oc.get(arm, {}))
            rows = sorted(k for k, m in key.items() if m["arm"] == arm)
            f = f"{reading}_genuine"
            if len(labels) >= 2:
                r["kappa_labellers"] = cohen_kappa([labels[0][k][f] for k in rows], [labels[1][k][f] for k in rows],
                                                   labels=[False, True])
            if judges:
                r["kappa_judge"] = {spec: cohen_kappa([v[k] for k in rows], [oc[arm][key[k]["item_id"]] for k in rows],
                                                      labels=[False, True])
                                    for spec, v in judges.items()}
                r["judge_rate"] = {spec: float(np.mean([v[k] for k in rows])) if rows else float("nan")
                                   for spec, v in judges.items()}
            cell[reading] = r
        if len(labels) >= 2:
            rows = sorted(key)
            f = f"{reading}_genuine"
            la, lb = ([GENUINE if lab[k][f] else "other" for k in rows] for lab in labels[:2])
            out.setdefault("kappa_labellers", {})[reading] = kappa_with_ci(
                la, lb, [key[k]["item_id"] for k in rows], binary=True).to_dict()
    return out


LIFT = 0.10  # the pre-registered lift, and the powered null's bound: 10 points


def study_outcome(table: Mapping[str, Any], primary: str = "steer_audited", base: str = "base",
            sampled: str = "base_t1") -> dict[str, Any]:
    """The pre-registered tests on the strict reading, read off :func:`study_table`'s output.

    ``lift``: ``primary`` - ``base`` >= +10 points with the paired CI excluding 0; ``floor`` / ``control``: its
    paired CI against the answer-removed arm / the random direction excludes 0. When the lift fails, the result is
    a *powered null* if every steering arm's CI upper bound against base is below +10 points, else
    *inconclusive*. ``sampling``: ``sampled`` - ``base`` with its CI (reported, not a test).

    Returns:
        ``{"lift", "floor", "control": bool | None, "outcome": "effect" | "effect, not above floor/control" |
        "powered null" | "inconclusive", "why": one line, "sampling": the difference or None}``.
    """
    arms = table["arms"]
    s = arms.get(primary, {}).get("strict", {})

    def excludes0(d: Mapping[str, Any] | None) -> bool | None:
        return None if not d else bool(d["lo"] > 0)

    vb = s.get("vs_base")
    lift = None if not vb else bool(vb["diff"] >= LIFT and vb["lo"] > 0)
    floor, control = excludes0(s.get("vs_floor")), excludes0(s.get("vs_control"))
    steer = {a: c["strict"]["vs_base"] for a, c in arms.items() if a.startswith("steer") and "vs_base" in c["strict"]}
    if lift:
        outcome = "effect" if floor and control else "effect, not above floor/control"
        why = f"{primary} - {base} = {100 * vb['diff']:+.1f} points [{100 * vb['lo']:+.1f}, {100 * vb['hi']:+.1f}]"
    elif steer and all(d["hi"] < LIFT for d in steer.values()):
        outcome = "powered null"
        why = "every steering arm's strict CI upper bound against base is below +10 points: " + ", ".join(
            f"{a} {100 * d['hi']:+.1f}" for a, d in steer.items())
    else:
        outcome = "inconclusive"
        why = "no lift of +10 points with CI > 0, and not every steering arm's upper bound is below +10 points"
    samp = arms.get(sampled, {}).get("strict", {}).get("vs_base")
    return {"lift": lift, "floor": floor, "control": control, "outcome": outcome, "why": why, "sampling": samp}


def read_sheet_labels(path: Path, sample_id: str, keys: set[str]) -> dict[str, dict[str, Any]]:
    """One labeller's filled sheet: ``row -> {label, strict_genuine, lenient_genuine, borderline, note}``.

    Refuses a file of another sheet, rows not on the sheet, and a ``genuine_followup`` row without its strict
    reading: under codebook v2 every genuine row says whether it is genuine under the strict reading too, so the
    strict rate is the labellers' own call, never a stand-in rule.
    """
    labs = read_labellers_file(path, kind="model")
    if len(labs) != 1:
        raise UsageError(f"{path}: holds {len(labs)} labellers; give each labeller their own file")
    lab = labs[0]
    if lab.sample_id and lab.sample_id != sample_id:
        raise UsageError(f"{path}: labels sheet {lab.sample_id!r}, not {sample_id!r}; label the sheet beside its key")
    out: dict[str, dict[str, Any]] = {}
    for r in lab.rows:
        if r.row not in keys:
            raise UsageError(f"{path}: row {r.row!r} is not on sheet {sample_id!r}")
        if r.label == GENUINE and r.strict is None:
            raise UsageError(f"{path}: row {r.row} is genuine_followup without its strict reading; fill the strict "
                             f"column (yes, or the label it gets under the strict reading)")
        out[r.row] = {"label": r.label, "strict": r.strict, "borderline": r.borderline, "note": r.note,
                      "lenient_genuine": genuine_under(r, LENIENT), "strict_genuine": genuine_under(r, STRICT)}
    return out


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}"


def table_markdown(table: Mapping[str, Any], model: str, judge_note: str) -> str:
    """The table as markdown: arm, n, strict and lenient rate with CI, paired difference vs base, κ."""
    lines = [f"Model `{model}`; labels: {table['n_labellers']} blind model-written labellers (codebook v2), a turn "
             f"counts when every labeller says genuine; rates are labeller consensus, not corrected by any judge. "
             f"{judge_note}", "",
             "| arm | n items | strict % [95% CI] | lenient % [95% CI] | strict vs base, points [95% CI] (McNemar p) "
             "| lenient vs base | κ labellers strict / lenient |", "|---|---|---|---|---|---|---|"]
    for arm, cell in table["arms"].items():
        s, le = cell["strict"], cell["lenient"]

        def diff(c: Mapping[str, Any]) -> str:
            v = c.get("vs_base")
            if not v:
                return "—"
            return f"{100 * v['diff']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}] (p {v['p_mcnemar']:.3g})"

        lines.append(f"| {arm} | {s['n']} | {s['k']}/{s['n']} = {_pct(s['rate'])} [{_pct(s['lo'])}, {_pct(s['hi'])}] "
                     f"| {le['k']}/{le['n']} = {_pct(le['rate'])} [{_pct(le['lo'])}, {_pct(le['hi'])}] | {diff(s)} "
                     f"| {diff(le)} | {s.get('kappa_labellers', float('nan')):.2f} / "
                     f"{le.get('kappa_labellers', float('nan')):.2f} |")
    lines += ["", "| comparison (strict reading) | points [95% CI] (McNemar p) |", "|---|---|"]
    for arm, cell in table["arms"].items():
        for vs in ("vs_floor", "vs_control"):
            v = cell["strict"].get(vs)
            if v:
                lines.append(f"| {arm} {vs.replace('_', ' ')} | {100 * v['diff']:+.1f} [{100 * v['lo']:+.1f}, "
                             f"{100 * v['hi']:+.1f}] (p {v['p_mcnemar']:.3g}) |")
    for reading, k in table.get("kappa_labellers", {}).items():
        lines.append(f"\nLabeller κ over every row, {reading} reading: {k['kappa']:.2f} [{k['lo']:.2f}, {k['hi']:.2f}] "
                     f"({k['agree']}/{k['n']} agree; item bootstrap).")
    if table.get("study_outcome"):
        v = table["study_outcome"]
        lines.append(f"\n**Pre-registered outcome: {v['outcome']}** ({v['why']}).")
    return "\n".join(lines) + "\n"
