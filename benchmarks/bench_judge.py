"""Hybrid judge: grounding PMIs one turn at a time (before) vs the turns of a conversation batched (now).

    python benchmarks/bench_judge.py RUN_DIR [RUN_DIR ...] [--model qwen2.5-coder-1.5b-instruct] [--max-groups N]

Both paths run in this one process on the same candidate turns with the judge's PMI cache off, alternating
per conversation (so load drifts hit both alike). Reports seconds per path, the ratio, the largest PMI
difference and how many labels differ. Run directories are ordinary probe runs (``user_turns.jsonl``);
variant directories work too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--max-groups", type=int, default=None, help="conversations to time (default: all)")
    p.add_argument("--out", default=str(HERE / "results" / "judge_batched.json"))
    a = p.parse_args()

    import torch

    from mechprobe.judges.base import inputs_from_run
    from mechprobe.judges.hybrid import CANDIDATES, HybridJudge
    from mechprobe.judges.offline import split_roles
    from mechprobe.lm.device import cpu_threads

    torch.set_num_threads(cpu_threads())
    j = HybridJudge(a.model, cache_dir=False)
    groups: list[list] = []
    for run in a.runs:
        inputs = inputs_from_run(Path(run))
        off = {r.record_id: r for r in j.offline.label_many(inputs)}
        by_conv: dict[str, list] = {}
        for inp in inputs:
            text = split_roles(inp.raw_text)[0].text
            o = off[inp.record_id]
            if (o.label in CANDIDATES or o.rationale.startswith("R10a")) and text.strip():
                key = json.dumps(inp.conversation(), sort_keys=True, ensure_ascii=False)
                by_conv.setdefault(key, []).append((inp, text, o))
        groups += list(by_conv.values())
    groups = groups[: a.max_groups] if a.max_groups else groups
    t_one = t_many = 0.0
    diffs, flips, n = [], 0, 0
    from tqdm.auto import tqdm

    for g in tqdm(groups, desc="conversations", unit="conv"):
        for slot in ("real", "null"):
            j.store.forget(slot)
        t = time.perf_counter()
        one = [j.pmi(inp, text) for inp, text, _ in g]
        t_one += time.perf_counter() - t
        for slot in ("real", "null"):
            j.store.forget(slot)
        t = time.perf_counter()
        many = j.pmi_many([x[0] for x in g], [x[1] for x in g])
        t_many += time.perf_counter() - t
        for (_, _, o), u, v in zip(g, one, many):
            diffs.append(abs(u - v))
            flips += j.decide(o, u)[0] != j.decide(o, v)[0]
            n += 1
    res = {"model": a.model, "dtype": str(j.lm.dtype), "threads": torch.get_num_threads(), "runs": a.runs,
           "conversations": len(groups), "turns": n, "one_at_a_time_s": t_one, "batched_s": t_many,
           "speedup": t_one / t_many if t_many else None, "max_abs_pmi_diff": max(diffs, default=0.0),
           "mean_abs_pmi_diff": sum(diffs) / max(len(diffs), 1), "labels_differing": flips}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
