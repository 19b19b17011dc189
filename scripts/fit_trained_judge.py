"""Fit, check and test the trained judge on the labelled-turn set (reports/labelled_turns).

Steps, in order; each reads what the previous wrote:

    python scripts/fit_trained_judge.py labels     # labels.md: the set's contents and labeller agreement
    python scripts/fit_trained_judge.py features   # every turn's features and offline verdict
                                                   #   (the 0.5B scoring model; cached, resumable)
    python scripts/fit_trained_judge.py judges     # the compared judges' verdicts on the test turns (hybrid-voice:
                                                   #   the 1.5B model; resumable)
    python scripts/fit_trained_judge.py fit        # dev split only: item-grouped CV picks C and the threshold,
                                                   #   leave-one-subject-model-out, weights -> mechprobe/data
    python scripts/fit_trained_judge.py test       # the test split, scored once: kappa table for every judge

Reference label of a turn: the two blind labellers' label where they agree, else the adjudicator's; a turn with
neither is left out (counted). Why item-grouped folds: turns of one item share the query and answer, so random
folds would score the classifier on near-copies of its training rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mechprobe.audit.agreement import kappa_with_ci  # noqa: E402
from mechprobe.judges.base import JudgeInput  # noqa: E402
from mechprobe.judges.factory import canonical_spec  # noqa: E402
from mechprobe.judges.trained import DEFAULT_WEIGHTS, WEIGHTS_FORMAT, predict_proba, verdict, weights_digest  # noqa: E402
from mechprobe.judges.turn_features import FEATURE_NAMES, vector  # noqa: E402
from mechprobe.taxonomy import GENUINE, LABELS  # noqa: E402

DIR = REPO / "reports" / "labelled_turns"
LABEL_DIR = DIR / "labels"
FEATURES = DIR / "features.jsonl"
WEIGHTS = REPO / "mechprobe" / "data" / DEFAULT_WEIGHTS
SCORING_MODEL = "qwen2.5-coder-0.5b-instruct"  # 3x cheaper forwards than the 1.5B hybrid-voice judge
JUDGES = DIR / "judges.jsonl"
# The best-validated judge, and the 8-way LLM-judge prompt with the codebook (local:) on the 0.5B and 1.5B models.
COMPARE = ("hybrid-voice:qwen2.5-coder-1.5b-instruct", "local:qwen2.5-coder-0.5b-instruct", "local:qwen2.5-coder-1.5b-instruct")
VERSION = "trained-v2"
C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
N_FOLDS = 5


def load_turns() -> dict[str, dict]:
    return {r["turn_id"]: r for r in map(json.loads, (DIR / "turns.jsonl").read_text(encoding="utf-8").splitlines())}


def load_label_file(name: str) -> dict[str, dict]:
    p = LABEL_DIR / f"{name}.json"
    if not p.exists():
        return {}
    return {r["row"]: r for r in json.loads(p.read_text(encoding="utf-8"))["rows"]}


def reference() -> tuple[dict[str, str], dict[str, int]]:
    """turn_id -> reference label (agreed, else adjudicated), and counts of how each was reached."""
    a, b, adj = load_label_file("labeller-a"), load_label_file("labeller-b"), load_label_file("adjudicated")
    ref, how = {}, Counter()
    for tid in a.keys() & b.keys():
        if a[tid]["label"] == b[tid]["label"]:
            ref[tid] = a[tid]["label"]
            how["agreed"] += 1
        elif tid in adj:
            ref[tid] = adj[tid]["label"]
            how["adjudicated"] += 1
        else:
            how["disagreed, not adjudicated"] += 1
    return ref, dict(how)


def to_input(r: dict) -> JudgeInput:
    return JudgeInput(record_id=r["turn_id"], prompt=r["query"], response=r["answer"], raw_text=r["turn"],
                      dataset=r["dataset"], item_id=r["item_key"])


# ------------------------------------------------------------------------------------------------ labels


def cmd_labels(args: argparse.Namespace) -> None:
    """labels.md: what the set holds and how well the labellers agree (no model needed)."""
    turns = load_turns()
    a, b = load_label_file("labeller-a"), load_label_file("labeller-b")
    ref, how = reference()
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


def cmd_features(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from mechprobe.judges.hybrid import HybridJudge
    from mechprobe.judges.trained import feature_rows

    turns = load_turns()
    have = {}
    if FEATURES.exists():
        have = {r["turn_id"]: r for r in map(json.loads, FEATURES.read_text(encoding="utf-8").splitlines())}
    todo = [r for tid, r in sorted(turns.items()) if tid not in have]
    print(f"{len(have)} turns have features, {len(todo)} to do", file=sys.stderr)
    if not todo:
        return
    hybrid = HybridJudge(SCORING_MODEL)  # its store, cache and offline rules compute the features
    by_item: dict[str, list[dict]] = {}
    for r in todo:
        by_item.setdefault(r["item_key"] + r["answer"][:64], []).append(r)
    t0, n = time.perf_counter(), 0
    with FEATURES.open("a", encoding="utf-8") as f:
        for group in tqdm(list(by_item.values()), desc="features (conversations)"):
            n += len(group)
            inputs = [to_input(r) for r in group]
            rows, offline = feature_rows(hybrid, inputs)
            for inp in inputs:
                rec = {"turn_id": inp.record_id, "features": rows[inp.record_id], "scoring_model": SCORING_MODEL,
                       "offline": offline[inp.record_id].label, "offline_name": hybrid.offline.name}
                f.write(json.dumps(rec) + "\n")
            f.flush()
    _log_speed(f"trained:{SCORING_MODEL} (features)", n, time.perf_counter() - t0)


def _log_speed(what: str, turns: int, seconds: float) -> None:
    """Append one timing row to speed.jsonl: turns/s of a judge on these turns, with the CPU that ran it."""
    if not turns:
        return
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    row = {"judge": what, "turns": turns, "seconds": round(seconds, 1), "turns_per_s": round(turns / seconds, 4),
           "cpu": cpu, "threads": torch_threads()}
    with (DIR / "speed.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def cmd_judges(args: argparse.Namespace) -> None:
    """Verdicts of the judges the trained one is compared with, on one split's turns (resumable)."""
    from tqdm import tqdm

    from mechprobe.judges.factory import make_judge

    turns = load_turns()
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
        _log_speed(spec, n, time.perf_counter() - t0)


