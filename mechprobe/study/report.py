"""The study's report: the README markdown, a pure function of the run directories.

Nothing here generates or judges; :func:`write_report` collects the runs (:mod:`mechprobe.study.data`), decides
the claims (:mod:`mechprobe.study.claims`), draws the figures (:mod:`mechprobe.study.figures`) and writes
``README.md``. Same runs in, same README out (bootstrap seeds are fixed, every iteration is sorted, no clock is
read), so ``--report-only`` can be re-run at any time.

Every rate is the share of *judged* user turns labelled ``genuine_followup`` (``judge_error`` rows and
unjudged rows excluded) by the judge named in the report's header.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from mechprobe.errors import UsageError
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.study import FIGURES
from mechprobe.records import truncation_note
from mechprobe.study.claims import (
    ALPHA,
    CLAIMS,
    DECOUPLED_BAND,
    FAMILY_TVD,
    GREEDY_ZERO,
    MIN_GROUP,
    MIN_LIFT,
    MIN_PAIRED,
    MOVE_BAND,
    RULES,
    ModelAggregate,
    PairedResult,
    Verdict,
    _nan,
    aggregate_model,
    decide_decoupled,
    decide_family,
    decide_greedy_zero,
    decide_lift,
    decide_move,
    family,
    label_dist,
    paired_variant_test,
    turns_tvd,
)
from mechprobe.study.data import (
    DEGENERATE,
    HUMAN_DIR,
    N_BOOT,
    PLAN,
    STAGES,
    T_REF,
    RunData,
    StudyData,
    Turn,
    _judged,
    _temperatures,
    accuracy,
    answers_at_cap,
    collect,
    greedy,
    keyed,
    labels_file_for,
    load_run_data,
    per_item,
    rate,
    sampled,
    turns_at_cap,
)
from mechprobe.study.figures import write_figures
from mechprobe.taxonomy import LABELS

__all__ = ["ALPHA", "CLAIMS", "DECOUPLED_BAND", "DEGENERATE", "FAMILY_TVD", "GREEDY_ZERO", "HUMAN_DIR", "MIN_GROUP",
           "MIN_LIFT", "MIN_PAIRED", "MOVE_BAND", "N_BOOT", "PLAN", "RULES", "STAGES", "T_REF", "ModelAggregate",
           "PairedResult", "RunData", "StudyData", "Turn", "Verdict", "accuracy", "aggregate_model", "answers_at_cap",
           "build_report", "collect", "decide_decoupled", "decide_family", "decide_greedy_zero", "decide_lift",
           "decide_move", "family", "greedy", "keyed", "label_dist", "labels_file_for", "load_run_data",
           "paired_variant_test", "per_item", "rate", "sampled", "truncation_line", "turns_at_cap",
           "turns_tvd", "write_figures", "write_report"]

FIGURE_KEYS = ("accuracy", "temperature", "perturbations", "profiles", "human")


def _fmt_secs(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *["| " + " | ".join(r) + " |" for r in rows]]


def truncation_line(data: StudyData) -> str:
    """``k of n answers truncated, excluded`` over every run of the study, with the user turns left out."""
    runs = [*data.full.values(), *data.variants.values(), *data.human.values()]
    cap = answers_at_cap(runs)
    line = truncation_note(cap.k, cap.n, data.include_truncated)
    if data.include_truncated:
        return line + ": their user turns count in every rate."
    return line + (f": the {sum(r.n_truncated_turns for r in runs)} user turns after them are left out of every "
                   "rate and test (`include_truncated=True` keeps them).")


def _header(data: StudyData) -> list[str]:
    """Title, judge, skipped models and failures, settings, the truncation rule."""
    judges = data.judges()
    jtxt = ", ".join(f"`{j}`" for j in judges) or "none yet"
    plan = data.plan
    L = [f"# Study: interaction awareness across the embedded models ({plan.get('profile', '?')} profile)", "",
         "Regenerate: the study command in report-only mode"
         + (", quick profile" if plan.get("profile") == "quick" else "") + " (a pure function of the runs under "
         f"`{plan.get('root', data.root)}`). Every rate below is the share of judged user turns labelled "
         f"`genuine_followup` by the judge **{jtxt}** (judge spec `{plan.get('judge', '?')}`, labels file "
         f"`{data.labels_file}`), with 95% Wilson CIs unless stated.", ""]
    if len(judges) > 1:
        L += [f"**Warning:** the labels come from more than one judge ({jtxt}); rates mix instruments.", ""]
    for m, why in sorted(plan.get("unavailable", {}).items()):
        L.append(f"- **{m} skipped**: {why}")
    for key, why in sorted(plan.get("errors", {}).items()):
        L.append(f"- **{key} failed**: {why}")
    if plan.get("unavailable") or plan.get("errors"):
        L.append("")
    if not data.full:
        return L + ["No runs yet: run `python experiments/study.py` first.", ""]
    L += ["Settings: " + "; ".join(
        f"`{m}` — {data.full[(m, data.datasets(m)[0])].config.get('engine', '?')} engine, "
        f"caps {data.full[(m, data.datasets(m)[0])].config.get('max_assistant_tokens', '?')}/"
        f"{data.full[(m, data.datasets(m)[0])].config.get('max_user_tokens', '?')} tokens (answer/user turn), "
        f"{data.full[(m, data.datasets(m)[0])].config.get('samples', '?')} samples per temperature"
        for m in data.models()) + (f"; greedy + {plan['variant_samples']} sample(s) at T={T_REF:g} per perturbation "
                                    "variant" if "variant_samples" in plan else "") + ".", "",
          "An answer that hit its token cap (`stop_reason == max_tokens`) is itself truncated: every table gives "
          "the share of such answers. " + truncation_line(data), ""]
    return L


def _accuracy(data: StudyData, figures: dict[str, str]) -> list[str]:
    """Section 1. task accuracy beside the follow-up rates."""
    L: list[str] = []
    L += ["## 1. Accuracy vs awareness", "",
          f"Task accuracy (exact match for GSM8K/MATH-500, IFEval prompt-level strict; unscored datasets —) beside "
          f"the follow-up rate of greedy and sampled (T={T_REF:g}) user turns.", ""]
    rows = []
    for (m, d), rd in sorted(data.full.items()):
        acc = accuracy(rd)
        rows.append([m, d, str(len(rd.scores)), acc.cell() if acc.n else "—", answers_at_cap([rd]).cell(),
                     rate(greedy(rd.turns)).cell(), rate(sampled(rd.turns)).cell(),
                     turns_at_cap(rd.turns).cell()])
    L += _table(["model", "dataset", "items", "accuracy", "answers at cap", "greedy follow-up", f"sampled T={T_REF:g}",
                 "user turns at cap"], rows)
    L += ["", f"![accuracy vs awareness]({figures['accuracy']})", "",
          f"*Per model and dataset: task accuracy next to the greedy and T={T_REF:g} follow-up rates, 95% Wilson CIs.*",
          ""]
    return L


def _temperature(data: StudyData, figures: dict[str, str]) -> list[str]:
    """Section 2. follow-up rate vs temperature."""
    L: list[str] = []
    L += ["## 2. Follow-up rate vs temperature", "",
          "Pooled over each model's datasets; `±` is the CI half-width. Degeneration = label `empty_or_degenerate`.", ""]
    rows = []
    for m in data.models():
        runs = [data.full[(m, d)] for d in data.datasets(m)]
        turns = [t for r in runs for t in r.turns]
        for temp in _temperatures(data, m):
            tt = [t for t in turns if math.isclose(t.temperature, temp)]
            rows.append([m, "greedy" if temp == 0 else f"{temp:g}", rate(tt).cell(half=True),
                         rate(tt, DEGENERATE).cell(half=True), turns_at_cap(tt).cell(), answers_at_cap(runs).cell()])
    L += _table(["model", "T", "follow-up rate", "degenerate", "user turns at cap", "answers at cap"], rows)
    L += ["", f"![temperature]({figures['temperature']})", "",
          "*Follow-up rate (solid) and degeneration rate (dashed) against temperature, one line per model, 95% CIs.*",
          ""]
    return L


def _profiles(data: StudyData, figures: dict[str, str]) -> list[str]:
    """Section 4. label distribution per model and dataset."""
    L: list[str] = []
    L += ["## 4. Failure profiles", "", "Label distribution of all user turns (every decoding) per model and dataset.",
          ""]
    rows = []
    for (m, d), rd in sorted(data.full.items()):
        dist = label_dist(rd.turns)
        n = len(_judged(rd.turns))
        rows.append([m, d, str(n), *[f"{dist.get(lab, 0.0):.0%}" if n else "—" for lab in LABELS],
                     answers_at_cap([rd]).cell()])
    L += _table(["model", "dataset", "n", *LABELS, "answers at cap"], rows)
    L += ["", f"![failure profiles]({figures['profiles']})", "",
          "*Stacked share of each label per model and dataset: what the models write instead of a follow-up.*", ""]
    return L


def _human(data: StudyData, figures: dict[str, str]) -> list[str]:
    """Section 5. the real next human turn vs the models'."""
    L: list[str] = []
    L += ["## 5. Human reference", "",
          "The real next human turn of HH-RLHF / Topical-Chat conversations (after the *original* reply), judged by "
          "the same judge, beside each model's generated turns on the same conversations (after its own reply).", ""]
    rows = []
    for ds, hd in sorted(data.human.items()):
        hk = {t.item_id: t for t in hd.turns}
        for m in data.models():
            rd = data.full.get((m, ds))
            if rd is None:
                continue
            ids = sorted(set(hk) & set(rd.scores))
            mt = [t for t in rd.turns if t.item_id in set(ids)]
            rows.append([ds, m, str(len(ids)), rate([hk[i] for i in ids]).cell(), rate(greedy(mt)).cell(),
                         rate(sampled(mt)).cell(), answers_at_cap([rd]).cell()])
    L += _table(["dataset", "model", "conversations", "human next turn", "model greedy", f"model T={T_REF:g}",
                 "answers at cap"], rows) if rows else ["No human-reference runs (needs hh_rlhf or topical_chat)."]
    L += ["", f"![human reference]({figures['human']})", "",
          "*Follow-up rate of the real human next turn against the models' generated turns on the same conversations.*",
          ""]
    return L


