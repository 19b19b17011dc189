"""The intervention studies' numbers, recomputed from their committed per-turn files.

Why: a study's ``table.json`` is written by the runner; a quoted rate is bound only if it can be recomputed from
what the labellers saw and wrote. Each ``reports/interventions/<plan>/`` holds the blind sheet's key
(``heldout/sheet.key.json``: row -> arm and item), every labeller's filled sheet (``heldout/labels/*.csv``) and each
judge's verdicts (``heldout/verdicts_*.jsonl``). The table is recomputed with the same function the study uses
(:func:`mechprobe.audit.arms.study_table`) and compared with the committed ``table.json``: a difference is a
mismatch that fails ``mechprobe findings --check``.

Keys (``<study>`` is the plan name without ``interventions-``, dashes as underscores, e.g. ``0.5b_v2``):
``interventions.<study>.<arm>.<reading>`` (both labellers genuine under ``strict``/``lenient``; Clopper-Pearson
over items), ``...<reading>.vs_base`` / ``.vs_floor`` / ``.vs_control`` (paired item bootstrap),
``...<reading>.<labeller>`` (one labeller's rate), ``interventions.<study>.kappa.<reading>.labellers`` (binary κ
over every row, item bootstrap), ``interventions.<study>.<arm>.<reading>.judge_kappa.<judge>`` (κ of a judge's
verdict with the labellers' consensus on that arm's turns, no interval) and, where a study measured accuracy,
``interventions.<study>.accuracy.<model>`` (exact match over its ``accuracy/<model>.jsonl``, Clopper-Pearson) and
``...accuracy.<model>.vs_base`` (paired item bootstrap with the plan's seed); a part-2 table adds its pooled tests
(``interventions.<study>.part2.<reading>.sft_pooled.vs_base`` ...) and every arm's paired difference against the
control SFT arm (``interventions.<study>.part2.<arm>.<reading>.vs_control``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mechprobe.audit.arms import (
    READINGS,
    arm_outcomes,
    paired_difference,
    pooled_tests,
    read_sheet_labels,
    study_table,
)
from mechprobe.io import read_json, read_jsonl
from mechprobe.stats.clustered import clopper_pearson

from .values import PERCENT, RAW, RECOMPUTED, Value

__all__ = ["STUDIES", "study_key", "intervention_values"]

STUDIES = "reports/interventions"
COMPARISONS = ("vs_base", "vs_floor", "vs_control")

Committed = tuple[Value, dict[str, Any] | None, str]


def study_key(name: str) -> str:
    """``interventions-0.5b-v2`` -> ``0.5b_v2``: the study's segment in its keys."""
    return name.removeprefix("interventions-").replace("-", "_")


def _verdicts(path: Path) -> dict[str, bool]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["record_id"]] = bool(r["genuine"])
    return out