def _judge_labels() -> dict[str, dict[str, str]]:
    """spec -> {turn_id: label} from judges.jsonl (specs recorded as ``hybrid2:`` read as ``hybrid-voice:``)."""
    out: dict[str, dict[str, str]] = {}
    if JUDGES.exists():
        for r in map(json.loads, JUDGES.read_text(encoding="utf-8").splitlines()):
            out.setdefault(canonical_spec(r["spec"]), {})[r["turn_id"]] = r["label"]
    return out


# ------------------------------------------------------------------------------------------------ fit


def _matrix(rows: list[dict]) -> np.ndarray:
    return np.array([vector(r["features"], FEATURE_NAMES) for r in rows], dtype=float)


def _fit(x: np.ndarray, y: np.ndarray, c: float):
    from sklearn.linear_model import LogisticRegression

    mean = x.mean(0)
    scale = x.std(0)
    scale[scale < 1e-9] = 1.0
    m = LogisticRegression(C=c, max_iter=5000, class_weight="balanced")
    m.fit((x - mean) / scale, y)
    return {"mean": mean.tolist(), "scale": scale.tolist(), "coef": m.coef_[0].tolist(),
            "intercept": float(m.intercept_[0]), "features": list(FEATURE_NAMES)}


def _proba(w: dict, rows: list[dict]) -> np.ndarray:
    return np.array(predict_proba(w, [r["features"] for r in rows]))


def _kappa_bin(y: np.ndarray, pred: np.ndarray) -> float:
    from sklearn.metrics import cohen_kappa_score

    if len(set(y.tolist()) | set(pred.tolist())) < 2:
        return float("nan")
    return float(cohen_kappa_score(y, pred))