def _stages(data: StudyData) -> list[str]:
    """Section wall and CPU seconds per stage."""
    L: list[str] = []
    L += ["## Stage times", "", "Wall seconds summed over every command that did work on the run (from "
          "`study_stages.jsonl` in each run directory).", ""]
    stage_names = sorted({s for v in data.stages.values() for s in v if not s.startswith("cpu:")})
    rows = [[m, d, *[_fmt_secs(data.stages[(m, d)][s]) if s in data.stages[(m, d)] else "—" for s in stage_names]]
            for (m, d) in sorted(data.stages)]
    L += _table(["model", "dataset", *stage_names], rows) if stage_names else ["No stage times recorded."]
    wall = sum(v for st in data.stages.values() for k, v in st.items() if not k.startswith("cpu:"))
    cpu = sum(v for st in data.stages.values() for k, v in st.items() if k.startswith("cpu:"))
    if stage_names:
        L += ["", f"Total wall time {_fmt_secs(wall)}. Wall time also counts any time a command was stopped or shared "
              "the CPU with other jobs; process CPU time (all threads), recorded for later commands only: "
              f"{_fmt_secs(cpu) if cpu else 'not recorded'}."]
    return L


def _perturbations(data: StudyData, figures: dict[str, str], aggs: dict[str, ModelAggregate]) -> list[str]:
    """Section 3. each perturbation against the full conversation (paired tests)."""
    L: list[str] = []
    L += ["## 3. Perturbations (change vs `full`)", "",
          f"Each variant reuses the same assistant records. Greedy: rates on items with both greedy labels and the "
          f"exact McNemar p (b = genuine only in full, c = only in the variant). Sampled (T={T_REF:g}): paired "
          f"bootstrap over items ({N_BOOT} resamples) of the variant's rate minus full's.", ""]
    rows = []
    for m, a in aggs.items():
        cap = answers_at_cap([data.full[(m, d)] for d in data.datasets(m)]).cell()
        for p in a.paired:
            diff = "—" if _nan(p.diff) else f"{p.diff:+.1%} [{p.ci[0]:+.1%}, {p.ci[1]:+.1%}], p={p.p_boot:.3g}"
            rows.append([m, p.variant, str(p.n_items), f"{p.greedy_full.p:.1%} → {p.greedy_variant.p:.1%}"
                         if p.greedy_full.n else "—", f"{p.b}/{p.c}, p={p.p_mcnemar:.3g}",
                         f"{p.sampled_full.p:.1%} → {p.sampled_variant.p:.1%}" if p.sampled_full.n else "—", diff, cap])
    L += _table(["model", "variant", "items", "greedy full → variant", "McNemar b/c", "sampled full → variant",
                 "change [95% CI]", "answers at cap"], rows) if rows else ["No perturbation runs."]
    L += ["", f"![perturbations]({figures['perturbations']})", "",
          f"*Sampled (T={T_REF:g}) follow-up rate per perturbation next to the unperturbed conversation, per model, "
          "95% Wilson CIs.*", ""]
    return L


