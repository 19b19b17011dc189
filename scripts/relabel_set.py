"""Re-label committed turns of the labelled set under the current codebook, blind, and score them.

    python scripts/relabel_set.py sheets --model qwen2.5-coder-1.5b-instruct --dataset mt_bench \
        --out reports/relabel_v2/qwen2.5-coder-1.5b-instruct-mt_bench
    # labellers fill labels/<name>.csv (from sheet.csv) and identify_labels/<name>.csv (from identify_sheet.csv)
    python scripts/relabel_set.py score --out reports/relabel_v2/qwen2.5-coder-1.5b-instruct-mt_bench

Why a script over the committed labelled set (reports/labelled_turns) rather than ``mechprobe audit`` on a run:
these turns' runs are not kept, but their texts, the earlier labels and the judges' verdicts are, so the
re-labelling and everything computed from it can be re-checked from committed files alone.

The sheets are blind: rows are shuffled with opaque keys and carry only the query, the answer and the turn
(``sheet.csv``), or the turn and two answers to the same query in seeded random order (``identify_sheet.csv``;
the distractor is the real answer with its key numbers changed, :func:`mechprobe.audit.identify.perturb_numbers`,
because every condition of an item followed the same answer). ``key.json`` maps rows back to turns and says
which answer is real; labellers never see it.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.audit.codebook import CODEBOOK_VERSION  # noqa: E402
from mechprobe.audit.identify import CANT_TELL, perturb_numbers, score_choices  # noqa: E402
from mechprobe.audit.readings import STRICT  # noqa: E402
from mechprobe.judges.agreement import cohen_kappa  # noqa: E402
from mechprobe.judges.factory import canonical_spec  # noqa: E402
from mechprobe.stats import wilson  # noqa: E402
from mechprobe.stats.clustered import clopper_pearson  # noqa: E402
from mechprobe.taxonomy import GENUINE, LABELS  # noqa: E402

SET = Path(__file__).resolve().parents[1] / "reports" / "labelled_turns"


def _key(salt: str, turn_id: str) -> str:
    return "r" + hashlib.sha256(f"{salt}|{turn_id}".encode()).hexdigest()[:10]


def _turns(model: str, dataset: str) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (SET / "turns.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["model"] == model and r["dataset"] == dataset]


def sheets(model: str, dataset: str, out: Path, seed: int = 0) -> None:
    """Write the blind sheets and the key for every turn of ``model`` on ``dataset`` in the labelled set."""
    turns = _turns(model, dataset)
    if not turns:
        raise SystemExit(f"no turns of {model} on {dataset} in {SET / 'turns.jsonl'}")
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    order = sorted(turns, key=lambda r: r["turn_id"])
    rng.shuffle(order)
    key: dict[str, Any] = {"model": model, "dataset": dataset, "seed": seed, "codebook": CODEBOOK_VERSION,
                           "rows": {}, "identify": {}, "identify_left_out": []}
    with open(out / "sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "query", "answer", "user_turn"])
        for r in order:
            k = _key("label", r["turn_id"])
            key["rows"][k] = r["turn_id"]
            w.writerow([k, r["query"], r["answer"], r["turn"]])
    ident = order[:]
    rng.shuffle(ident)
    with open(out / "identify_sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "user_turn", "answer_A", "answer_B"])
        for r in ident:
            fake = perturb_numbers(r["answer"], r["query"], r["item_id"])
            if fake is None or fake == r["answer"]:
                key["identify_left_out"].append(r["turn_id"])
                continue
            k = _key("identify", r["turn_id"])
            real = rng.choice("AB")
            key["identify"][k] = {"turn_id": r["turn_id"], "real": real}
            a, b = (r["answer"], fake) if real == "A" else (fake, r["answer"])
            w.writerow([k, r["turn"], a, b])
    (out / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    print(f"{len(order)} rows -> {out / 'sheet.csv'}; {len(key['identify'])} pairs -> "
          f"{out / 'identify_sheet.csv'} ({len(key['identify_left_out'])} answers have no number to change)")


def _read_csv(p: Path) -> list[dict[str, str]]:
    with open(p, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def _labels(out: Path, key: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """labeller -> turn_id -> {label, strict_label, borderline, note} from ``labels/*.csv``."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for p in sorted((out / "labels").glob("*.csv")):
        rows: dict[str, dict[str, Any]] = {}
        for r in _read_csv(p):
            tid = key["rows"].get(r["row"].strip())
            label = r["label"].strip()
            if tid is None or label not in LABELS:
                raise SystemExit(f"{p}: row {r['row']!r} label {label!r}: unknown row or label")
            borderline = r.get("borderline", "").strip().lower() in ("1", "true", "yes", "y")
            strict_raw = (r.get("strict") or "").strip().lower()
            if label != GENUINE:
                strict = label
            elif strict_raw in ("yes", "y", "1", "true"):
                strict = GENUINE
            elif strict_raw in ("", ):
                strict = GENUINE if not borderline else "generic_followup"
            elif strict_raw in ("no", "n", "0", "false"):
                strict = "generic_followup"
            elif strict_raw in LABELS:
                strict = strict_raw
            else:
                raise SystemExit(f"{p}: row {r['row']!r}: strict {strict_raw!r} is not yes/no or a label")
            rows[tid] = {"label": label, "strict_label": strict, "borderline": borderline,
                         "note": r.get("note", "").strip()}
        if len(rows) != len(key["rows"]):
            raise SystemExit(f"{p}: {len(rows)} of {len(key['rows'])} rows labelled; label every row")
        found[p.stem] = rows
    return found


def _rate(flags: list[bool]) -> dict[str, Any]:
    k, n = sum(flags), len(flags)
    lo, hi = clopper_pearson(k, n, 0.05) if k in (0, n) else wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci": [lo, hi]}


def score(out: Path) -> dict[str, Any]:
    """Rates (lenient, strict; per labeller and consensus), judge kappa, and answer identification."""
    key = json.loads((out / "key.json").read_text())
    keyed = set(key["rows"].values())  # the sheet's turns (a set may keep only part of the labelled set's)
    turns = {r["turn_id"]: r for r in _turns(key["model"], key["dataset"]) if r["turn_id"] in keyed}
    labs = _labels(out, key)
    v1 = {}
    for name in ("labeller-a", "labeller-b"):
        d = json.loads((SET / "labels" / f"{name}.json").read_text())
        v1[name] = {r["row"]: r for r in d["rows"]}
    judge = {}
    for x in (SET / "judges.jsonl").read_text().splitlines():
        j = json.loads(x)
        if j["turn_id"] in turns and canonical_spec(j["spec"]).startswith("hybrid-voice:"):  # recorded as hybrid2: too
            judge[j["turn_id"]] = j["label"]
    conds = sorted({r["condition"] for r in turns.values()})
    names = sorted(labs)
    rep: dict[str, Any] = {"model": key["model"], "dataset": key["dataset"], "codebook": key["codebook"],
                           "labellers": names, "n_turns": len(turns), "by_condition": {}, "kappa": {}}
    for c in conds:
        ids = sorted(t for t, r in turns.items() if r["condition"] == c)
        cell: dict[str, Any] = {"n": len(ids), "items": len({turns[t]["item_id"] for t in ids})}
        for reading in ("lenient", STRICT):
            field = "label" if reading == "lenient" else "strict_label"
            per = {n: _rate([labs[n][t][field] == GENUINE for t in ids]) for n in names}
            both = _rate([all(labs[n][t][field] == GENUINE for n in names) for t in ids])
            either = _rate([any(labs[n][t][field] == GENUINE for n in names) for t in ids])
            cell[reading] = {"per_labeller": per, "both": both, "either": either}
        cell["v1_lenient_both"] = _rate([all(v1[n][t]["label"] == GENUINE for n in v1) for t in ids])
        judged = [t for t in ids if t in judge]  # the labelled set keeps verdicts for its test split only
        cell["judge_only"] = _rate([judge[t] == GENUINE for t in judged])
        rep["by_condition"][c] = cell
    ids = sorted(turns)
    judged = [t for t in ids if t in judge]
    rep["n_judged"] = len(judged)
    a, b = names[0], names[-1]

    def calls(who: dict[str, Any], field: str, among: list[str]) -> list[str]:
        return ["g" if who[t][field] == GENUINE else "n" for t in among]

    for reading, field in (("lenient", "label"), (STRICT, "strict_label")):
        gj = ["g" if judge[t] == GENUINE else "n" for t in judged]
        rep["kappa"][reading] = {"labellers": cohen_kappa(calls(labs[a], field, ids), calls(labs[b], field, ids)),
                                 "judge_vs_" + a: cohen_kappa(gj, calls(labs[a], field, judged)),
                                 "judge_vs_" + b: cohen_kappa(gj, calls(labs[b], field, judged))}
    v1a = ["g" if v1["labeller-a"][t]["label"] == GENUINE else "n" for t in ids]
    v1b = ["g" if v1["labeller-b"][t]["label"] == GENUINE else "n" for t in ids]
    rep["kappa"]["v1_lenient_labellers"] = cohen_kappa(v1a, v1b)
    rep["identification"] = _identification(out, key, turns)
    _write_evidence(out, key, turns, labs, v1, judge)
    (out / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    (out / "report.md").write_text(markdown(rep))
    print(markdown(rep))
    return rep


def _identification(out: Path, key: dict[str, Any], turns: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {"left_out": len(key["identify_left_out"]), "by_labeller": {}}
    for p in sorted((out / "identify_labels").glob("*.csv")):
        by_cond: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
        for r in _read_csv(p):
            k = r["row"].strip()
            if k not in key["identify"]:
                raise SystemExit(f"{p}: unknown row {k!r}")
            choice = r["choice"].strip()
            choice = CANT_TELL if choice.lower().replace("'", "").replace(" ", "_") in ("cant_tell", "cannot_tell") \
                else choice.upper()
            if choice not in ("A", "B", CANT_TELL):
                raise SystemExit(f"{p}: row {k!r}: choice {r['choice']!r} is not A, B or cant_tell")
            info = key["identify"][k]
            cond = turns[info["turn_id"]]["condition"]
            by_cond[cond][0].append(choice)
            by_cond[cond][1].append(info["real"])
            by_cond["all"][0].append(choice)
            by_cond["all"][1].append(info["real"])
        res["by_labeller"][p.stem] = {c: score_choices(ch, real) for c, (ch, real) in sorted(by_cond.items())}
    return res


def _write_evidence(out: Path, key: dict[str, Any], turns: dict[str, Any], labs: dict[str, Any],
                    v1: dict[str, Any], judge: dict[str, str]) -> None:
    ident_choice: dict[str, dict[str, str]] = defaultdict(dict)
    row_of = {v["turn_id"]: (k, v["real"]) for k, v in key["identify"].items()}
    for p in sorted((out / "identify_labels").glob("*.csv")):
        for r in _read_csv(p):
            ident_choice[key["identify"][r["row"].strip()]["turn_id"]][p.stem] = r["choice"].strip()
    with open(out / "evidence.jsonl", "w", encoding="utf-8") as f:
        for tid in sorted(turns):
            t = turns[tid]
            rec = {"turn_id": tid, "item_id": t["item_id"], "condition": t["condition"], "split": t["split"],
                   "query": t["query"], "answer": t["answer"], "turn": t["turn"],
                   "judge": {"spec": "hybrid-voice:" + key["model"], "label": judge.get(tid)},
                   "labels_v2": {n: labs[n][tid] for n in sorted(labs)},
                   "labels_v1": {n: {k: v1[n][tid][k] for k in ("label", "borderline", "note")} for n in sorted(v1)},
                   "identify": ({"real": row_of[tid][1], "choices": ident_choice.get(tid, {})}
                                if tid in row_of else None)}
            f.write(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")


def _pct(r: dict[str, Any]) -> str:
    return f"{r['k']}/{r['n']} = {100 * r['rate']:.1f}% [{100 * r['ci'][0]:.1f}, {100 * r['ci'][1]:.1f}]"


def markdown(rep: dict[str, Any]) -> str:
    """The report: rates per condition under both readings, kappas, answer identification."""
    L = [f"# Re-labelled under codebook {rep['codebook']}: {rep['model']} on {rep['dataset']}", "",
         f"{rep['n_turns']} committed turns of the labelled set, labelled blind by {len(rep['labellers'])} "
         f"model-written labellers ({', '.join(rep['labellers'])}; language-model sessions that saw only the "
         "blind sheet and the codebook). One turn per item per condition, so intervals are per turn = per item "
         "(Wilson; Clopper-Pearson at 0 or n). Genuine = genuine_followup; 'both' = both labellers agree.", "",
         "| condition | n | reading | " + " | ".join(rep["labellers"]) + " | both | either |",
         "|---|---|---|" + "---|" * len(rep["labellers"]) + "---|---|"]
    for c, cell in rep["by_condition"].items():
        for reading in ("lenient", "strict"):
            r = cell[reading]
            L.append(f"| {c} | {cell['n']} | {reading} | "
                     + " | ".join(_pct(r["per_labeller"][n]) for n in rep["labellers"])
                     + f" | {_pct(r['both'])} | {_pct(r['either'])} |")
    L += ["", "Earlier labels of the same turns (codebook v1, lenient, both labellers) and the judge "
          f"(hybrid-voice:{rep['model']}, judge only; the labelled set keeps its verdicts for the {rep['n_judged']} "
          "test-split turns only, so judge rates and judge kappas are over those):", ""]
    for c, cell in rep["by_condition"].items():
        L.append(f"- {c}: v1 both {_pct(cell['v1_lenient_both'])}; judge only {_pct(cell['judge_only'])}")
    L += ["", "Binary Cohen's kappa (genuine vs not); labeller vs labeller over all turns, judge vs labeller over "
          "the judged turns:", ""]
    for reading in ("lenient", "strict"):
        L.append(f"- {reading}: " + ", ".join(f"{k} {v:.2f}" for k, v in rep["kappa"][reading].items()))
    L.append(f"- v1 labellers (lenient): {rep['kappa']['v1_lenient_labellers']:.2f}")
    ident = rep["identification"]
    L += ["", "## Answer identification (codebook-free)", "",
          "Each labeller saw the turn and two answers to the same query (the real one and the same answer with its "
          "key numbers changed), in random order, and picked the one the turn follows or 'can't tell'. Chance 50%; "
          f"can't tell counts as not identified. {ident['left_out']} answers had no number to change and are "
          "left out.", "", "| labeller | condition | identified | can't tell |", "|---|---|---|---|"]
    for name, by in ident["by_labeller"].items():
        for c, s in by.items():
            L.append(f"| {name} | {c} | {s['correct']}/{s['n']} = {100 * s['share']:.1f}% "
                     f"[{100 * s['lo']:.1f}, {100 * s['hi']:.1f}] | {s['cant_tell']} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sheets")
    s.add_argument("--model", required=True)
    s.add_argument("--dataset", required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("score")
    c.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.cmd == "sheets":
        sheets(a.model, a.dataset, a.out, a.seed)
    else:
        score(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
