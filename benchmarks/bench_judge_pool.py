"""The hybrid judge over several steering conditions of the same items: prefix pool on vs off.

    python benchmarks/bench_judge_pool.py --steering runs/<run>/steering_llamacpp/L18_boundary+generated_resid \\
                                          [--n 24] [--judge-model qwen2.5-coder-1.5b-instruct]

Not a test. One process, one real steering directory: the first ``n`` held-out items of every
``alpha_*.jsonl`` in it (plus the directory above's ``alpha_0_none.jsonl``) are judged one condition per
``label_many`` call, exactly as ``steer.py`` judges them, by the ``hybrid-voice:`` judge with its disk cache off:
once with ``pool_mb=0`` (every call re-runs each conversation's prefill: the baseline, what ran before) and
once with the default pool. Reports seconds per judged turn, the ratio, the pool's size in MB, and whether
every label and P(genuine) is the same (the pool returns the very tensors of the first prefill, so they
must be). Writes ``benchmarks/results/judge_pool_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mechprobe.io import read_jsonl, versions  # noqa: E402
from mechprobe.judges.base import JudgeInput  # noqa: E402
from mechprobe.judges.hybrid import DEFAULT_POOL_MB, DEFAULT_VOICE, HybridJudge  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steering", required=True, help="a steering setting directory (alpha_*.jsonl files)")
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--judge-model", default="qwen2.5-coder-1.5b-instruct")
    a = p.parse_args(argv)
    d = Path(a.steering)
    run = next(q for q in d.parents if (q / "assistant.jsonl").exists())
    by_item = {r["item_id"]: r for r in read_jsonl(run / "assistant.jsonl", key="item_id")}
    files = sorted(d.glob("alpha_*.jsonl")) + sorted(d.parent.glob("alpha_0_none.jsonl"))
    files = [f for f in files if not f.name.endswith(".labels.jsonl")]
    conds = []
    ids: list[str] | None = None
    for f in files:
        rows = {r["item_id"]: r for r in read_jsonl(f, key="item_id")}
        ids = ids or list(rows)[: a.n]
        conds.append([JudgeInput(record_id=f"{f.stem}|{i}", prompt=by_item[i]["prompt"],
                                 response=by_item[i]["response"], raw_text=rows[i]["raw_text"], text=rows[i]["text"],
                                 stop_reason=rows[i]["stop_reason"], dataset=by_item[i]["dataset"],
                                 decoding="greedy", item_id=i) for i in ids if i in rows])
    lm = load_model(a.judge_model, dtype=torch.bfloat16)
    out: dict = {"judge_model": a.judge_model, "steering": str(d), "conditions": [f.stem for f in files],
                 "n_items": len(ids or []), "machine": platform.processor() or platform.machine(),
                 "threads": torch.get_num_threads(), "versions": versions(), "rows": []}
    labels = {}
    for pool in (0.0, DEFAULT_POOL_MB):
        j = HybridJudge(loaded=lm, cache_dir=False, voice=DEFAULT_VOICE, pool_mb=pool)
        t0 = time.perf_counter()
        got = {r.record_id: (r.label, r.probs.get("genuine")) for c in conds for r in j.label_many(c)}
        dt = time.perf_counter() - t0
        n = len(got)
        labels[pool] = got
        row = {"pool_mb": pool, "turns": n, "seconds": round(dt, 2), "s_per_turn": round(dt / n, 3),
               "prefix_tokens": j.store.stats["prefix_tokens"], "pool_hits": j.store.stats["pool_hits"],
               "pool_used_mb": round(j.store._pool_used / 2**20, 1), "pooled_prefixes": len(j.store._pool)}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    base, new = out["rows"]
    out["speedup"] = round(base["seconds"] / new["seconds"], 2)
    out["same_labels"] = labels[0.0] == labels[DEFAULT_POOL_MB]
    print(f"speedup {out['speedup']}x, identical labels and P(genuine): {out['same_labels']}")
    res = HERE / "results" / f"judge_pool_{a.judge_model}.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
