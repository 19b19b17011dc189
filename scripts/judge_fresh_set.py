"""The judge's fresh test set (``studies/judge/fresh_test_v1.json``): generate its turns, then write one blind
sheet over both subject models for two labellers.

    python scripts/judge_fresh_set.py generate --plan studies/judge/fresh_test_v1.json [--model M]
    python scripts/judge_fresh_set.py sheet --plan studies/judge/fresh_test_v1.json --out reports/judge_sets/fresh_test_v1
    python scripts/judge_fresh_set.py batches --out reports/judge_sets/fresh_test_v2 --dest DIR/a --size 125
    # one session per folder DIR/a/NN writes DIR/a/NN/labels-NN.csv (row,label,strict,borderline,note); the same
    # for labeller b in DIR/b; then
    python scripts/judge_fresh_set.py merge --out reports/judge_sets/fresh_test_v2 --labeller labeller-a DIR/a/*/labels-*.csv
    python scripts/judge_fresh_set.py verdicts --out reports/judge_sets/fresh_test_v1 --judge hybrid-voice:MODEL
    mechprobe judges evaluate      # the source judge_fresh_test_v1 in mechprobe.audit.blind_sets.SOURCES

``generate`` writes resumable probe runs under ``runs/judge_fresh/<plan name>/<model>-<dataset>`` (the package's
``run_probe``: a killed run continues where it stopped). ``sheet`` reads them and writes ``sheet.csv`` (row, query,
answer, user_turn; rows shuffled, opaque keys: no model, dataset or decoding shown), ``key.json`` (row -> turn id,
model, dataset, item, decoding) and the codebook as labelled. The labellers see only the sheet and the codebook.
``verdicts`` runs a judge whose verdicts ``judges evaluate`` reads from a committed file (one that runs a language
model: hybrid, trained) over the sheet's turns and writes ``verdicts_<spec>.jsonl`` beside it (one line per sheet
row, written as judged: an interrupted run continues where it stopped, without duplicates).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.audit.blind_sets import _turn_id  # noqa: E402  (the blind sets' content key: one turn, one id)
from mechprobe.audit.codebook import CODEBOOK_VERSION, codebook_path  # noqa: E402
from mechprobe.io import read_jsonl  # noqa: E402
from mechprobe.judges.base import JudgeInput  # noqa: E402
from mechprobe.judges.factory import make_judge  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402
from mechprobe.turns.config import ProbeConfig  # noqa: E402
from mechprobe.turns.datasets import load_dataset  # noqa: E402
from mechprobe.turns.pipeline import run_probe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _runs(plan_path: Path) -> Path:
    return ROOT / "runs" / "judge_fresh" / plan_path.stem


def plan_items(plan: dict, model: str) -> dict[str, list[str]]:
    """The model's items per dataset: a version-2 plan lists them per model, a version-1 plan once for all."""
    if "items_per_model" in plan:
        if model not in plan["items_per_model"]:
            raise SystemExit(f"the plan has no items for {model}; models: {', '.join(plan['items_per_model'])}")
        return plan["items_per_model"][model]
    return plan["items"]


def _config(plan: dict, model: str, dataset: str, dtype: str) -> ProbeConfig:
    g = plan["generation"]
    return ProbeConfig(model=model, dataset=dataset, limit=None, temperatures=[0.0, 1.0], samples=int(g.get("samples", 3)),
                       max_assistant_tokens=int(g["max_assistant_tokens"]), max_user_tokens=int(g["max_user_tokens"]),
                       dtype=dtype)


def _part(items: dict[str, list[str]], datasets: list[str]) -> dict[str, list[str]]:
    """The plan's items of ``datasets`` only (all when empty): a set labelled in parts, each part its own sheet."""
    unknown = sorted(set(datasets) - set(items))
    if unknown:
        raise SystemExit(f"--datasets {' '.join(unknown)}: not in the plan; its datasets: {', '.join(items)}")
    return {ds: ids for ds, ids in items.items() if not datasets or ds in datasets}


def generate(plan_path: Path, models: list[str], dtype: str, datasets: list[str] | None = None) -> None:
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    for model in models or plan["models"]:
        lm = load_model(model, dtype=dtype)
        for ds, ids in _part(plan_items(plan, model), datasets or []).items():
            rows = {it.item_id: it for it in load_dataset(ds).items}
            out = _runs(plan_path) / f"{model}-{ds}"
            run_probe(_config(plan, model, ds, dtype), out, lm=lm, items=[rows[i] for i in ids])
            print(f"{model} {ds}: {out}")


