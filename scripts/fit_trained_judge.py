"""Fit, check and test the trained judge on the labelled-turn set (reports/labelled_turns).

Steps, in order; each reads what the previous wrote:

    python scripts/fit_trained_judge.py labels     # labels.md: the set's contents and labeller agreement
    mechprobe judges features                      # every turn's features and offline verdict
                                                   #   (the 0.5B scoring model; cached, resumable)
    python scripts/fit_trained_judge.py judges     # the compared judges' verdicts on the test turns (hybrid-voice:
                                                   #   the 1.5B model; resumable)
    mechprobe judges fit                           # dev split only: item-grouped CV picks C and the threshold,
                                                   #   leave-one-subject-model-out, weights -> mechprobe/data
    python scripts/fit_trained_judge.py test       # the test split, scored once: kappa table for every judge

``features`` and ``fit`` are the package's (:mod:`mechprobe.judges.fit_trained`); this script still answers to
them and runs the same code.

Reference label of a turn: the two blind labellers' label where they agree, else the adjudicator's; a turn with
neither is left out (counted). Why item-grouped folds: turns of one item share the query and answer, so random
folds would score the classifier on near-copies of its training rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mechprobe.audit.agreement import kappa_with_ci  # noqa: E402
from mechprobe.judges.factory import canonical_spec  # noqa: E402
from mechprobe.judges.fit_trained import (  # noqa: E402
    SCORING_MODEL,
    LabelledTurns,
    compute_features,
    fit_trained_judge,
    package_weights_path,
    to_input,
)
from mechprobe.judges.trained import DEFAULT_WEIGHTS, predict_proba, verdict  # noqa: E402
from mechprobe.taxonomy import GENUINE, LABELS  # noqa: E402

DIR = REPO / "reports" / "labelled_turns"
LABEL_DIR = DIR / "labels"
SET = LabelledTurns(DIR)
JUDGES = SET.judges_file
# The best-validated judge, and the 8-way LLM-judge prompt with the codebook (local:) on the 0.5B and 1.5B models.
COMPARE = ("hybrid-voice:qwen2.5-coder-1.5b-instruct", "local:qwen2.5-coder-0.5b-instruct", "local:qwen2.5-coder-1.5b-instruct")


# ------------------------------------------------------------------------------------------------ labels


def cmd_labels(args: argparse.Namespace) -> None:
    """labels.md: what the set holds and how well the labellers agree (no model needed)."""
    turns = SET.load_turns()
    a, b = SET.load_label_file("labeller-a"), SET.load_label_file("labeller-b")
    ref, how = SET.reference()
    both = sorted(a.keys() & b.keys())
    lines = ["# Labelled turns: contents and labeller agreement", "",
             f"{len(turns)} generated user turns; {len(both)} labelled by both blind model-written labellers "
             f"(language-model sessions that saw only the sheet rows and the codebook, "
             f"`mechprobe/audit/labeling_guide.md`); reference label: agreed, else adjudicated ({how}). "
             "Both labellers and the adjudicator are sessions of one kind of language model, so their agreement "
             "is an upper bound on what independent raters would reach, not a measure of it.", "",
             "| subject model | dataset | condition | split | turns | genuine (reference) |", "|---|---|---|---|---|---|"]
    cnt: Counter = Counter()
    gen: Counter = Counter()
    for t, r in turns.items():
        k = (r["model"], r["dataset"], r["condition"], r["split"])
        cnt[k] += 1
        gen[k] += ref.get(t) == GENUINE
    lines += [f"| {m} | {d} | {c} | {s} | {n} | {gen[(m, d, c, s)]} |" for (m, d, c, s), n in sorted(cnt.items())]
    lines += ["", "| subject model | turns | labeller a vs b, binary κ [95% CI] | 8-label κ [95% CI] |",
              "|---|---|---|---|"]
    for m in ["all"] + sorted({r["model"] for r in turns.values()}):
        ids = [t for t in both if m == "all" or turns[t]["model"] == m]
        items = [turns[t]["item_key"] for t in ids]
        la, lb = [a[t]["label"] for t in ids], [b[t]["label"] for t in ids]
        lines.append(f"| {m} | {len(ids)} | {kappa_with_ci(la, lb, items, True).cell()} | "
                     f"{kappa_with_ci(la, lb, items, False).cell()} |")
    dist = Counter((turns[t]["model"], lab) for t, lab in ref.items())
    models = sorted({m for m, _ in dist})
    lines += ["", "Reference labels per subject model:", "", "| label | " + " | ".join(models) + " |",
              "|---|" + "---|" * len(models)]
    lines += [f"| {lab} | " + " | ".join(str(dist[(m, lab)]) for m in models) + " |" for lab in LABELS]
    lines.append("")
    (DIR / "labels.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


# ------------------------------------------------------------------------------------------------ features


def cmd_judges(args: argparse.Namespace) -> None:
    """Verdicts of the judges the trained one is compared with, on one split's turns (resumable)."""
    from tqdm import tqdm

    from mechprobe.judges.factory import make_judge

    turns = SET.load_turns()
    have = set()
    if JUDGES.exists():
        have = {(r["turn_id"], canonical_spec(r["spec"]))
                for r in map(json.loads, JUDGES.read_text(encoding="utf-8").splitlines())}
    for spec in map(canonical_spec, args.judge or COMPARE):
        todo = [r for tid, r in sorted(turns.items()) if r["split"] in args.split and (tid, spec) not in have]
        print(f"{spec}: {len(todo)} turns to judge", file=sys.stderr)
        if not todo:
            continue
        judge = make_judge(spec)
        by_item: dict[str, list[dict]] = {}
        for r in todo:
            by_item.setdefault(r["item_key"] + r["answer"][:64], []).append(r)
        t0, n = time.perf_counter(), 0
        with JUDGES.open("a", encoding="utf-8") as f:
            for group in tqdm(list(by_item.values()), desc=spec):
                for rec in judge.label_many([to_input(r) for r in group]):
                    f.write(json.dumps({"turn_id": rec.record_id, "spec": spec, "label": rec.label,
                                        "judge": rec.judge}) + "\n")
                    n += 1
                f.flush()
        SET.log_speed(spec, n, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------ test


def cmd_test(args: argparse.Namespace) -> None:
    out = DIR / "test.md"
    if out.exists() and not args.again:
        raise SystemExit(f"{out.relative_to(REPO)} exists: the test split is scored once (pass --again only to "
                         "re-render the same fit)")
    w = json.loads(package_weights_path().read_text(encoding="utf-8"))
    rows, groups, how = SET.rows_with_ref("test")
    judged = SET.judge_labels()
    # Every judge is scored on the same turns: one that has not judged all of them is left out, and said so.
    covered = {spec: sum(r["turn_id"] in judged.get(spec, {}) for r in rows) for spec in COMPARE}
    compare = [spec for spec in COMPARE if covered[spec] == len(rows)]
    for r, p in zip(rows, predict_proba(w, [r["features"] for r in rows])):
        r["trained"] = verdict(float(p), w["threshold"], r["offline"], r["features"])
        for spec in compare:
            r[spec] = judged[spec][r["turn_id"]]
    a, b = SET.load_label_file("labeller-a"), SET.load_label_file("labeller-b")
    lines = ["# Trained judge vs the other judges: test split, scored once", "",
             f"Test split of `reports/labelled_turns`: {len(rows)} turns on {len(set(groups))} items; reference "
             f"{how}. Fit: `mechprobe/data/{DEFAULT_WEIGHTS}` (C {w['C']:g}, threshold {w['threshold']:.2f}, fit on "
             f"{w['fit']['dev_turns']} dev turns). κ with 95% item-bootstrap CIs; the labellers' κ with each other "
             "is the ceiling. Cells: κ [CI] (rows where judge and reference agree / rows)."]
    if len(compare) < len(COMPARE):
        lines += ["", "Left out (not run on every test turn): "
                  + ", ".join(f"{s} ({covered[s]} of {len(rows)} judged)" for s in COMPARE if s not in compare) + "."]
    for binary in (True, False):
        lines += _test_table(rows, a, b, w, binary, compare)
    fig = _test_figure(rows, a, b, compare)
    lines += ["", f"Figure: `{fig.relative_to(REPO)}`."]
    speed = DIR / "speed.jsonl"
    if speed.exists():
        lines += ["", "**Speed** (`speed.jsonl`; each judge alone on the CPU named):", "",
                  "| judge | turns | seconds | turns/s | CPU, threads |", "|---|---|---|---|---|"]
        for r in map(json.loads, speed.read_text(encoding="utf-8").splitlines()):
            lines.append(f"| {r['judge']} | {r['turns']} | {r['seconds']:.0f} | {r['turns_per_s']:.2f} | "
                         f"{r['cpu']}, {r['threads']} |")
    lines.append("")
    out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


def _test_table(rows: list[dict], a: dict, b: dict, w: dict, binary: bool, compare: list[str]) -> list[str]:
    lines = ["", "**Binary κ (genuine follow-up vs not).**" if binary else
             "**8-label κ.** The trained judge's failure label is the rules' (`trained.verdict`).", "",
             f"| subject model | condition | turns | genuine (ref) | labeller a vs b | trained ({w['scoring_model']}) | "
             + " | ".join(compare) + " | offline |", "|---|---|---|---|---|---|" + "---|" * (len(compare) + 1)]
    keyf = [("all", lambda r: True)]
    for m in sorted({r["turn"]["model"] for r in rows}):
        keyf.append((m, lambda r, m=m: r["turn"]["model"] == m))
    for name, sel in keyf:
        for cond in ("all", "greedy", "sampled", "steered"):
            sub = [r for r in rows if sel(r) and _cond(r["turn"]["condition"], cond)]
            if not sub or (cond != "all" and len(sub) < 20):
                continue
            items = [r["turn"]["item_key"] for r in sub]
            ref = [r["ref"] for r in sub]
            both = [r for r in sub if r["turn_id"] in a and r["turn_id"] in b]
            lab = kappa_with_ci([a[r["turn_id"]]["label"] for r in both], [b[r["turn_id"]]["label"] for r in both],
                                [r["turn"]["item_key"] for r in both], binary=binary).cell()
            cells = [kappa_with_ci([r[j] for r in sub], ref, items, binary=binary).cell()
                     for j in ("trained", *compare, "offline")]
            lines.append(f"| {name} | {cond} | {len(sub)} | {sum(x == GENUINE for x in ref)} | {lab} | "
                         + " | ".join(cells) + " |")
    return lines


def _test_figure(rows: list[dict], a: dict, b: dict, compare: list[str]) -> Path:
    """Binary κ with its CI per subject model for every judge, the labellers' κ as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = ["all"] + sorted({r["turn"]["model"] for r in rows})
    judges = ["labeller a vs b", "trained", *compare, "offline"]
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(judges)
    for j, name in enumerate(judges):
        for i, m in enumerate(models):
            sub = [r for r in rows if m == "all" or r["turn"]["model"] == m]
            if name == "labeller a vs b":
                sub = [r for r in sub if r["turn_id"] in a and r["turn_id"] in b]
                k = kappa_with_ci([a[r["turn_id"]]["label"] for r in sub], [b[r["turn_id"]]["label"] for r in sub],
                                  [r["turn"]["item_key"] for r in sub], binary=True)
            else:
                k = kappa_with_ci([r[name] for r in sub], [r["ref"] for r in sub],
                                  [r["turn"]["item_key"] for r in sub], binary=True)
            if not math.isfinite(k.kappa):
                continue
            x = i + (j - (len(judges) - 1) / 2) * width
            err = None
            if math.isfinite(k.lo):
                err = [[k.kappa - k.lo], [k.hi - k.kappa]]
            shown = {"trained": f"trained:{SCORING_MODEL}", "labeller a vs b": "labeller a vs b (ceiling)"}.get(name, name)
            ax.bar(x, k.kappa, width, yerr=err, capsize=2, color=f"C{j}", label=shown if i == 0 else None)
    n = {m: sum(m == "all" or r["turn"]["model"] == m for r in rows) for m in models}
    g = {m: sum(r["ref"] == GENUINE for r in rows if m == "all" or r["turn"]["model"] == m) for m in models}
    ax.set_xticks(range(len(models)), [f"{m}\nn={n[m]}, {g[m]} genuine" for m in models], fontsize=8)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_ylabel("binary κ vs reference labels (95% CI)")
    ax.set_title(f"Judges vs blind model-written labels, labelled-turn test split (n={len(rows)}, scored once)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.tight_layout()
    out = REPO / "figures" / "judge_test_kappa.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _cond(c: str, want: str) -> bool:
    if want == "all":
        return True
    if want == "steered":
        return c.startswith("steer:") and c != "steer:none"
    if want == "greedy":
        return c in ("greedy", "steer:none")
    return c.startswith("T") or c == "sample"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("labels")
    sub.add_parser("features")
    j = sub.add_parser("judges")
    j.add_argument("--judge", action="append", help=f"judge spec (repeatable; default {' '.join(COMPARE)})")
    j.add_argument("--split", nargs="+", default=["test"], choices=["dev", "test"])
    sub.add_parser("fit")
    t = sub.add_parser("test")
    t.add_argument("--again", action="store_true")
    args = ap.parse_args()
    {"labels": cmd_labels, "features": lambda _: compute_features(SET),
     "fit": lambda _: print(fit_trained_judge(SET).report), "test": cmd_test, "judges": cmd_judges}[args.cmd](args)


if __name__ == "__main__":
    main()
