"""Build the judge's labelled-turn set: texts of generated user turns from several subject models, split by item.

Why: a judge trained or tuned on turns needs the turns' texts kept next to the labels (an audit keeps only
record ids; the run directories that held the texts are not committed), and a dev/test split fixed *before*
anyone labels or fits, by item, so the same problem never sits on both sides. The split key is the query
text, so one GSM8K problem asked of two models lands on one side.

Sources: the labelled fixtures in ``tests/fixtures`` (texts already there) and any probe or steering run
directories given with ``--run DIR MODEL`` (``user_turns.jsonl`` + ``assistant.jsonl``). Items of the committed
steering split's held-out list are refused: those items are for final steering numbers only.

Writes ``reports/labelled_turns/turns.jsonl`` (one row per turn, merged with what is there; a turn already in
the file keeps its row) and ``sheet.csv`` (blind: row key, query, answer, turn; shuffled; no model, condition or
source) for the labellers.

Usage::

    python scripts/build_labelled_set.py                                   # fixtures only
    python scripts/build_labelled_set.py --run runs/q15-mt_bench qwen2.5-coder-1.5b-instruct
    python scripts/build_labelled_set.py --no-sheet --labels labeller-a a.csv --labels labeller-b b.csv
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, whatever is pip-installed

from mechprobe.splits import STEERING_SPLIT, load_split, split_of  # noqa: E402

OUT = REPO / "reports" / "labelled_turns"
TEST_FRACTION = 0.4
FIXTURES = [  # (file, subject model, condition field)
    ("hand_labels.jsonl", "smollm2-135m-instruct", "decoding"),
    ("hand_labels_q15_c.jsonl", "qwen2.5-coder-1.5b-instruct", "decoding"),
    ("hand_labels_steer_q15.jsonl", "qwen2.5-coder-1.5b-instruct", "condition"),
    ("hand_labels_steer2_q15.jsonl", "qwen2.5-coder-1.5b-instruct", "condition"),
]


def turn_id(model: str, query: str, answer: str, turn: str) -> str:
    """Content key: the same (model, conversation, turn) from two sources is one row."""
    h = hashlib.sha256(json.dumps([model, query, answer, turn], ensure_ascii=False).encode()).hexdigest()
    return "t" + h[:12]


def item_key(query: str) -> str:
    return hashlib.sha256(" ".join(query.split()).encode()).hexdigest()[:16]


def split_for(query: str) -> str:
    return "test" if split_of("labelled-turns|" + item_key(query), TEST_FRACTION) == "heldout" else "dev"


def _row(model: str, dataset: str, item_id: str, condition: str, source: str, query: str, answer: str,
         turn: str, capped: bool | None) -> dict:
    return {"turn_id": turn_id(model, query, answer, turn), "model": model, "dataset": dataset, "item_id": item_id,
            "item_key": item_key(query), "split": split_for(query), "condition": condition, "source": source,
            "answer_capped": capped, "query": query, "answer": answer, "turn": turn}


def from_fixture(name: str, model: str, cond_field: str) -> list[dict]:
    rows = []
    for line in (REPO / "tests" / "fixtures" / name).read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        ds = r.get("dataset") or "gsm8k"
        cond = str(r.get(cond_field) or "")
        if cond_field == "condition":
            cond = "steer:" + cond
        rows.append(_row(model, ds, r["item_id"], cond, f"fixture:{name}", r["prompt"], r["response"],
                         r["raw_text"], None))
    return rows


def from_run(run: Path, model: str) -> list[dict]:
    answers = {}
    for line in (run / "assistant.jsonl").read_text(encoding="utf-8").splitlines():
        a = json.loads(line)
        answers[a["item_id"]] = a
    rows = []
    for line in (run / "user_turns.jsonl").read_text(encoding="utf-8").splitlines():
        t = json.loads(line)
        a = answers[t["item_id"]]
        cond = "greedy" if t.get("decoding") == "greedy" else f"T{t.get('temperature', 1):g}"
        rows.append(_row(model, a.get("dataset") or t.get("dataset") or "", t["item_id"], cond, f"run:{run.name}",
                         a["prompt"], a["response"], t["raw_text"], a.get("stop_reason") == "max_tokens"))
    return rows


def import_audit_labels(run: Path, model: str, turns: dict[str, dict]) -> None:
    """Copy an audit's labels into ``labels/labeller-{a,b}.json`` under the labelled set's turn ids (the audit's
    sheet showed the same texts under its own row keys). Rows already in a labeller file are kept."""
    from mechprobe.audit.labels import load_labellers
    from mechprobe.audit.sample import load_sample
    from mechprobe.audit.table import load_run_table

    sample = load_sample(run)
    keys = sample.keys()
    table = load_run_table(run)
    labellers = load_labellers(run, sample)[:2]
    if len(labellers) < 2:
        raise SystemExit(f"{run}: the audit has {len(labellers)} labeller(s); import two with mechprobe audit --labels")
    for lab, letter in zip(labellers, "ab"):
        path = OUT / "labels" / f"labeller-{letter}.json"
        doc = json.loads(path.read_text(encoding="utf-8"))
        rows = {r["row"]: r for r in doc["rows"]}
        for key, rl in lab.by_row().items():
            t = table.get(keys[key])
            tid = turn_id(model, t.query, t.answer, t.turn)
            if tid not in turns:
                raise SystemExit(f"{run}: audited turn {keys[key]} is not in turns.jsonl; pass the run with --audit")
            rows.setdefault(tid, {"row": tid, "label": rl.label, "borderline": rl.borderline, "note": rl.note})
        doc["rows"] = sorted(rows.values(), key=lambda r: r["row"])
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{path.name}: {len(lab.by_row())} rows from the audit of {run.name} ({lab.name}, {lab.kind})")


def add_labels(name: str, csv_path: Path, turns: dict[str, dict]) -> None:
    """Merge a labeller's CSV (``row,label,borderline,note``, rows keyed by turn id as on the sheet) into
    ``labels/NAME.json``. Rows already there are kept (a label is written once); unknown labels or rows stop
    the merge before anything is written."""
    from mechprobe.taxonomy import LABELS

    path = OUT / "labels" / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"{path.relative_to(REPO)} does not exist: NAME is labeller-a, labeller-b or adjudicated")
    doc = json.loads(path.read_text(encoding="utf-8"))
    rows = {r["row"]: r for r in doc["rows"]}
    with csv_path.open(newline="", encoding="utf-8") as f:
        new = list(csv.DictReader(f))
    bad = [r["row"] for r in new if r["row"] not in turns or r["label"] not in LABELS]
    if bad:
        raise SystemExit(f"{csv_path}: {len(bad)} rows with an unknown turn id or label (first: {bad[0]}); "
                         f"labels are {', '.join(LABELS)}")
    added = 0
    for r in new:
        if r["row"] not in rows:
            rows[r["row"]] = {"row": r["row"], "label": r["label"],
                              "borderline": str(r.get("borderline", "")).strip().lower() in ("1", "true", "yes", "y"),
                              "note": r.get("note", "")}
            added += 1
    doc["rows"] = sorted(rows.values(), key=lambda r: r["row"])
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{path.name}: {added} rows added from {csv_path.name} ({len(rows)} in all)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs=2, action="append", default=[], metavar=("DIR", "MODEL"),
                    help="a probe run directory and its subject model (repeatable)")
    ap.add_argument("--audit", nargs=2, action="append", default=[], metavar=("DIR", "MODEL"),
                    help="a run audited with `mechprobe audit --labels`: its turns, and its labellers' labels as "
                         "labeller-a/labeller-b rows (repeatable; the audit's first two labellers, in file order)")
    ap.add_argument("--labels", nargs=2, action="append", default=[], metavar=("NAME", "CSV"),
                    help="merge a labeller's CSV (row,label,borderline,note) into labels/NAME.json (repeatable)")
    ap.add_argument("--no-fixtures", action="store_true")
    ap.add_argument("--sheet-only-new", action="store_true", help="sheet.csv holds only turns added now")
    ap.add_argument("--no-sheet", action="store_true", help="leave sheet.csv as it is (labels come from an audit)")
    args = ap.parse_args()
    heldout = set(load_split(STEERING_SPLIT).heldout)
    new: list[dict] = []
    if not args.no_fixtures:
        for name, model, field in FIXTURES:
            new += from_fixture(name, model, field)
    for d, model in args.run + args.audit:
        new += from_run(Path(d), model)
    bad = [r for r in new if r["dataset"] == "gsm8k" and r["item_id"] in heldout and r["source"].startswith("run:")]
    if bad:
        raise SystemExit(f"{len(bad)} turns are on held-out steering items ({bad[0]['item_id']} ...): those items are "
                         f"for final steering numbers only; probe other items")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "turns.jsonl"
    have = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            have[r["turn_id"]] = r
    added = [r for r in new if r["turn_id"] not in have]
    seen = set()
    added = [r for r in added if not (r["turn_id"] in seen or seen.add(r["turn_id"]))]
    for r in added:
        have[r["turn_id"]] = r
    with path.open("w", encoding="utf-8") as f:
        for r in sorted(have.values(), key=lambda r: r["turn_id"]):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    for d, model in args.audit:
        import_audit_labels(Path(d), model, have)
    for name, csv_path in args.labels:
        add_labels(name, Path(csv_path), have)
    sheet_rows = added if args.sheet_only_new else list(have.values())
    sheet_rows = [] if args.no_sheet else sorted(sheet_rows, key=lambda r: r["turn_id"])
    random.Random(20261125).shuffle(sheet_rows)
    if not args.no_sheet:
        with (OUT / "sheet.csv").open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["row", "query", "answer", "user_turn", "label", "borderline", "note"])
            for r in sheet_rows:
                w.writerow([r["turn_id"], r["query"], r["answer"], r["turn"], "", "", ""])
    n_test = sum(r["split"] == "test" for r in have.values())
    print(f"{len(added)} turns added, {len(have)} in {path.relative_to(REPO)} ({n_test} test, "
          f"{len(have) - n_test} dev); sheet.csv: {len(sheet_rows)} rows")


if __name__ == "__main__":
    main()