def _one_row_per_turn(rows: list[dict]) -> list[dict]:
    """One sheet row per distinct turn (the blind sets' id is the turn's content: a sample that wrote the greedy
    turn's text again is the same turn); the key keeps every record that wrote it (``records``, ``decodings``)."""
    by: dict[str, dict] = {}
    for r in rows:
        first = by.setdefault(r["turn_id"], {**r, "records": [], "decodings": []})
        first["records"].append(r["record_id"])
        first["decodings"].append(r["decoding"])
    return list(by.values())


def sheet(plan_path: Path, out: Path, seed: int = 0, datasets: list[str] | None = None) -> None:
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    rows = []
    for model in plan["models"]:
        for ds, ids in _part(plan_items(plan, model), datasets or []).items():
            run = _runs(plan_path) / f"{model}-{ds}"
            answers = {r["item_id"]: r for r in read_jsonl(run / "assistant.jsonl")}
            turns = list(read_jsonl(run / "user_turns.jsonl"))
            missing = sorted(set(ids) - {t["item_id"] for t in turns})
            if missing:
                raise SystemExit(f"{run}: no user turns for {len(missing)} planned items (e.g. {missing[0]}); run "
                                 f"generate first (it resumes)")
            for t in turns:
                a = answers[t["item_id"]]
                tid = _turn_id(model, a["prompt"], a["response"], t["raw_text"])
                rows.append({"turn_id": tid, "model": model, "dataset": ds, "item_id": t["item_id"],
                             "decoding": t["decoding"], "record_id": t["record_id"], "query": a["prompt"],
                             "answer": a["response"], "turn": t["raw_text"]})
    rows = _one_row_per_turn(rows)
    rows.sort(key=lambda r: r["turn_id"])
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    key = {"format": "mechprobe-judge-fresh-sheet-v1", "plan": plan_path.name,
           "plan_sha256": hashlib.sha256(plan_path.read_bytes()).hexdigest(), "codebook": CODEBOOK_VERSION,
           "seed": seed, "datasets": sorted(datasets) if datasets else "all", "rows": {}}
    with open(out / "sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["row", "query", "answer", "user_turn"])
        for r in rows:
            k = "r" + hashlib.sha256(f"fresh|{r['turn_id']}".encode()).hexdigest()[:10]
            key["rows"][k] = {x: r[x] for x in ("turn_id", "model", "dataset", "item_id", "decoding", "record_id",
                                                "records", "decodings")}
            w.writerow([k, r["query"], r["answer"], r["turn"]])
    (out / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    shutil.copyfile(codebook_path(), out / "codebook_as_labelled.md")
    print(f"{len(rows)} rows -> {out / 'sheet.csv'}")


LABEL_COLUMNS = ["row", "label", "strict", "borderline", "note"]


def batches(out: Path, dest: Path, size: int) -> list[Path]:
    """Cut the blind sheet into batches of ``size`` rows, one folder per labelling session: ``dest/NN/`` holds
    ``batch-NN.csv`` (the sheet's columns only), ``codebook.md`` (the codebook as labelled) and ``instructions.md``
    (the set's ``labeller_instructions.md``, where it has one). Why one folder each: a session is given its folder
    and nothing else (no key, no verdicts, no other session's labels), and it writes its labels and any helper
    script there, so sessions that run side by side never share a file."""
    with open(out / "sheet.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    paths = []
    for b in range(0, len(rows), size):
        n = f"{b // size + 1:02d}"
        d = dest / n
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "codebook_as_labelled.md", d / "codebook.md")
        if (out / "labeller_instructions.md").is_file():
            shutil.copyfile(out / "labeller_instructions.md", d / "instructions.md")
        p = d / f"batch-{n}.csv"
        with open(p, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["row", "query", "answer", "user_turn"], lineterminator="\n")
            w.writeheader()
            w.writerows(rows[b:b + size])
        paths.append(p)
    print(f"{len(rows)} rows in {len(paths)} batch folders -> {dest}")
    return paths


def merge(out: Path, labeller: str, files: list[Path]) -> Path:
    """One labeller's batch files as ``out/labels/<labeller>.csv``: every sheet row exactly once, each label and
    strict value checked as the blind sets read them (one line naming the file, row and fix otherwise)."""
    from mechprobe.audit.blind_sets import _label  # the loader's own check of a label
    from mechprobe.audit.readings import parse_strict

    with open(out / "sheet.csv", newline="", encoding="utf-8") as f:
        order = [r["row"] for r in csv.DictReader(f)]
    got: dict[str, dict[str, str]] = {}
    for fp in files:
        with open(fp, newline="", encoding="utf-8") as f:
            for i, r in enumerate(csv.DictReader(f), 2):
                where = f"{fp}:{i}"
                if r.get("row") not in order:
                    raise SystemExit(f"{where}: row {r.get('row')!r} is not a sheet row; fix the batch file")
                if r["row"] in got:
                    raise SystemExit(f"{where}: row {r['row']} labelled twice; keep one")
                lab = _label(r.get("label"), where)
                parse_strict(r.get("strict"), lab, where)
                got[r["row"]] = {k: (r.get(k) or "").strip() for k in LABEL_COLUMNS} | {"label": lab}
    missing = [r for r in order if r not in got]
    if missing:
        raise SystemExit(f"{labeller}: {len(missing)} sheet rows have no label (e.g. {missing[0]}); label them first")
    dest = out / "labels" / f"{labeller}.csv"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=LABEL_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(got[r] for r in order)
    print(f"{len(order)} labels -> {dest}")
    return dest


def verdicts_file(out: Path, spec: str) -> Path:
    """Where ``spec``'s verdicts on a fresh sheet live (the name the blind sets' loader reads back)."""
    return out / f"verdicts_{spec.replace(':', '_', 1)}.jsonl"


def verdicts(out: Path, spec: str) -> Path:
    """``spec``'s verdict on every sheet row, appended as each is known; rows already in the file are skipped."""
    with open(out / "sheet.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    path = verdicts_file(out, spec)
    done = {r["record_id"] for r in read_jsonl(path)} if path.is_file() else set()
    todo = [JudgeInput(r["row"], r["query"], r["answer"], r["user_turn"]) for r in rows if r["row"] not in done]
    judge = make_judge(spec)
    from tqdm.auto import tqdm

    with path.open("a", encoding="utf-8") as fh, tqdm(total=len(todo), desc=f"judge {spec}", unit="turn") as bar:
        for rec in judge.label_many(todo):
            fh.write(json.dumps({"record_id": rec.record_id, "genuine": bool(rec.genuine), "label": rec.label,
                                 "judge": rec.judge}) + "\n")
            fh.flush()
            bar.update(1)
    print(f"{len(done) + len(todo)} verdicts -> {path}")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--plan", required=True, type=Path)
    g.add_argument("--model", nargs="*", default=[])
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--datasets", nargs="*", default=[], help="only these datasets of the plan (a set labelled in parts)")
    s = sub.add_parser("sheet")
    s.add_argument("--plan", required=True, type=Path)
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--datasets", nargs="*", default=[], help="one part of the plan: a sheet of these datasets only")
    v = sub.add_parser("verdicts")
    v.add_argument("--out", required=True, type=Path)
    v.add_argument("--judge", required=True, help="a judge spec, e.g. hybrid-voice:qwen2.5-coder-1.5b-instruct")
    b = sub.add_parser("batches")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--dest", required=True, type=Path)
    b.add_argument("--size", type=int, default=125)
    m = sub.add_parser("merge")
    m.add_argument("--out", required=True, type=Path)
    m.add_argument("--labeller", required=True)
    m.add_argument("files", nargs="+", type=Path)
    a = p.parse_args()
    if a.cmd == "batches":
        batches(a.out.resolve(), a.dest.resolve(), a.size)
        return 0
    if a.cmd == "merge":
        merge(a.out.resolve(), a.labeller, a.files)
        return 0
    if a.cmd == "verdicts":
        verdicts(a.out.resolve(), a.judge)
        return 0
    plan = a.plan.resolve()
    if a.cmd == "generate":
        generate(plan, a.model, a.dtype, a.datasets)
    else:
        sheet(plan, a.out.resolve(), datasets=a.datasets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