def _oof(rows: list[dict], y: np.ndarray, groups: list[str], c: float) -> np.ndarray:
    from sklearn.model_selection import GroupKFold

    p = np.zeros(len(rows))
    x = _matrix(rows)
    for tr, te in GroupKFold(n_splits=N_FOLDS).split(x, y, groups):
        w = _fit(x[tr], y[tr], c)
        p[te] = _proba(w, [rows[i] for i in te])
    return p


def _best_threshold(y: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    best = (0.5, -1.0)
    for t in np.round(np.arange(0.2, 0.91, 0.05), 2):
        k = _kappa_bin(y, (p >= t).astype(int))
        if math.isfinite(k) and k > best[1]:
            best = (float(t), k)
    return best


def _rows_with_ref(split: str) -> tuple[list[dict], list[str], dict]:
    turns = load_turns()
    ref, how = reference()
    feats = {r["turn_id"]: r for r in map(json.loads, FEATURES.read_text(encoding="utf-8").splitlines())}
    rows = [feats[t] | {"turn": turns[t], "ref": ref[t]} for t in sorted(ref) if t in feats
            and turns[t]["split"] == split]
    return rows, [r["turn"]["item_key"] for r in rows], how


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cmd_fit(args: argparse.Namespace) -> None:
    rows, groups, how = _rows_with_ref("dev")
    y = np.array([int(r["ref"] == GENUINE) for r in rows])
    print(f"dev: {len(rows)} turns, {y.sum()} genuine, {len(set(groups))} items; reference {how}", file=sys.stderr)
    cv = {}
    for c in C_GRID:
        p = _oof(rows, y, groups, c)
        t, k = _best_threshold(y, p)
        cv[c] = {"threshold": t, "kappa": k, "oof": p}
        print(f"  C={c:g}: best threshold {t:.2f}, out-of-fold binary kappa {k:.3f}", file=sys.stderr)
    c_best = max(cv, key=lambda c: cv[c]["kappa"])
    thr = cv[c_best]["threshold"]
    w = _fit(_matrix(rows), y, c_best)
    # leave one subject model out (dev turns only): transfer to a model the fit never saw
    lomo = {}
    models = sorted({r["turn"]["model"] for r in rows})
    for m in models:
        tr = [r for r in rows if r["turn"]["model"] != m]
        te = [r for r in rows if r["turn"]["model"] == m]
        ytr = np.array([int(r["ref"] == GENUINE) for r in tr])
        if len(set(ytr.tolist())) < 2:
            continue
        wm = _fit(_matrix(tr), ytr, c_best)
        pred = (_proba(wm, te) >= thr).astype(int)
        k = kappa_with_ci([GENUINE if v else "x" for v in pred], [r["ref"] for r in te],
                          [r["turn"]["item_key"] for r in te], binary=True)
        lomo[m] = {"n": len(te), "genuine": int(sum(r["ref"] == GENUINE for r in te)), "kappa": k.to_dict()}
    # the other judges on the same dev turns, for the table beside the CV number
    others = {"offline": kappa_with_ci([r["offline"] for r in rows], [r["ref"] for r in rows], groups,
                                       binary=True).to_dict()}
    for spec, labs in _judge_labels().items():
        sub = [r for r in rows if r["turn_id"] in labs]
        if sub:
            others[spec] = kappa_with_ci([labs[r["turn_id"]] for r in sub], [r["ref"] for r in sub],
                                         [r["turn"]["item_key"] for r in sub], binary=True).to_dict()
    oof_pred = (cv[c_best]["oof"] >= thr).astype(int)
    oof_k = kappa_with_ci([GENUINE if v else "x" for v in oof_pred], [r["ref"] for r in rows], groups, binary=True)
    fit = {"format": WEIGHTS_FORMAT, "version": VERSION, "scoring_model": SCORING_MODEL, "threshold": thr,
           "C": c_best, **w,
           "fit": {"script": "scripts/fit_trained_judge.py fit", "dev_turns": len(rows), "dev_items": len(set(groups)),
                   "dev_genuine": int(y.sum()), "reference": how,
                   "turns_sha256": _sha(DIR / "turns.jsonl"), "features_sha256": _sha(FEATURES),
                   "labels_sha256": {p.name: _sha(p) for p in sorted(LABEL_DIR.glob("*.json"))},
                   "cv": {f"{c:g}": {"threshold": v["threshold"], "kappa": round(v["kappa"], 4)}
                          for c, v in cv.items()},
                   "oof_kappa": oof_k.to_dict(), "lomo": lomo, "dev_kappa_other_judges": others}}
    fit = {k: v for k, v in fit.items() if k != "fit"} | {"weights_sha256": weights_digest(fit), "fit": fit["fit"]}
    WEIGHTS.write_text(json.dumps(fit, indent=1) + "\n", encoding="utf-8")
    lines = ["# Trained judge: fit on the dev split", "",
             f"Dev split of `reports/labelled_turns`: {len(rows)} turns ({int(y.sum())} genuine by the reference) "
             f"on {len(set(groups))} items. Reference: two blind model-written labellers' agreed label, else the "
             f"adjudicator's ({how}). Features: {len(FEATURE_NAMES)} (rules' verdict, lexical cues, grounding "
             f"PMI and voice margin of `{SCORING_MODEL}`). Logistic regression, balanced classes; C and the "
             f"threshold chosen by {N_FOLDS}-fold item-grouped CV: **C = {c_best:g}, threshold {thr:.2f}**.", "",
             "| judge (dev turns) | binary κ vs reference [95% CI, item bootstrap] |", "|---|---|",
             f"| trained, out-of-fold (CV) | {oof_k.cell()} |",
             *(f"| {n} | {_cell(k)} |" for n, k in others.items()), "",
             "Leave one subject model out (fit on the other models' dev turns, same C and threshold):", "",
             "| held-out subject model | turns | genuine | binary κ [95% CI] |", "|---|---|---|---|",
             *(f"| {m} | {v['n']} | {v['genuine']} | {_cell(v['kappa'])} |" for m, v in lomo.items()), "",
             "Coefficients (standardised features):", "", "| feature | coef |", "|---|---|",
             *(f"| {n} | {c:+.3f} |" for n, c in sorted(zip(FEATURE_NAMES, w["coef"]), key=lambda t: -abs(t[1]))),
             ""]
    (DIR / "fit.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


def _cell(k: dict) -> str:
    if not k["n"]:
        return "—"
    if not math.isfinite(k["kappa"]):
        return f"n/a ({k['agree']}/{k['n']} agree)"
    ci = f" [{k['lo']:.2f}, {k['hi']:.2f}]" if math.isfinite(k["lo"]) else ""
    return f"{k['kappa']:.2f}{ci} ({k['agree']}/{k['n']} agree)"


# ------------------------------------------------------------------------------------------------ test


def cmd_test(args: argparse.Namespace) -> None:
    out = DIR / "test.md"
    if out.exists() and not args.again:
        raise SystemExit(f"{out.relative_to(REPO)} exists: the test split is scored once (pass --again only to "
                         "re-render the same fit)")
    w = json.loads(WEIGHTS.read_text(encoding="utf-8"))
    rows, groups, how = _rows_with_ref("test")
    judged = _judge_labels()
    # Every judge is scored on the same turns: one that has not judged all of them is left out, and said so.
    covered = {spec: sum(r["turn_id"] in judged.get(spec, {}) for r in rows) for spec in COMPARE}
    compare = [spec for spec in COMPARE if covered[spec] == len(rows)]
    for r, p in zip(rows, _proba(w, rows)):
        r["trained"] = verdict(float(p), w["threshold"], r["offline"], r["features"])
        for spec in compare:
            r[spec] = judged[spec][r["turn_id"]]
    a, b = load_label_file("labeller-a"), load_label_file("labeller-b")
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
    {"labels": cmd_labels, "features": cmd_features, "judges": cmd_judges, "fit": cmd_fit, "test": cmd_test}[args.cmd](args)


if __name__ == "__main__":
    main()
