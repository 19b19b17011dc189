"""Reader cost of a hidden-state judge: seconds per turn of reading [question, query, answer, turn] up to a layer,
per reader model, on the same labelled turns, one turn per answer and whole answers, in one process.

    python benchmarks/bench_reader.py [--source judge_fresh_test_v5] [--turns 40]
        [--readers qwen2.5-coder-0.5b-instruct:12 qwen2.5-coder-1.5b-instruct:14]
    python benchmarks/bench_reader.py --readers qwen2.5-coder-0.5b-instruct:12 \
        qwen2.5-coder-0.5b-instruct:12:answer-contrast --out benchmarks/results/reader_contrast.json

Why: a larger reader is the next candidate for the hidden-state judge (docs/findings.md: the 0.5B reader's heads stay
near kappa 0.55-0.6), and its cost decides both the judge's speed and what computing its features for the whole
labelled pool costs. The first reader is the baseline; the JSON gives each reader's ratio to it, measured in the same
run (alternating readers per repeat so load drifts hit both), and the CPU. A reader may name its feature kind
(``MODEL:LAYER:KIND``, :data:`mechprobe.judges.hidden.FEATURE_KINDS`; default ``turn``): ``answer-contrast`` (hidden-v7
on) also reads each turn with its answer hidden.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _reader(spec: str) -> tuple[str, int, str]:
    """``MODEL:LAYER[:KIND]`` -> (model, layer, feature kind)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise SystemExit(f"--readers {spec!r}: write MODEL:LAYER or MODEL:LAYER:KIND")
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "turn"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="judge_fresh_test_v5", help="a blind_sets.SOURCES name")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--readers", nargs="+", default=["qwen2.5-coder-0.5b-instruct:12", "qwen2.5-coder-1.5b-instruct:14"],
                   help="MODEL:LAYER[:KIND], the first is the baseline")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default: results/reader_<source>.json)")
    a = p.parse_args()

    import torch

    from mechprobe.audit.blind_sets import load_blind_sets
    from mechprobe.judges.base import load_judge_model
    from mechprobe.judges.hidden import judge_features
    from mechprobe.judges.judge_eval import judge_inputs
    from mechprobe.judges.speed import answers_in, cpu_description, speed_sample
    from mechprobe.lm.device import cpu_threads

    torch.set_num_threads(cpu_threads())
    blind = load_blind_sets(HERE.parent)
    inputs = judge_inputs(blind)
    pool = [inputs[t] for t in sorted(inputs) if blind.turns[t].source == a.source]
    if not pool:
        raise SystemExit(f"--source {a.source}: no labelled turns; name a source whose folder exists")
    shapes = {"one_per_answer": speed_sample(pool, a.turns)[1:], "whole_answers": speed_sample(pool, a.turns, True)[1:]}
    readers = [(r, *_reader(r)) for r in a.readers]
    lms = {m: load_judge_model(m) for _, m, _, _ in readers}
    for _, m, layer, kind in readers:  # warm-up: lazy loads and first-call allocations
        judge_features(lms[m], pool[:2], [layer], kind)
    secs: dict[str, dict[str, float]] = {r: {s: 0.0 for s in shapes} for r, *_ in readers}
    for _ in range(a.repeats):
        for shape, turns in shapes.items():
            for r, m, layer, kind in readers:
                t0 = time.perf_counter()
                judge_features(lms[m], turns, [layer], kind)
                secs[r][shape] += time.perf_counter() - t0
    base = readers[0][0]
    rows = []
    for r, m, layer, kind in readers:
        for shape, turns in shapes.items():
            s = secs[r][shape] / a.repeats
            rows.append({"reader": m, "layer": layer, "features": kind,
                         "dtype": str(next(lms[m].model.parameters()).dtype),
                         "shape": shape, "turns": len(turns), "answers": answers_in(turns),
                         "seconds": round(s, 2), "turns_per_s": round(len(turns) / s, 3),
                         "ratio_to_baseline": round(s / (secs[base][shape] / a.repeats), 2)})
            print(json.dumps(rows[-1]))
    out = Path(a.out) if a.out else HERE / "results" / f"reader_{a.source}.json"
    out.write_text(json.dumps({"cpu": cpu_description(), "source": a.source, "repeats": a.repeats, "rows": rows},
                              indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
