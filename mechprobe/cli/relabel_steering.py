"""Re-judge a finished steering run's turns with another judge, without generating anything again.

    mechprobe relabel-steering RUN [--steer-dir RUN/steering_llamacpp] --judge hybrid-voice:MODEL

Why: steering results are only as good as the judge that scored them (docs/results.md: the hybrid judge counted
assistant-voice re-solving as follow-ups). This reads every ``alpha_*.jsonl`` of the steering directory (the
unsteered rows and each layer/kind), judges each turn after the conversation the model saw (the run's query and
assistant answer), and writes ``relabel_<judge>.md`` / ``.json`` beside them: genuine rate with Wilson CI per
condition, McNemar against the unsteered rows (paired by item), and the label counts. Optionally restricted to
items not in a file of item ids (``--exclude-items``), e.g. the items a judge setting was chosen on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from mechprobe.cli import common
from mechprobe.errors import UsageError
from mechprobe.io import read_jsonl
from mechprobe.judges.base import JudgeInput, run_model_name
from mechprobe.judges.factory import make_judge
from mechprobe.stats import wilson
from mechprobe.steering.evaluate import paired_vs_base

HELP = "re-judge a finished steering run's turns with another judge (nothing generated again)"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the relabel-steering command's flags to ``p`` (also ``experiments/relabel_steering.py``'s)."""
    common.add_run(p, "the probe run (assistant.jsonl) the steering ran on", flag="--run")
    p.add_argument("--steer-dir", default=None, help="default: the run's steering_llamacpp or steering directory")
    common.add_judge(p, required=True)
    p.add_argument("--exclude-items", default=None, help="file with one item id per line to leave out")


def run(a: argparse.Namespace) -> int:
    """Re-judge every held-out condition's turns, write relabel_<judge>.md and .json beside them, print the table."""
    common.merge_run(a)
    if a.run is None:
        raise UsageError("pass the run directory the steering ran on (RUN)")
    run_dir = Path(a.run)
    sdir = Path(a.steer_dir) if a.steer_dir else next((run_dir / d for d in ("steering_llamacpp", "steering")
                                                       if (run_dir / d).is_dir()), None)
    if sdir is None or not sdir.is_dir():
        raise UsageError(f"no steering directory under {run_dir}: pass --steer-dir")
    asst = {r["item_id"]: r for r in read_jsonl(run_dir / "assistant.jsonl", key="item_id")}
    skip = set(Path(a.exclude_items).read_text().split()) if a.exclude_items else set()
    # held-out conditions only: select/ holds the train items the layer and alpha were chosen on
    files = sorted(sdir.glob("alpha_*.jsonl")) + sorted(f for f in sdir.glob("*/alpha_*.jsonl")
                                                        if f.parent.name != "select")
    judge = make_judge(a.judge)
    subject = run_model_name(run_dir)
    results = []
    for f in files:
        rows = [r for r in read_jsonl(f) if r["item_id"] not in skip and r["item_id"] in asst]
        inputs = [JudgeInput(record_id=r["item_id"], prompt=asst[r["item_id"]]["prompt"],  # as steer.py judges
                             response=asst[r["item_id"]]["response"], raw_text=r["raw_text"], text=r.get("text"),
                             stop_reason=r.get("stop_reason"), dataset=asst[r["item_id"]].get("dataset", ""),
                             decoding="greedy", item_id=r["item_id"], subject=subject) for r in rows]
        labels = {x.record_id: x.label for x in judge.label_many(inputs)}
        cond = f.stem if f.parent == sdir else f"{f.parent.name}/{f.stem}"
        results.append({"condition": cond, "labels": labels})
        print(f"{cond}: {sum(v == 'genuine_followup' for v in labels.values())}/{len(labels)} genuine", file=sys.stderr)
    base = next((r for r in results if "none" in r["condition"]), None)
    lines = [f"# Steering re-judged: `{judge.name}`", "", f"Run `{run_dir}`, steering `{sdir}`"
             + (f", {len(skip)} items excluded" if skip else "") + ".", "",
             "| condition | genuine [95% CI] | vs unsteered: +/−, McNemar p | labels |", "|---|---|---|---|"]
    out = []
    for r in results:
        g = {k: v == "genuine_followup" for k, v in r["labels"].items()}
        k, n = sum(g.values()), len(g)
        lo, hi = wilson(k, n)
        pv = paired_vs_base(g, {kk: v == "genuine_followup" for kk, v in base["labels"].items()}) \
            if base is not None and r is not base else None
        counts = Counter(r["labels"].values())
        out.append({"condition": r["condition"], "genuine": k, "n": n, "ci": [lo, hi], "paired": pv,
                    "counts": dict(counts)})
        vs = f"+{pv['b']}/−{pv['c']}, p = {pv['p']:.2g}" if pv else "—"
        top = ", ".join(f"{lab} {c}" for lab, c in counts.most_common(3))
        lines.append(f"| {r['condition']} | {k}/{n} = {100 * k / max(n, 1):.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] "
                     f"| {vs} | {top} |")
    stem = "relabel_" + re.sub(r"[^A-Za-z0-9.]+", "_", a.judge).strip("_")
    (sdir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (sdir / f"{stem}.json").write_text(json.dumps({"judge": judge.name, "excluded": sorted(skip), "rows": out},
                                                  indent=1))
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python experiments/relabel_steering.py ...``: the same flags and code as ``mechprobe relabel-steering``."""
    p = common.command_parser(add_args, __doc__)
    return common.friendly(lambda: run(p.parse_args(argv)), p)
