"""Choose an assistant-answer token cap from measured answer lengths: the smallest cap that <= 5% of answers hit.

    python scripts/answer_cap.py runs/q15-gsm8k-answer-length [--target 0.05] [--out reports/answer_cap.md]

The run must have been generated with a generous cap (e.g. ``--max-assistant-tokens 1024``); answers that hit that
cap count as longer than every candidate. Prints (and with ``--out`` writes) the length distribution and the
choice, so the finding preset's cap is a measured number, not a guess.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--target", type=float, default=0.05, help="largest share of answers allowed to hit the cap")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    run = Path(a.run)
    rows = [json.loads(line) for line in (run / "assistant.jsonl").read_text().splitlines() if line.strip()]
    man = json.loads((run / "manifest.json").read_text())
    cfg = man.get("config", {})
    measured_cap = int(cfg.get("max_assistant_tokens", 0))
    n = len(rows)
    lengths = np.array([r["n_tokens"] for r in rows])
    hit = np.array([r["stop_reason"] == "max_tokens" for r in rows])
    eff = np.where(hit, np.inf, lengths)  # an answer that hit the measurement cap is longer than any candidate
    cands = sorted({64 * k for k in range(1, measured_cap // 64 + 1)} | {measured_cap})
    share = {c: float(np.mean(eff >= c)) for c in cands}
    ok = [c for c in cands if share[c] <= a.target]
    choice = ok[0] if ok else None
    q = np.percentile(lengths[~hit], [50, 90, 95, 99]) if (~hit).any() else [np.nan] * 4
    lines = [f"# Answer lengths: {cfg.get('model')} on {cfg.get('dataset')} ({n} answers, greedy, cap {measured_cap})",
             "",
             f"- answers that hit the measurement cap: {int(hit.sum())} of {n}",
             f"- tokens of complete answers: median {q[0]:.0f}, 90th {q[1]:.0f}, 95th {q[2]:.0f}, 99th {q[3]:.0f}, "
             f"max {lengths[~hit].max() if (~hit).any() else 'n/a'}",
             f"- smallest cap that <= {a.target:.0%} of answers reach: **{choice if choice else 'none below ' + str(measured_cap)}**",
             "", "| cap | share of answers reaching it |", "|---|---|"]
    lines += [f"| {c} | {share[c]:.1%} |" for c in cands if c % 128 == 0 or c == choice or c == 192]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0 if choice else 1


if __name__ == "__main__":
    sys.exit(main())
