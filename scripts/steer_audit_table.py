"""A steering dose-response from one audited run: judge-only vs corrected rates, both codebook readings, figure.

    python scripts/steer_audit_table.py runs/q15-gsm8k --model qwen2.5-coder-1.5b-instruct \\
        --out reports/audit/qwen2.5-coder-1.5b-instruct-gsm8k/steering.md \\
        --figure figures/steer_audit_qwen2.5-coder-1.5b-instruct.png

Reads the run's ``audit/report.json`` (written by ``mechprobe audit RUN --labels ...``), its sample and labels, and
the judged turns. Per condition: turns, judge-only rate, corrected rate (prediction-powered, from the report),
the audited rate under the codebook as written (share of labellers calling a turn genuine, mean over audited turns)
and under the strict reading that does not count stock template turns (:mod:`mechprobe.turns.stock_turns`), the
share of template turns among all the condition's turns, and the paired difference vs alpha 0 (judge only and
corrected, from the report).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mechprobe.audit import load_labellers, load_run_table, load_sample  # noqa: E402
from mechprobe.audit.report import audit_rows  # noqa: E402
from mechprobe.judges.factory import spec_of_judge_name  # noqa: E402
from mechprobe.stats import wilson  # noqa: E402
from mechprobe.turns.stock_turns import template_kind  # noqa: E402

COND = re.compile(r"^(?P<kind>[a-z_]+)\|L(?P<layer>\d+)\|a(?P<alpha>[-0-9.e]+)")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ci(d: dict) -> str:
    return f"{_pct(d['point'])} [{_pct(d['lo'])}, {_pct(d['hi'])}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--figure", required=True)
    a = p.parse_args(argv)
    run = Path(a.run)
    rep = json.loads((run / "audit" / "report.json").read_text())
    table, sample = load_run_table(run), load_sample(run)
    labellers = load_labellers(run, sample)
    rows = audit_rows(sample, table, labellers)
    by = sample.by
    strata = table.strata(by)
    judge = ", ".join(sorted({r.judge for r in table.rows}))
    diffs = {d["condition"]: d for d in rep.get("differences", [])}

    out = []
    for s, turns in strata.items():
        cond = s.split(" ")[0]
        aud = [r for r in rows if r.stratum == s and r.labels]
        lenient = [r.consensus for r in aud]
        strict = [0.0 if template_kind(table.get(r.record_id).turn) else r.consensus for r in aud]
        k_tpl = sum(template_kind(t.turn) is not None for t in turns)
        m = COND.match(cond)
        out.append({"stratum": s, "condition": cond, "kind": m["kind"] if m else cond,
                    "alpha": float(m["alpha"]) if m else (0.0 if cond == "none" else None),
                    "n": len(turns), "n_audited": len(aud), "rate": rep["rates"][s],
                    "lenient": sum(lenient) / len(lenient) if lenient else None,
                    "strict": sum(strict) / len(strict) if strict else None,
                    "lenient_ci": wilson(round(sum(lenient)), len(lenient)) if lenient else None,
                    "strict_ci": wilson(round(sum(strict)), len(strict)) if strict else None,
                    "template": k_tpl / len(turns) if turns else None, "diff": diffs.get(cond)})

    lab = ", ".join(f"{x['name']} ({x['kind']})" for x in rep["labellers"])
    kap = rep["inter_labeller"][0] if rep["inter_labeller"] else None
    lines = [f"# Steering, audited: {a.model} ({run.name})", "",
             f"Judge {judge}; audit sample {rep['sample']['sample_id']} ({rep['sample']['n']} turns by {by}); "
             f"labellers {lab}" + (f"; labeller-labeller binary kappa {kap['binary']['kappa']:.2f}, 8-label "
                                   f"{kap['labels8']['kappa']:.2f}" if kap and kap['binary']['kappa'] is not None
                                   else "") + ".", "",
             "Corrected = prediction-powered inference (ppi_py) from the audited turns, or the audit's own Wilson "
             "interval where every turn of a stratum was audited. Audited rate = mean share of labellers calling a "
             "turn genuine (the codebook as written); strict = the same with stock template turns "
             "(acknowledgement plus plan, a request for the final answer; mechprobe.turns.stock_turns) not counted. "
             "Template share is over all the condition's turns.", "",
             "| condition | turns | judge only | corrected (n audited) | audited, codebook | audited, strict | "
             "template share | vs alpha 0, judge only | vs alpha 0, corrected |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in out:
        d = r["diff"]
        lines.append(f"| {r['stratum'].replace('|', ' ')} | {r['n']} | {_ci(r['rate']['judge_only'])} | "
                     f"{_ci(r['rate']['corrected'])} ({r['n_audited']}) | {_pct(r['lenient'])} | {_pct(r['strict'])} | "
                     f"{_pct(r['template'])} | {_ci(d['judge_only']) if d else ''} | {_ci(d['corrected']) if d else ''} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    base = next((r for r in out if r["condition"] == "none"), None)
    for kind, colour in (("diff_means", "tab:blue"), ("random", "tab:gray")):
        pts = sorted((r for r in out if r["kind"] == kind), key=lambda r: r["alpha"])
        if base:
            pts = [base, *pts]
        xs = [r["alpha"] for r in pts]
        for key, style, name in (("judge_only", ":", "judge only"), ("corrected", "-", "corrected")):
            ys = [r["rate"][key]["point"] for r in pts]
            lo = [y - r["rate"][key]["lo"] for y, r in zip(ys, pts, strict=True)]
            hi = [r["rate"][key]["hi"] - y for y, r in zip(ys, pts, strict=True)]
            ax.errorbar(xs, ys, yerr=[lo, hi], ls=style, marker="o", color=colour, capsize=3,
                        label=f"{kind}, {name}")
        ys = [r["strict"] for r in pts]
        ax.plot(xs, ys, ls="--", marker="x", color=colour, alpha=0.6, label=f"{kind}, audited strict")
    n_items = base["n"] if base else "?"
    ax.set_xlabel("alpha (x mean residual norm)")
    ax.set_ylabel("genuine follow-up rate (greedy)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title(f"{a.model}: steering dose-response, {n_items} held-out items per condition\n"
                 f"judge {spec_of_judge_name(judge) or judge}; audit: {lab}; 95% CIs", fontsize=8)
    fig.tight_layout()
    Path(a.figure).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.figure, dpi=120)
    print(f"wrote {a.out} and {a.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
