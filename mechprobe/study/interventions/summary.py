"""Part 2's one table: per arm its rates, its paired differences against base and control, the answer-removed
floor, its model's accuracy and what it cost.

Why a separate, pure step: the issue's table joins four files that different steps wrote (the labels' table,
``accuracy/accuracy.json``, the ledger and ``post_training/patching.json``). Joining them in one function of plain
data keeps the table recomputable from the committed files alone, without the runs or the models.

Cost is the ledger's wall time of the steps that produced the arm (its training, its held-out turns, its accuracy
answers), and *core-minutes* = wall minutes x the cores the ledger's CPU names: an upper bound on CPU time, since a
step rarely keeps every core busy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mechprobe.audit.arms import paired_difference
from mechprobe.stats.clustered import clopper_pearson

__all__ = ["ArmSpec", "arm_steps", "part2_summary", "summary_markdown"]

READINGS = ("strict", "lenient")
PART1 = "part1:"

ArmSpec = Mapping[str, Any]  # a plan arm's raw entry: name, kind, adapter, ...


def arm_steps(arm: ArmSpec, dpo_methods: Mapping[str, str] | None = None) -> list[str]:
    """The ledger steps whose outputs make ``arm`` (shared steps such as ``sft_data`` are not charged to an arm).

    Example:
        >>> arm_steps({"name": "sft_s0", "kind": "adapter", "adapter": "sft_s0"})
        ['train_sft_s0', 'heldout_sft_s0', 'accuracy_sft_s0']
    """
    name, kind = arm["name"], arm.get("kind")
    if arm.get("reuse") == "part1":
        return [f"{PART1}heldout_{name}", *(["accuracy_base"] if name == "base" else [])]
    if kind == "adapter":
        ad = arm["adapter"]
        pre = ["dpo_pairs"] if (dpo_methods or {}).get(ad) == "dpo" else []
        return [*pre, f"train_{ad}", f"heldout_{name}", f"accuracy_{ad}"]
    if kind == "steer":
        return ["post_train_turns", "post_direction", "post_select", f"heldout_{name}"]
    if kind == "patch":
        return ["patch", f"heldout_{name}"]
    return [f"heldout_{name}"]


def _seconds(step: Mapping[str, Any]) -> float:
    """A step's wall seconds; a step that reused another plan's output (0 s here) is charged what it cost there."""
    info = step.get("info") or {}
    if info.get("reused_from") and not float(step.get("seconds") or 0):
        return float(info.get("source_seconds") or 0)
    return float(step.get("seconds") or 0)


def _cores(cpu: str) -> int:
    m = re.search(r"(\d+) cores", cpu or "")
    return int(m.group(1)) if m else 1


def _acc_cell(rec: Mapping[str, Any], model: str) -> dict[str, Any]:
    n = int(rec["n"])
    k = int(round(float(rec["rate"]) * n)) if n else 0
    lo, hi = clopper_pearson(k, n) if n else (float("nan"), float("nan"))
    out = {"model": model, "k": k, "n": n, "rate": float(rec["rate"]), "lo": float(lo), "hi": float(hi),
           "cut_at_cap": rec.get("cut_at_cap")}
    if "vs_base" in rec:
        out["vs_base"] = rec["vs_base"]
    return out


def part2_summary(table: Mapping[str, Any], arms: Sequence[ArmSpec], outcomes: Mapping[str, Mapping[str, Any]],
                  *, control: str, floor: str, base: str = "base", accuracy: Mapping[str, Any] | None = None,
                  steps: Mapping[str, Mapping[str, Any]] | None = None, dpo_methods: Mapping[str, str] | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """One row per arm: n, strict and lenient rate with CI, paired difference vs ``base`` and vs ``control`` with
    CI (same items, item bootstrap), accuracy with CI, cost; plus the answer-removed ``floor`` arm's rates.

    Args:
        table: the labels' table (:func:`~mechprobe.audit.arms.study_table`'s output).
        arms: the plan's arms (raw entries), in order.
        outcomes: ``reading -> arm -> item -> genuine`` (the labellers' consensus, as the table used).
        control: the control arm (SFT on mismatched conversations); every other arm gets its difference against it.
        floor: the answer-removed arm.
        base: the reference arm.
        accuracy: ``accuracy.json``'s ``models`` (model -> rate, n, cut_at_cap, vs_base), or ``None`` if not run.
        steps: ledger step -> ``{"seconds", "cpu"}`` (``part1:`` names for the parent's steps).
        dpo_methods: adapter -> training method, so a DPO arm is charged its pairs step.
        seed: the bootstrap's seed (the plan's).
    Returns:
        ``{"rows": [...], "floor": arm, "control": arm, "base": arm, "cost_note": str}``.
    """
    acc = accuracy or {}
    steps = steps or {}
    rows = []
    for arm in arms:
        name = arm["name"]
        cell = table["arms"].get(name)
        if cell is None:
            continue
        row: dict[str, Any] = {"arm": name, "kind": arm.get("kind"), "n": cell["strict"]["n"]}
        for r in READINGS:
            c = cell[r]
            row[r] = {k: c[k] for k in ("k", "n", "rate", "lo", "hi")}
            row[r]["vs_base"] = c.get("vs_base")
            row[r]["vs_control"] = (paired_difference(outcomes[r].get(control, {}), outcomes[r].get(name, {}),
                                                      seed=seed) if name not in (control, base) else None)
        model = arm.get("adapter") if arm.get("kind") == "adapter" else (base if name == base else None)
        row["accuracy"] = _acc_cell(acc[model], model) if model in acc else None
        own = arm_steps(arm, dpo_methods)
        have = [s for s in own if s in steps]
        wall = sum(_seconds(steps[s]) for s in have) / 60
        core = sum(_seconds(steps[s]) * _cores(str(steps[s].get("cpu", ""))) for s in have) / 60
        row["cost"] = {"steps": own, "missing": [s for s in own if s not in steps], "wall_min": round(wall, 1),
                       "core_min": round(core, 1)}
        rows.append(row)
    return {"rows": rows, "base": base, "control": control, "floor": floor,
            "cost_note": "wall minutes of the arm's own steps in the ledger (training, held-out turns, accuracy "
                         "answers); core-minutes = wall x the ledger CPU's cores, an upper bound on CPU time"}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}"


def _rate(c: Mapping[str, Any]) -> str:
    return f"{c['k']}/{c['n']} = {_pct(c['rate'])} [{_pct(c['lo'])}, {_pct(c['hi'])}]"


def _diff(v: Mapping[str, Any] | None) -> str:
    if not v:
        return "—"
    return f"{100 * v['diff']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}]"


def summary_markdown(summary: Mapping[str, Any], pooled: Mapping[str, Any] | None = None,
                     patching: Mapping[str, Any] | None = None) -> str:
    """The summary as markdown: the arm table, the pre-registered pooled tests and the patching profile."""
    c, b = summary["control"], summary["base"]
    lines = ["## Part 2: every arm against base and control", "",
             f"Rates are the two labellers' consensus (model-written labels, not corrected by any judge); differences "
             f"are paired on the same items (item bootstrap, 95%). Accuracy: exact match on the plan's GSM8K items "
             f"(Clopper-Pearson 95%; vs {b}: paired). Cost: {summary['cost_note']}.", "",
             f"| arm | n items | strict % [95% CI] | lenient % [95% CI] | strict vs {b}, points | strict vs {c} "
             f"| lenient vs {b} | lenient vs {c} | accuracy % [95% CI] (vs {b}) | cost: wall min (core-min) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        a = r["accuracy"]
        acc = "—" if not a else f"{_rate(a)} ({_diff(a.get('vs_base')) if a.get('vs_base') else 'ref.'})"
        cost = r["cost"]
        miss = ", ".join(cost["missing"])
        cst = (f"— (not in the ledger: {miss})" if len(cost["missing"]) == len(cost["steps"]) else
               f"{cost['wall_min']:.1f} ({cost['core_min']:.1f})" + (f" (not yet in the ledger: {miss})" if miss else ""))
        name = r["arm"] + (" (floor)" if r["arm"] == summary["floor"] else "")
        lines.append(f"| {name} | {r['n']} | {_rate(r['strict'])} | {_rate(r['lenient'])} "
                     f"| {_diff(r['strict']['vs_base'])} | {_diff(r['strict']['vs_control'])} "
                     f"| {_diff(r['lenient']['vs_base'])} | {_diff(r['lenient']['vs_control'])} | {acc} | {cst} |")
    if pooled:
        lines += ["", "| pre-registered test (SFT seeds pooled, clustered by item) | reading | points [95% CI] | "
                      "verdict |", "|---|---|---|---|"]
        for reading, t in pooled.items():
            if reading == "arms":
                continue
            for k in ("vs_base", "vs_control", "vs_floor"):
                v = t.get(k)
                if v:
                    lines.append(f"| SFT {k.replace('_', ' ')} | {reading} | {_diff(v)} | {v['verdict']} |")
            s = t.get("steer_share")
            if s:
                lines.append(f"| {s['arm']}'s share of SFT's lift | {reading} | {_pct(s['share'])}% "
                             f"[{_pct(s['lo'])}, {_pct(s['hi'])}] (n {s['n']}) | {s['verdict']} |")
    if patching:
        lines += ["", f"Where post-training acts: `{patching['adapter']}`'s boundary residual patched into the base, "
                      f"the fraction of the log-likelihood gap of its own held-out turns that each layer recovers "
                      f"(teacher-forced, {len(patching['items'])} items, no labels; item bootstrap 95%).", "",
                  "| layer | recovered fraction [95% CI] |", "|---|---|"]
        for layer, v in sorted(patching["by_layer"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {layer} | {v['fraction']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}] |")
        lines.append(f"\nBest layers: {', '.join(str(x) for x in patching['best_layers'])}; layers whose interval "
                     f"excludes 0: {', '.join(str(x) for x in patching.get('acting_layers', [])) or 'none'}.")
    return "\n".join(lines) + "\n"