def _study(root: Path, folder: Path) -> tuple[list[Committed], list[str]]:
    rel = folder.relative_to(root).as_posix()
    committed = read_json(folder / "table.json")
    held = folder / "heldout"
    key = read_json(held / "sheet.key.json")
    files = sorted((held / "labels").glob("*.csv"))
    labs = [read_sheet_labels(f, key["sample_id"], set(key["rows"])) for f in files]
    arms = list(committed["arms"])
    specs = sorted({s for c in committed["arms"].values() for s in c["strict"].get("kappa_judge", {})})
    judges = {s: _verdicts(held / f"verdicts_{s.replace(':', '_')}.jsonl") for s in specs
              if (held / f"verdicts_{s.replace(':', '_')}.jsonl").exists()}
    missing = [s for s in specs if s not in judges]
    cw = committed.get("compared_with", {})
    tab = study_table(key["rows"], labs, arms, judges=judges or None, floor=cw.get("floor", "answer_removed"),
                      control=cw.get("control", "steer_random"))
    src = f"{rel}/heldout/sheet.key.json + {rel}/heldout/labels/"
    where = f"{rel}/table.json"
    pre = f"interventions.{study_key(folder.name)}"
    out: list[Committed] = []
    for arm, cell in tab["arms"].items():
        for reading in READINGS:
            r, c = cell[reading], committed["arms"][arm][reading]
            k = f"{pre}.{arm}.{reading}"
            out.append((Value(k, r["rate"], r["lo"], r["hi"], r["k"], r["n"], PERCENT, RECOMPUTED, src, r["method"],
                              items=r["n"]), {"point": c["rate"], "lo": c["lo"], "hi": c["hi"]}, where))
            for name, pl, pc in zip([f.stem for f in files], r["per_labeller"], c["per_labeller"]):
                out.append((Value(f"{k}.{name}", pl["rate"], pl["lo"], pl["hi"], pl["k"], pl["n"], PERCENT,
                                  RECOMPUTED, src, pl["method"], items=pl["n"]),
                            {"point": pc["rate"], "lo": pc["lo"], "hi": pc["hi"]}, where))
            for vs in COMPARISONS:
                if vs in r:
                    d, dc = r[vs], c.get(vs)
                    out.append((Value(f"{k}.{vs}", d["diff"], d["lo"], d["hi"], unit=PERCENT, how=RECOMPUTED,
                                      source=src, method=d["method"], signed=True, items=d["n"]),
                                {"point": dc["diff"], "lo": dc["lo"], "hi": dc["hi"]} if dc else None, where))
            for spec, kap in r.get("kappa_judge", {}).items():
                out.append((Value(f"{k}.judge_kappa.{spec}", kap, unit=RAW, how=RECOMPUTED,
                                  source=f"{src} + verdicts", method="cohen kappa, judge vs labeller consensus",
                                  items=r["n"]), {"kappa": c.get("kappa_judge", {}).get(spec)}, where))
    p2 = committed.get("part2")
    if p2 and "arms" in p2:  # part 2's pre-registered pooled tests, recomputed with the arms the table names
        a = p2["arms"]
        for reading in READINGS:
            t = pooled_tests(arm_outcomes(key["rows"], labs, reading), a["pooled"], a["base"], a["control"], a["floor"],
                             a["steer"], seed=int(a["seed"]))
            for vs in ("vs_base", "vs_control", "vs_floor"):
                d, dc = t[vs], p2[reading][vs]
                out.append((Value(f"{pre}.part2.{reading}.sft_pooled.{vs}", d["diff"], d["lo"], d["hi"], unit=PERCENT,
                                  how=RECOMPUTED, source=src, method="pooled seeds, item-clustered bootstrap",
                                  signed=True, items=d["n"]), {"point": dc["diff"], "lo": dc["lo"], "hi": dc["hi"]},
                            where))
            oc = arm_outcomes(key["rows"], labs, reading)
            for row in committed.get("part2_summary", {}).get("rows", []):
                dc = row[reading].get("vs_control")
                if dc is None:
                    continue
                d = paired_difference(oc.get(a["control"], {}), oc.get(row["arm"], {}), seed=int(a["seed"]))
                out.append((Value(f"{pre}.part2.{row['arm']}.{reading}.vs_control", d["diff"], d["lo"], d["hi"],
                                  unit=PERCENT, how=RECOMPUTED, source=src, method="paired item bootstrap",
                                  signed=True, items=d["n"]), {"point": dc["diff"], "lo": dc["lo"], "hi": dc["hi"]},
                            where))
    for reading, kap in tab.get("kappa_labellers", {}).items():
        c = committed.get("kappa_labellers", {}).get(reading)
        out.append((Value(f"{pre}.kappa.{reading}.labellers", kap["kappa"], kap["lo"], kap["hi"], kap["agree"],
                          kap["n"], RAW, RECOMPUTED, src, "cohen kappa, item bootstrap"), c, where))
    seed = int((p2 or {}).get("arms", {}).get("seed", 0))
    out += _accuracy(folder, rel, pre, seed)
    notes = [f"{rel}: verdicts of {', '.join(missing)} not committed; their kappas are skipped"] if missing else []
    return out, notes


def _accuracy(folder: Path, rel: str, pre: str, seed: int) -> list[Committed]:
    """Each model's exact-match accuracy and its paired difference against base, recomputed from the per-answer
    files and compared with ``accuracy/accuracy.json`` (the runner's summary)."""
    path = folder / "accuracy" / "accuracy.json"
    if not path.is_file():
        return []
    committed = read_json(path)["models"]
    where = f"{rel}/accuracy/accuracy.json"
    got = {m: {r["item_id"]: bool(r["score"]) for r in read_jsonl(folder / "accuracy" / f"{m}.jsonl")}
           for m in committed}
    out: list[Committed] = []
    for m, c in committed.items():
        v = got[m]
        k, n = sum(v.values()), len(v)
        lo, hi = clopper_pearson(k, n)
        src = f"{rel}/accuracy/{m}.jsonl"
        out.append((Value(f"{pre}.accuracy.{m}", k / n if n else float("nan"), float(lo), float(hi), k, n, PERCENT,
                          RECOMPUTED, src, "exact match, clopper-pearson", items=n), {"point": c["rate"]}, where))
        if m != "base" and "base" in got and "vs_base" in c:
            d, dc = paired_difference(got["base"], v, seed=seed), c["vs_base"]
            out.append((Value(f"{pre}.accuracy.{m}.vs_base", d["diff"], d["lo"], d["hi"], unit=PERCENT,
                              how=RECOMPUTED, source=f"{src} + base.jsonl", method="paired item bootstrap",
                              signed=True, items=d["n"]), {"point": dc["diff"], "lo": dc["lo"], "hi": dc["hi"]},
                        where))
    return out


def intervention_values(root: Path) -> tuple[list[Committed], list[str]]:
    """Every committed study's values with the committed numbers they reproduce, and notes on what was skipped.

    A study folder without ``table.json`` (still being labelled) is skipped with a note.
    """
    base = root / STUDIES
    out: list[Committed] = []
    notes: list[str] = []
    for folder in sorted(p for p in base.glob("*") if p.is_dir()) if base.is_dir() else []:
        if not (folder / "table.json").exists():
            notes.append(f"{folder.relative_to(root).as_posix()}: no table.json (no held-out labels committed); skipped")
            continue
        vals, n = _study(root, folder)
        out += vals
        notes += n
    return out, notes
