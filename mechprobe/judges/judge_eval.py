"""Fit, select and score judges on every committed blind-labelled set: the per-model judge table.

Why: the linear probes predict judged follow-up, so where the judge disagrees with the labellers a null probe
says nothing. This driver (``mechprobe judges evaluate``) puts every committed blind label in one place
(:mod:`mechprobe.audit.blind_sets`), splits by item (train / dev / test, the same rule for every model), fits the
text-fit judge's heads on train and chooses on dev only (``--fit``), writes every judge's verdict per turn to
``reports/judge/verdicts.jsonl``, and writes the table (:mod:`mechprobe.audit.judge_table`) as markdown and JSON.

Selection (``--fit``), per head (one head per reading): every candidate is a feature set (the rules' verdict and
lexical cues; the same plus MiniLM similarities), a training target (the lenient or the strict consensus: the
strict head may learn from the more plentiful lenient labels), an L2 strength C and a decision threshold; the
logistic model is fit on the train items (class-balanced), turns of an ``answer_removed`` arm are hard negatives
(written without the answer, so they fit any answer and are not genuine), and the candidate with the highest mean
dev kappa over the subject models whose dev turns hold a positive wins. The test split is scored, never chosen on.

Verdicts of judges that need a language model (the hybrid and trained judges) are not recomputed: the committed
ones are read (the labelled set's ``judges.jsonl``, the study's ``verdicts_*.jsonl``; the trained judge's from
the labelled set's committed feature rows and the package's weights).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import cohen_kappa_score

from mechprobe.audit.blind_sets import BlindSets, JudgeVerdict, consensus, load_blind_sets, split_of_item
from mechprobe.audit.judge_table import (
    FIRST_HIDDEN_VERSION,
    ROUNDS_FILE,
    VERDICTS_FILE,
    groups_of_rounds,
    hidden_judge_name,
    judge_table,
    read_all_verdicts,
)
from mechprobe.audit.readings import READINGS
from mechprobe.errors import UsageError
from mechprobe.io import write_json
from mechprobe.judges.base import JudgeInput, load_judge_model
from mechprobe.judges.hidden import load_weights as hidden_load_weights
from mechprobe.judges.hidden import weights_path as hidden_weights_path
from mechprobe.judges.hidden import with_feature_kind
from mechprobe.judges.hidden_cv import fit_hidden_heads_cv
from mechprobe.judges.hidden_fit import cached_hidden_features, fit_hidden_heads
from mechprobe.judges.hidden_verdicts import archived_hidden_weights, write_hidden_verdicts
from mechprobe.judges.offline import Embedder, OfflineJudge
from mechprobe.judges.speed import time_turns
from mechprobe.judges.textfit import (
    DEFAULT_WEIGHTS,
    HEADS,
    TEXTFIT_FEATURES,
    WEIGHTS_FORMAT,
    feature_rows,
    head_proba,
    load_weights,
    weights_digest,
)
from mechprobe.judges.trained import load_weights as trained_weights
from mechprobe.judges.trained import predict_proba as trained_proba
from mechprobe.judges.turn_features import TEXT_FEATURES
from mechprobe.lm.forward import get_blocks
from mechprobe.taxonomy import GENUINE

__all__ = ["JudgeEvalConfig", "JudgeEvalResult", "run_judge_eval", "fit_heads", "judge_inputs", "cached_features",
           "HARD_NEGATIVE_ARMS", "TEXTFIT", "OFFLINE", "fit_rounds", "archive_weights",
           "archived_weights", "judge_table_markdown"]

TEXTFIT, OFFLINE = "textfit", "offline"
HARD_NEGATIVE_ARMS = frozenset({"answer_removed"})
FEATURE_SETS: dict[str, tuple[str, ...]] = {"rules+lexical": TEXT_FEATURES, "rules+lexical+minilm": TEXTFIT_FEATURES}
C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0)
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(2, 19))
VERSION = "textfit-v2"
HIDDEN_PROTOCOLS = ("split", "pool")


@dataclass(frozen=True)
class JudgeEvalConfig:
    """What ``mechprobe judges evaluate`` does.

    Attributes:
        root: the repository (its ``reports/`` holds the labelled sets).
        out: the report folder, relative to ``root``.
        fit: refit the text-fit heads (selection on dev) and write ``weights``; else use the existing weights.
        weights: the text-fit weights file; None = the package's (``mechprobe/data/textfit_judge.json``).
        cache: where feature rows are cached (a scratch folder, relative to ``root``).
        splits: the splits the table shows (the test split is the result; dev is what selection saw).
        n_boot: bootstrap draws per kappa interval.
        speed_turns: when > 0, time each of ``speed_judges`` on this many test turns (the same turns, one judge
            after another, after one warm-up turn each) and append the rows to ``speed.jsonl``.
        speed_judges: the judge specs timed.
        speed_source: time turns of this labelled set (a ``SOURCES`` name) instead of the test split's turns; a
            name that holds no labelled turn is refused before any work.
        speed_whole_answers: time every turn of each answer together (as a run holds them: a reader judge reads the
            shared conversation once per answer) instead of one turn per answer, the worst case
            (:func:`~mechprobe.judges.speed.speed_sample`).
        hidden: a reader model: score the hidden-state judge fit with it (:mod:`mechprobe.judges.hidden`), its
            verdicts committed in their own file (``verdicts_hidden_<reader>.jsonl``) that later runs read.
        fit_hidden: (re)fit that judge's heads (train items fit, dev items choose) and write its weights.
        hidden_layers: the residual indices a fit tries; empty = every fourth layer from the middle to the last.
        hidden_protocol: how a hidden fit chooses: ``split`` (train items fit, dev items choose; ``hidden-v1``) or
            ``pool`` (item-grouped cross-validation over every labelled item outside the held-out test sets;
            ``hidden-v2`` on, :mod:`mechprobe.judges.hidden_cv`).
        hidden_features: the rows a hidden fit reads (:data:`~mechprobe.judges.hidden.FEATURE_KINDS`).
    """

    root: str = "."
    out: str = "reports/judge"
    fit: bool = False
    weights: str | None = None
    cache: str = "runs/judge_eval"
    splits: tuple[str, ...] = ("dev", "test")
    n_boot: int = 500
    speed_turns: int = 0
    speed_judges: tuple[str, ...] = (TEXTFIT, "hybrid-voice:qwen2.5-coder-1.5b-instruct")
    speed_source: str = ""
    speed_whole_answers: bool = False
    hidden: str | None = None
    fit_hidden: bool = False
    hidden_layers: tuple[int, ...] = ()
    hidden_protocol: str = "split"
    hidden_features: str = "turn"


@dataclass
class JudgeEvalResult:
    """What was written, the table rows, the inventory and the selection (when fit)."""

    rows: list[dict[str, Any]]
    inventory: list[dict[str, Any]]
    selection: list[dict[str, Any]] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    markdown: str = ""


def judge_inputs(blind: BlindSets) -> dict[str, JudgeInput]:
    """What a judge sees of each blind turn (what the labellers saw: query, answer, the turn as written)."""
    return {tid: JudgeInput(record_id=tid, prompt=t.query, response=t.answer, raw_text=t.turn, dataset=t.dataset,
                            item_id=t.item, subject=t.model) for tid, t in blind.turns.items()}


def cached_features(inputs: dict[str, JudgeInput], cache: Path, embed: bool = True,
                    progress: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """Feature rows (:data:`~mechprobe.judges.textfit.TEXTFIT_FEATURES` + ``offline_label``) per turn id, computed
    once and kept in ``cache/features-<variant>.jsonl`` (keyed by turn id, which is a content hash)."""
    path = cache / f"features-{'minilm' if embed else 'lexical'}.jsonl"
    have: dict[str, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                have[r["turn_id"]] = r["features"]
    todo = [tid for tid in inputs if tid not in have]
    if todo:
        if progress:
            progress(f"features of {len(todo)} turns (rules + MiniLM)")
        offline, embedder = OfflineJudge(embed=embed), Embedder() if embed else None
        offline._embedder = embedder  # one encoder and one memo (as in TextFitJudge)
        rows, verdicts = feature_rows([inputs[t] for t in todo], offline, embedder)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            for tid, row, v in zip(todo, rows, verdicts):
                row = row | {"offline_genuine": float(v.label == GENUINE)}
                have[tid] = row
                fh.write(json.dumps({"turn_id": tid, "features": row}) + "\n")
    return {t: have[t] for t in inputs}


def _kappa(y: Sequence[bool], p: Sequence[bool]) -> float:
    if len(set(y)) < 2 and len(set(p)) < 2:
        return math.nan
    return float(cohen_kappa_score(list(y), list(p)))


def _targets(blind: BlindSets) -> dict[str, dict[str, bool | None]]:
    out: dict[str, dict[str, bool | None]] = {r: {} for r in READINGS}
    for tid, t in blind.turns.items():
        labs = blind.labels_of(tid)
        for r in READINGS:
            out[r][tid] = False if t.arm in HARD_NEGATIVE_ARMS and labs else consensus(labs, r)
    return out


def fit_heads(blind: BlindSets, feats: dict[str, dict[str, float]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fit every candidate on the train items, choose each head's on dev (see the module docstring).

    Returns:
        the weights dict (:data:`~mechprobe.judges.textfit.WEIGHTS_FORMAT`) and one row per candidate (its dev
        kappa per model and the mean that chose it).
    Raises:
        UsageError: no train turn of both classes, or no dev turn with a positive (nothing to choose on).
    """
    names = list(TEXTFIT_FEATURES)
    tids = sorted(blind.turns)
    split = {t: split_of_item(blind.turns[t].item) for t in tids}
    X = np.array([[feats[t][n] for n in names] for t in tids], dtype=float)
    train = [i for i, t in enumerate(tids) if split[t] == "train"]
    mean, scale = X[train].mean(0), X[train].std(0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    Z = (X - mean) / scale
    targets = _targets(blind)
    truth = {r: {t: consensus(blind.labels_of(t), r) for t in tids} for r in READINGS}
    models = sorted({t.model for t in blind.turns.values()})
    dev = {(r, m): [i for i, t in enumerate(tids) if split[t] == "dev" and blind.turns[t].model == m
                    and truth[r][t] is not None] for r in READINGS for m in models}
    selection: list[dict[str, Any]] = []
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for fs_name, fs in FEATURE_SETS.items():
        cols = [names.index(n) for n in fs]
        for target in READINGS:
            tr = [i for i in train if targets[target][tids[i]] is not None]
            y = [bool(targets[target][tids[i]]) for i in tr]
            if len(set(y)) < 2:
                continue
            for C in C_GRID:
                clf = LogisticRegression(C=C, class_weight="balanced", max_iter=5000).fit(Z[np.ix_(tr, cols)], y)
                prob = clf.predict_proba(Z[:, cols])[:, 1]
                for head in HEADS:
                    for thr in THRESHOLDS:
                        per = {}
                        for m in models:
                            idx = dev[(head, m)]
                            yy = [bool(truth[head][tids[i]]) for i in idx]
                            if any(yy):
                                per[m] = _kappa(yy, [bool(prob[i] >= thr) for i in idx])
                        ks = [k for k in per.values() if math.isfinite(k)]
                        if not ks:
                            continue
                        score = float(np.mean(ks))
                        coef = np.zeros(len(names))
                        coef[cols] = clf.coef_[0]
                        row = {"head": head, "features": fs_name, "target": target, "C": C, "threshold": thr,
                               "dev_mean_kappa": score, "dev_kappa": per,
                               "coef": [float(c) for c in coef], "intercept": float(clf.intercept_[0])}
                        selection.append({k: v for k, v in row.items() if k not in ("coef", "intercept")})
                        # ties keep the earlier (fewer features, stronger regularisation, lower threshold)
                        if head not in best or score > best[head][0] + 1e-12:
                            best[head] = (score, row)
    missing = [h for h in HEADS if h not in best]
    if missing:
        raise UsageError(f"no dev turn with a genuine consensus under {', '.join(missing)}: nothing to choose a "
                         "head on; add labelled turns (a source in mechprobe.audit.blind_sets.SOURCES)")
    heads = {h: {"coef": best[h][1]["coef"], "intercept": best[h][1]["intercept"], "threshold": best[h][1]["threshold"],
                 "chosen": {k: best[h][1][k] for k in ("features", "target", "C", "dev_mean_kappa", "dev_kappa")}}
             for h in HEADS}
    w: dict[str, Any] = {"format": WEIGHTS_FORMAT, "version": VERSION, "features": names,
                         "mean": [float(x) for x in mean], "scale": [float(x) for x in scale], "heads": heads,
                         "embed": True,
                         "fit": {"train_turns": len(train), "rule": "judge_eval with fit=True: train items fit, "
                                 "dev items choose (mean dev kappa over models), test items never seen",
                                 "hard_negative_arms": sorted(HARD_NEGATIVE_ARMS)}}
    w["weights_sha256"] = weights_digest(w)
    return w, selection


def _trained_verdicts(root: Path) -> list[JudgeVerdict]:
    """The trained judge's verdicts from the labelled set's committed feature rows and the package's weights."""
    path = root / "reports/labelled_turns/features.jsonl"
    if not path.is_file():
        return []
    w = trained_weights()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    probs = trained_proba(w, [r["features"] for r in rows])
    spec = f"trained:{w['scoring_model']}"
    return [JudgeVerdict(r["turn_id"], spec, None, p >= float(w["threshold"]), str(path)) for r, p in zip(rows, probs)]


def judge_table_markdown(res: JudgeEvalResult, speed: list[dict[str, Any]], chosen: dict[str, Any]) -> str:
    """The report: inventory, the per-model table (test, then dev), the chosen heads and the speed rows."""
    lines = ["# Judges against blind labels, per subject model", "",
             "Written by `mechprobe judges evaluate` from committed labels and verdicts (`reports/judge/verdicts.jsonl`, "
             "the labelled sets' own judge files). Labels are model-written: two language-model labellers per turn, "
             "blind to model, condition and judge. Reference: the labellers' consensus (both say genuine, or both "
             "say not, under the reading); turns they split on are left out. `strict` exists only where the labels "
             "carry codebook v2's strict field. Items are split train / dev / test by the query's hash; the "
             "text-fit heads were fit on train and chosen on dev. Each fit's fresh test items (no earlier fit's "
             "test held them; `reports/judge/test_rounds.json`) are its once-scored test; earlier fits' weights are "
             "kept (`reports/judge/weights/`) and scored under their version's name.", "",
             "## Inventory", "",
             "| subject model | source | turns | labels | lenient consensus (genuine) | labellers split | "
             "strict consensus (genuine) | labellers split |", "|---|---|---|---|---|---|---|---|"]
    for r in res.inventory:
        lines.append(f"| {r['model']} | {r['source']} | {r['turns']} | {r['labels']} | {r['lenient_consensus']} "
                     f"({r['lenient_genuine']}) | {r['lenient_split']} | {r['strict_consensus']} "
                     f"({r['strict_genuine']}) | {r['strict_split']} |")
    groups = sorted({r["split"] for r in res.rows if r["split"].startswith("test_")}, reverse=True)
    titles = {g: f"test items first scored by {g[5:]} (no earlier fit's test held them: scored once)" for g in groups}
    titles.update({"test": "test items, all datasets (each fit scores them all; a later fit re-reads earlier ones)",
                   "dev": "dev items, all datasets"})
    for sp in (*groups, "test", "dev"):
        rows = [r for r in res.rows if r["split"] == sp and r["dataset"] == "all"]
        if not rows:
            continue
        lines += ["", f"## {titles[sp]}", "",
                  "| judge | subject model | reading | n (items) | κ [95% CI, item bootstrap] | "
                  "TP / FP / FN / TN | judge genuine | labellers genuine |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["model"], r["reading"], r["judge"])):
            lines.append(f"| {r['judge']} | {r['model']} | {r['reading']} | {r['n']} ({r['items']}) | "
                         f"{_kappa_text(r)} | {r['tp']} / {r['fp']} / {r['fn']} / {r['tn']} | "
                         f"{_rate(r['judge_genuine'], r['n'])} | {_rate(r['labellers_genuine'], r['n'])} |")
    per_ds = [r for r in res.rows if r["split"] == "test" and r["dataset"] != "all"]
    if per_ds:
        lines += ["", "## test items, per dataset", "",
                  "| judge | subject model | dataset | reading | n (items) | κ [95% CI] | judge / labellers genuine |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(per_ds, key=lambda r: (r["model"], r["dataset"], r["reading"], r["judge"])):
            lines.append(f"| {r['judge']} | {r['model']} | {r['dataset']} | {r['reading']} | {r['n']} ({r['items']}) "
                         f"| {_kappa_text(r)} | {r['judge_genuine']} / {r['labellers_genuine']} |")
    if chosen:
        lines += ["", "## Text-fit heads (chosen on dev)", "", "| head | features | target | C | threshold | "
                  "mean dev κ | dev κ per model |", "|---|---|---|---|---|---|---|"]
        for h, c in chosen.items():
            per = ", ".join(f"{m} {k:.2f}" for m, k in c["chosen"]["dev_kappa"].items())
            lines.append(f"| {h} | {c['chosen']['features']} | {c['chosen']['target']} | {c['chosen']['C']} | "
                         f"{c['threshold']} | {c['chosen']['dev_mean_kappa']:.2f} | {per} |")
    if speed:
        lines += ["", "## Speed (`reports/judge/speed.jsonl`)", "", "| judge | turns | seconds | turns/s | CPU | note |",
                  "|---|---|---|---|---|---|"]
        for s in speed:
            lines.append(f"| {s['judge']} | {s['turns']} | {s['seconds']:.1f} | {s['turns_per_s']:.2f} | {s['cpu']} | "
                         f"{s.get('note', '')} |")
    if res.notes:
        lines += ["", "Notes: " + "; ".join(res.notes)]
    return "\n".join(lines) + "\n"


def _kappa_text(r: dict[str, Any]) -> str:
    if r["kappa"] is None:
        return f"n/a ({r['agree']}/{r['n']} agree)"
    ci = f" [{r['lo']:.2f}, {r['hi']:.2f}]" if r["lo"] is not None and r["hi"] is not None else ""
    return f"{r['kappa']:.2f}{ci} ({r['agree']}/{r['n']} agree)"


def _rate(k: int, n: int) -> str:
    return f"{k}/{n} = {100 * k / n:.1f}%" if n else "n/a"


def run_judge_eval(cfg: JudgeEvalConfig, progress: Callable[[str], None] | None = None) -> JudgeEvalResult:
    """Load the blind sets, (re)fit when asked, write verdicts, split, table and report; return the result."""
    root = Path(cfg.root)
    out = root / cfg.out
    blind = load_blind_sets(root)
    if not blind.turns:
        raise UsageError(f"no blind-labelled turns under {root}/reports; run from the repository root or pass "
                         "root=REPO")
    inputs = judge_inputs(blind)
    if cfg.speed_turns > 0 and cfg.speed_source and cfg.speed_source not in {t.source for t in blind.turns.values()}:
        raise UsageError(f"speed_source={cfg.speed_source!r} holds no labelled turn; name a source of "
                         "mechprobe.audit.blind_sets.SOURCES whose folder exists")
    feats = cached_features(inputs, root / cfg.cache, embed=True, progress=progress)
    selection: list[dict[str, Any]] = []
    weights_path = Path(cfg.weights) if cfg.weights else root / "mechprobe" / "data" / DEFAULT_WEIGHTS
    if cfg.fit:
        archive_weights(out, load_weights(weights_path if cfg.weights else None))
        w, selection = fit_heads(blind, feats)
        write_json(weights_path, w)
        write_json(out / "selection.json", {"candidates": selection})
    w = load_weights(weights_path if (cfg.fit or cfg.weights) else None)
    rounds = fit_rounds(root / ROUNDS_FILE, w, blind, record=cfg.fit)
    for hf in sorted((root / "mechprobe" / "data").glob("hidden_judge_*.json")) if not cfg.fit_hidden else []:
        # a committed hidden-state fit that is the newest round takes in new test items without its reader loaded
        # (not while a new fit is made: the new fit's round is the one that takes them)
        hw0 = hidden_load_weights(hf)
        rounds = fit_rounds(root / ROUNDS_FILE, {**hw0, "version": f"hidden:{hw0['reader']}@{hw0['version']}"}, blind,
                            record=False)
    tids = sorted(inputs)
    verdicts: list[JudgeVerdict] = []
    for head in w["heads"]:
        probs = head_proba(w, head, [feats[t] for t in tids])
        thr = float(w["heads"][head]["threshold"])
        verdicts += [JudgeVerdict(t, TEXTFIT, head, p >= thr, "") for t, p in zip(tids, probs)]
    for old_w in archived_weights(out, w):  # earlier fits, scored under their version's name (textfit-v1, ...)
        for head in old_w["heads"]:
            probs = head_proba(old_w, head, [feats[t] for t in tids])
            thr = float(old_w["heads"][head]["threshold"])
            verdicts += [JudgeVerdict(t, str(old_w["version"]), head, p >= thr, "") for t, p in zip(tids, probs)]
    verdicts += [JudgeVerdict(t, OFFLINE, None, bool(feats[t]["offline_genuine"]), "") for t in tids]
    verdicts += _trained_verdicts(root)  # committed here too: the findings recompute the table from files alone
    vfile = root / VERDICTS_FILE
    vfile.parent.mkdir(parents=True, exist_ok=True)
    vfile.write_text("".join(json.dumps({"turn_id": v.turn_id, "judge": v.judge, "reading": v.reading,
                                         "genuine": v.genuine}) + "\n" for v in verdicts), encoding="utf-8")
    written_hidden = []
    if cfg.hidden:
        hfile, hsel, rounds = _hidden_judge(cfg, root, blind, inputs, rounds)
        written_hidden.append(hfile)
        selection += hsel
    rows = judge_table(blind, read_all_verdicts(root) + blind.verdicts, splits=cfg.splits, n_boot=cfg.n_boot,
                       groups=groups_of_rounds(rounds))
    split_file = {"format": "mechprobe-judge-split-v1",
                  "rule": "mechprobe.audit.blind_sets.split_of_item (query hash; the labelled set's test rule)",
                  "items": {t.item: split_of_item(t.item) for t in sorted(blind.turns.values(), key=lambda t: t.item)}}
    write_json(out / "split.json", split_file)
    speed_path = out / "speed.jsonl"
    if cfg.speed_turns > 0:
        pool = [inputs[t] for t in tids if (blind.turns[t].source == cfg.speed_source if cfg.speed_source
                                            else split_of_item(blind.turns[t].item) == "test")]
        rows_s = time_turns(cfg.speed_judges, pool, cfg.speed_turns, cfg.speed_whole_answers,
                            f"turns of {cfg.speed_source}" if cfg.speed_source else "test turns")
        with speed_path.open("a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows_s)
    speed = [json.loads(x) for x in speed_path.read_text(encoding="utf-8").splitlines() if x.strip()] \
        if speed_path.is_file() else []
    res = JudgeEvalResult(rows=rows, inventory=blind.counts(), selection=selection,
                          notes=[n for n in blind.notes if "not found" in n])
    res.markdown = judge_table_markdown(res, speed, w["heads"])
    write_json(out / "table.json", {"rows": rows, "inventory": res.inventory, "weights_sha256": w["weights_sha256"]})
    (out / "table.md").write_text(res.markdown, encoding="utf-8")
    res.written = [vfile, *written_hidden, out / "split.json", out / "table.json", out / "table.md"]
    return res


def _hidden_judge(cfg: JudgeEvalConfig, root: Path, blind: BlindSets, inputs: dict[str, JudgeInput],
                  rounds: list[dict[str, Any]]) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """Fit (``fit_hidden``) or load the hidden-state judge read by ``cfg.hidden``, write its verdicts to its own
    committed file (one per weights version; the reader's archived fits get verdicts on the turns they lack,
    :mod:`mechprobe.judges.hidden_verdicts`), and record its fit's round of fresh test items."""
    if cfg.hidden_protocol not in HIDDEN_PROTOCOLS:
        raise UsageError(f"hidden protocol {cfg.hidden_protocol!r}: use one of {', '.join(HIDDEN_PROTOCOLS)}")
    lm = load_judge_model(str(cfg.hidden))
    wpath = hidden_weights_path(lm.name, root / "mechprobe" / "data")
    selection: list[dict[str, Any]] = []
    if cfg.fit_hidden:
        n = len(get_blocks(lm.model))
        layers = list(cfg.hidden_layers) or list(range(n // 2, n + 1, 4))
        feats = cached_hidden_features(lm, inputs, layers, root / cfg.cache, kind=cfg.hidden_features)
        if wpath.is_file():
            old = hidden_load_weights(wpath)
            write_json(root / cfg.out / WEIGHTS_ARCHIVE / f"hidden_{lm.name}_{old['version']}.json", old)
        if cfg.hidden_protocol == "pool":
            hw, selection = fit_hidden_heads_cv(blind, feats, lm.name)
        else:
            hw, selection = fit_hidden_heads(blind, feats, lm.name)
        write_json(wpath, with_feature_kind(hw, cfg.hidden_features))
        tail = "" if hw["version"] == FIRST_HIDDEN_VERSION else f"@{hw['version']}"
        write_json(root / cfg.out / f"selection_hidden_{lm.name}{tail}.json", {"candidates": selection})
    hw = hidden_load_weights(wpath)
    spec = hidden_judge_name(lm.name, hw["version"])
    archived = archived_hidden_weights(root / cfg.out / WEIGHTS_ARCHIVE, lm.name, hw)
    hfile = write_hidden_verdicts(lm, hw, archived, blind, inputs, root, root / cfg.cache, refit=cfg.fit_hidden)[0]
    rounds = fit_rounds(root / ROUNDS_FILE, {**hw, "version": f"hidden:{lm.name}@{hw['version']}"}, blind,
                        record=cfg.fit_hidden)
    return hfile, [{**r, "judge": spec} for r in selection], rounds


WEIGHTS_ARCHIVE = "weights"  # reports/judge/weights/<version>.json: every earlier fit's weights, kept


def archive_weights(out: Path, w: dict[str, Any]) -> None:
    """Keep the weights a refit replaces (``out/weights/<version>.json``), so their table rows stay computable."""
    dest = out / WEIGHTS_ARCHIVE / f"{w['version']}.json"
    if not dest.is_file():
        write_json(dest, w)


def archived_weights(out: Path, current: dict[str, Any]) -> list[dict[str, Any]]:
    """Every archived text-fit fit but the current one, oldest version first (the hidden-state judge's archived
    fits share the folder as ``hidden_<reader>_<version>.json``: :mod:`mechprobe.judges.hidden_verdicts`)."""
    files = sorted(f for f in (out / WEIGHTS_ARCHIVE).glob("*.json") if not f.name.startswith("hidden_")) \
        if (out / WEIGHTS_ARCHIVE).is_dir() else []
    ws = [load_weights(f) for f in files]
    return [x for x in ws if x["weights_sha256"] != current["weights_sha256"]]


def fit_rounds(path: Path, w: dict[str, Any], blind: BlindSets, record: bool) -> list[dict[str, Any]]:
    """Every fit's round: its weights and the test items it was the first to score (no earlier fit's test held them).

    Why: a refit judge scores every test item again, and the older ones were scored by the earlier weights; only
    the items no fit has seen before are a test scored once by the new weights. ``record`` (a fit) appends the
    round of ``w`` to ``path`` (``reports/judge/test_rounds.json``) unless it is there; the newest fit's round
    also takes in test items of labelled sets added after it (it never saw them). The table reports each round's
    items as a group (:func:`~mechprobe.audit.judge_table.round_group`), so each fit keeps its once-scored cells.
    """
    rounds = json.loads(path.read_text(encoding="utf-8"))["rounds"] if path.is_file() else []
    test = {t.item for t in blind.turns.values() if split_of_item(t.item) == "test"}
    new = record and not any(r["weights_sha256"] == w["weights_sha256"] for r in rounds)
    if new:
        rounds.append({"weights": w.get("version"), "weights_sha256": w["weights_sha256"], "fresh_items": []})
    last = rounds[-1] if rounds else None
    if last is not None and last["weights_sha256"] == w["weights_sha256"]:
        # the newest fit has seen no test item outside earlier rounds, including labelled sets added since it was
        # fit: its round grows with them (never shrinks); an earlier fit's round is frozen when a new fit is made
        seen = {i for r in rounds[:-1] for i in r["fresh_items"]}
        grown = sorted(set(last["fresh_items"]) | (test - seen))
        if new or grown != last["fresh_items"]:
            last.update(fresh_items=grown, test_items=len(test))
            write_json(path, {"format": "mechprobe-judge-test-rounds-v1",
                              "rule": "per fit: the test items no earlier fit's test held (scored once by that fit)",
                              "rounds": rounds})
    return rounds
