"""The post-training report: markdown from the evaluation summary (a pure function of its inputs, so the
same summary always gives the same report)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mechprobe.audit.estimate import Estimate
from mechprobe.io import read_json, write_json
from mechprobe.records import truncation_note
from mechprobe.stats import Rate

TRAIN_KEYS = ("method", "train_conversations", "heldout_conversations", "train_examples", "skipped", "pairs",
              "judge_error_on_pairs", "beta", "steps_done", "resumed_from", "seconds", "seconds_per_step",
              "tokens_per_s", "first_loss", "last_loss_mean10", "last_reward_accuracy_mean10", "heldout_loss")


def _fmt_rate(d: dict[str, Any]) -> str:
    return Rate(d["k"], d["n"]).fmt()


def _training(train_info: dict[str, Any]) -> list[str]:
    if not train_info:
        return []
    return ["## Training", "", *[f"- {k}: {train_info[k]}" for k in TRAIN_KEYS if k in train_info], ""]


def _rates(summary: dict[str, Any]) -> list[str]:
    lines = ["## Follow-up rates (judge: " + summary.get("judge", "?") + ")", "",
             "| arm | dataset | greedy follow-up [95% CI] | sampled follow-up [95% CI] | task accuracy [95% CI] "
             "| truncated answers |", "|---|---|---|---|---|---|"]
    for arm, per in summary["arms"].items():
        for ds, r in per.items():
            acc = _fmt_rate(r["accuracy"]) if r["accuracy"]["n"] else "unscored"
            cut = r.get("truncated")
            cut_s = truncation_note(cut["k"], cut["n"], not cut["excluded"]) if cut else "n/a"
            lines.append(f"| {arm} | {ds} | {_fmt_rate(r['followup']['greedy'])} | "
                         f"{_fmt_rate(r['followup']['sample'])} | {acc} | {cut_s} |")
    return lines


def _corrected(summary: dict[str, Any]) -> list[str]:
    audited = [(arm, ds, r["corrected"]) for arm, per in summary["arms"].items() for ds, r in per.items()
               if r.get("corrected")]
    lines = ["", "## Follow-up rates corrected by the audit (PPI++ on the audited turns)", ""]
    if not audited:
        lines.append("No eval run is audited: every rate above is judge only (`mechprobe audit RUN` draws the sample).")
    else:
        lines += ["| arm | dataset | greedy, corrected [95% CI] | sampled, corrected [95% CI] | audited turns | "
                  "labellers |", "|---|---|---|---|---|---|"]
        for arm, ds, c in audited:
            cell = {k: (Estimate(**c[k]).cell() + f" (n={c[k]['n_audited']})" if c.get(k) else "n/a")
                    for k in ("greedy", "sample")}
            lines.append(f"| {arm} | {ds} | {cell['greedy']} | {cell['sample']} | {c['n_audited']} | "
                         f"{', '.join(c['labellers'])} |")
    return lines + _corrected_differences(summary)


def _corrected_differences(summary: dict[str, Any]) -> list[str]:
    diffs = [(comp, ds, d) for comp, per in summary.get("corrected_paired", {}).items() for ds, d in per.items()]
    if not diffs:
        return []
    lines = ["", "| comparison | dataset | decoding | difference, judge only [95% CI] | "
             "difference, corrected [95% CI] (n items audited in both) |", "|---|---|---|---|---|"]
    for comp, ds, d in diffs:
        for dec, v in d.items():
            if v is None:
                continue
            c = v["corrected"]
            lines.append(f"| {comp} | {ds} | {dec} | {Estimate(**v['judge_only']).cell()} | "
                         f"{Estimate(**c).cell() + ' (n=' + str(c['n_audited']) + ')' if c else 'n/a'} |")
    return lines


def _paired(summary: dict[str, Any]) -> list[str]:
    lines = ["", "## Paired tests (McNemar exact, same record ids)", "",
             "| comparison | dataset | decoding | pairs | both | only first | only second | p |",
             "|---|---|---|---|---|---|---|---|"]
    for comp, per in summary["paired"].items():
        for ds, rows in per.items():
            for r in rows:
                lines.append(f"| {comp} | {ds} | {r['decoding']} | {r['n']} | {r['both']} | {r['only_a']} | "
                             f"{r['only_b']} | {r['p']:.3g} |")
    return lines


def _steering_rate(d: dict[str, Any] | None) -> str:
    if not d or d.get("followup_rate") is None:
        return "?"
    ci = d.get("ci") or [None, None]
    return (f"{d['followup_rate']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] (n={d.get('n')})" if ci[0] is not None
            else f"{d['followup_rate']:.3f} (n={d.get('n')})")


def _steering(summary: dict[str, Any]) -> list[str]:
    st = summary.get("steering")
    if not st:
        return []
    return ["", "## Steering it vs training it", "",
            f"The baked arm is the base model with the difference-of-means vector of `{st['run']}` (residual "
            f"{st['layer']}, alpha {st['alpha']:g} {st.get('alpha_unit') or ''}, {st['how']}; judge "
            f"{st.get('judge')}) folded into its weights. In that steering run, greedy follow-up on its "
            f"held-out {st['dataset']} items: unsteered {_steering_rate(st.get('unsteered_heldout'))}, steered "
            f"(hooks, boundary + generated positions) {_steering_rate(st.get('steered_heldout'))}. The tables above "
            "give the same comparison for the baked weights (vector at every position) on this report's items."]


def _labels(summary: dict[str, Any]) -> list[str]:
    return ["", "## Label distributions (pooled over datasets)", "",
            *[f"- {arm}: " + ", ".join(f"{k} {v}" for k, v in per["all"]["labels"].items())
              for arm, per in summary["arms"].items()]]


def _shifts(shifts: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["", "## Inside the model: boundary state on the base model's difference-of-means direction", ""]
    if not any(shifts.values()):
        lines.append("no base direction could be formed (see notes)")
    for name, rows in shifts.items():
        if not rows:
            continue
        best = max(rows, key=lambda r: abs(r["shift_gap"]))
        lines.append(f"- {name}: largest |shift| at residual {best['layer']}: {best['shift_gap']:+.3f} class gaps "
                     f"[{best['ci_gap'][0]:+.3f}, {best['ci_gap'][1]:+.3f}] over {best['n_items']} items")
        lines.append("  per layer (class gaps): " + ", ".join(f"L{r['layer']} {r['shift_gap']:+.2f}" for r in rows))
    return lines


def report_markdown(summary: dict[str, Any], train_info: dict[str, Any], shifts: dict[str, list[dict[str, Any]]],
                    notes: list[str]) -> str:
    """The report: training, follow-up rates (judge only, then audit-corrected), paired tests, the steering
    comparison, label distributions, the boundary shift and the notes."""
    lines = [f"# Post-training report: {train_info.get('model')}", "", *_training(train_info)]
    lines += _rates(summary) + _corrected(summary) + _paired(summary) + _steering(summary) + _labels(summary)
    lines += _shifts(shifts)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    write_json(out, summary)


def read_summary(out: Path) -> dict[str, Any]:
    return read_json(out)
