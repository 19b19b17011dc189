"""Draw the judge's fresh test items: queries no committed file mentions and no blind-labelled turn holds, whose
item hash puts them in the judge table's test split, in a seeded order; written with the rule into a plan file
before any turn of them exists.

    python scripts/judge_fresh_items.py --out studies/judge/fresh_test_v1.json
    python scripts/judge_fresh_items.py --out studies/judge/fresh_test_v2.json --version 2 --per-dataset 150 \
        --per-dataset-of qwen2.5-coder-1.5b-instruct=60 --samples 1 --seed 2027

Two exclusions, because an item id is not the only name of a query: ``used_item_ids`` (every ``gsm8k-0123`` style
id in a committed file) and the query hash of every blind-labelled turn (``query_item_key``; a labelled set may
carry a query under another id). Version 2 plans give each model its own item list (a model's list is the first
``n`` of the drawn order, so a smaller list is a prefix of a larger one) and the number of samples per item.

Why the test-split filter: the judge table splits items by the query's hash (mechprobe.audit.blind_sets.
split_of_item), label-blind; drawing only items that land in ``test`` makes every labelled turn of this set a
fresh test turn, scored once by the fits made before its labels exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.audit.blind_sets import load_blind_sets, query_item_key, split_of_item  # noqa: E402
from mechprobe.study.interventions.items import draw_items, used_item_ids  # noqa: E402
from mechprobe.turns.datasets import load_dataset  # noqa: E402

USED = ["reports", "mechprobe/data", "docs", "tests", "benchmarks", "scripts", "studies"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--per-dataset", type=int, default=30)
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "ifeval"])
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--version", type=int, default=1, choices=[1, 2])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--per-dataset-of", nargs="*", default=[], metavar="MODEL=N",
                   help="version 2: a model's items per dataset when fewer than --per-dataset (a prefix of the draw)")
    p.add_argument("--samples", type=int, default=3, help="samples at T=1 per item beside the greedy turn")
    a = p.parse_args()
    root = Path(__file__).resolve().parents[1]
    out = (root / a.out).resolve()
    files = [f for x in USED for f in sorted((root / x).rglob("*")) if f.is_file() and f.resolve() != out]
    used = used_item_ids(files)  # every file but this plan's own (a re-run at the same commit draws the same)
    labelled = {t.item for t in load_blind_sets(root).turns.values()} if a.version >= 2 else set()
    items: dict[str, list[str]] = {}
    for ds in a.datasets:
        rows = {it.item_id: it for it in load_dataset(ds).items}
        order = draw_items(ds, len(rows), len(rows), seed=a.seed, exclude=used)
        keys = {i: query_item_key(rows[i].prompt) for i in order}
        items[ds] = [i for i in order if split_of_item(keys[i]) == "test" and keys[i] not in labelled][:a.per_dataset]
    if a.version >= 2:
        return _write(out, _plan_v2(a, items, len(used), len(labelled)), items)
    plan = {
        "format": "mechprobe-judge-fresh-test-v1",
        "written": "before any turn of these items exists",
        "rule": f"per dataset: mechprobe.study.interventions.items.draw_items(dataset, n_rows, n_rows, seed={a.seed}, "
                f"exclude=used_item_ids(every file under {USED} but this one) at the commit that adds this file), keeping in draw order the first {a.per_dataset} items whose "
                "split_of_item(query_item_key(query)) is 'test'",
        "items": items,
        "models": ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"],
        "generation": {"engine": "HF, bfloat16 where the CPU has native bf16", "max_assistant_tokens": 512,
                       "max_user_tokens": 64, "decodings": "greedy + 3 samples at T=1.0 (seeded per record)",
                       "system": "the model's default system prompt"},
        "labels": {"codebook": "mechprobe/audit/labeling_guide.md as committed when the sheet is written "
                               "(copied beside the sheet as codebook_as_labelled.md)",
                   "labellers": "two model-written labellers (language-model sessions), blind to model, decoding "
                                "and judge; both models' turns shuffled in one sheet",
                   "reference": "a turn counts under a reading when both labellers agree; split turns left out"},
        "scored": "every judge in mechprobe judges evaluate's table on these turns, per subject model and reading "
                  "(binary kappa, item bootstrap), as the newest fit's round of fresh test items: the fits "
                  "(textfit, hidden) are made on train/dev items before these labels exist and are not changed "
                  "after they are read",
        "goal": "kappa >= 0.6 on the strict reading for each Qwen model (issue: a judge that holds on the Qwen "
                "models)",
    }
    return _write(out, plan, items)


MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")


def _write(out: Path, plan: dict, items: dict[str, list[str]]) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    print(f"{sum(len(v) for v in items.values())} items -> {out}")
    return 0


def _plan_v2(a: argparse.Namespace, items: dict[str, list[str]], n_used: int, n_labelled: int) -> dict:
    """A version-2 plan: per model its items (a prefix of the draw per dataset) and its decodings."""
    per = {m: a.per_dataset for m in a.models}
    for x in a.per_dataset_of:
        m, _, n = x.partition("=")
        if m not in per or not n.isdigit():
            raise SystemExit(f"--per-dataset-of {x!r}: write MODEL=N with MODEL one of {', '.join(a.models)}")
        per[m] = min(int(n), a.per_dataset)
    return {
        "format": "mechprobe-judge-fresh-test-v2",
        "written": "before any turn of these items exists",
        "rule": f"per dataset: draw_items(dataset, n_rows, n_rows, seed={a.seed}, exclude=used_item_ids(every file "
                f"under {USED} but this one; {n_used} ids)) at the commit that adds this file, keeping in draw order "
                "the items whose split_of_item(query_item_key(query)) is 'test' and whose query_item_key is no "
                f"blind-labelled turn's item ({n_labelled} items in mechprobe.audit.blind_sets.SOURCES); each "
                "model takes the first N of that order",
        "items_per_model": {m: {ds: ids[:per[m]] for ds, ids in items.items()} for m in a.models},
        "models": list(a.models),
        "generation": {"engine": "HF, bfloat16 where the CPU has native bf16", "max_assistant_tokens": 512,
                       "max_user_tokens": 64, "samples": a.samples,
                       "decodings": f"greedy + {a.samples} sample(s) at T=1.0 (seeded per record)",
                       "system": "the model's default system prompt"},
        "labels": {"codebook": "mechprobe/audit/labeling_guide.md as committed when the sheet is written "
                               "(copied beside the sheet as codebook_as_labelled.md)",
                   "labellers": "two model-written labellers (language-model sessions), blind to model, decoding "
                                "and judge; both models' turns shuffled in one sheet, cut into batches of rows",
                   "reference": "a turn counts under a reading when both labellers agree; split turns left out"},
        "scored": "every judge in mechprobe judges evaluate's table on these turns, per subject model and reading "
                  "(binary kappa, item bootstrap), once. Every fit that is scored here (textfit, hidden-v1, and "
                  "any new fit) is committed before this set's labels are read; a fit never reads this set "
                  "(its source is excluded from every fit pool) and is not changed after the labels are read.",
        "goal": "kappa >= 0.6 on the strict reading for each Qwen model (issue: a judge that holds on the Qwen "
                "models)",
    }


if __name__ == "__main__":
    raise SystemExit(main())