def _claims(data: StudyData, aggs: dict[str, ModelAggregate], jtxt: str) -> list[str]:
    """Section 6. the claims table and its decision rules."""
    L: list[str] = []
    L += ["## 6. Claims", "", f"Judge: {jtxt}.", ""]
    rows = []
    for name, fn in CLAIMS:
        cells = []
        for m in data.models():
            v = fn(aggs[m])
            cells.append(f"**{v.verdict}** — {v.evidence}")
        rows.append([name, *cells])
    L += _table(["claim", *data.models()], rows)
    L += ["", RULES, ""]
    return L


def build_report(data: StudyData, figures: dict[str, str]) -> str:
    """The README markdown (deterministic in ``data``); ``figures`` maps figure key -> relative path."""
    L = _header(data)
    if not data.full:
        return "\n".join(L)
    jtxt = ", ".join(f"`{j}`" for j in data.judges()) or "none yet"
    aggs = {m: aggregate_model(data, m) for m in data.models()}
    L += _accuracy(data, figures) + _temperature(data, figures) + _perturbations(data, figures, aggs)
    L += _profiles(data, figures) + _human(data, figures) + _claims(data, aggs, jtxt) + _stages(data)
    return "\n".join(L) + "\n"


def write_report(root: str | Path, labels_file: str, report_dir: str | Path, figures_dir: str | Path,
                 include_truncated: bool = False) -> Path:
    """Collect the runs under ``root`` and write ``report_dir/README.md`` and ``figures_dir/study_*.png``.

    With no runs under ``root`` (a fresh clone, a mistyped ``--root``) an existing report is never replaced
    by an empty one: that is a :class:`~mechprobe.errors.UsageError` naming the root, and nothing is written.
    """

    data = collect(root, labels_file, include_truncated)
    report_dir, figures_dir = Path(report_dir), Path(figures_dir)
    if not data.full and (report_dir / "README.md").exists():
        raise UsageError(f"no runs with labels {labels_file} under {root}, so the report would be empty; refusing "
                         f"to overwrite {report_dir / 'README.md'}. Check root= (and quick=, judge=), or run the "
                         "study first")
    paths = {k: figures_dir / f"study_{k}.png" for k in FIGURES} if data.full else {}
    rel = {k: os.path.relpath(p, report_dir) for k, p in paths.items()} or {k: "" for k in FIGURES}
    report_dir.mkdir(parents=True, exist_ok=True)
    out = report_dir / "README.md"
    out.write_text(build_report(data, rel), encoding="utf-8")
    # The figures are the last thing written: a plotting failure costs the pictures (one line), never the README.
    if paths:
        _, failed = draw_figure(figures_dir, lambda: write_figures(data, figures_dir))
        if failed:
            print(f"mechprobe: error: {failed}", file=sys.stderr)
    return out
