"""The boundary cache from the judge's kept conversations vs from nothing, on a real run's probe files.

    python benchmarks/bench_cache_from_judge.py RUN [--judge hybrid-voice:qwen2.5-coder-1.5b-instruct]

Not a test. One process, the run's own model loaded once (its dtype and template), the run's
``assistant.jsonl`` / ``user_turns.jsonl`` / ``manifest.json`` copied into two scratch runs. The ``hybrid-voice:``
judge of that model (disk cache off, so it runs its model on every candidate) labels the first copy with its
KV pool sized as ``Stages.labels`` sizes it; then the cache stage runs on the second copy from nothing (the
baseline: every conversation prefilled again) and on the first with ``prefixes=`` the judge's store. Reports
both cache times, the ratio, the pool hits, the pool's size and the largest difference between the two caches
(float16 storage, as the stage writes it). Writes
``benchmarks/results/cache_from_judge_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.decode_limit import cpu_name  # noqa: E402
from mechprobe.activations.cache import ActivationCache, cache_run  # noqa: E402
from mechprobe.io import read_json, versions  # noqa: E402
from mechprobe.judges.factory import make_judge  # noqa: E402
from mechprobe.judges.run import judge_run  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402
from mechprobe.stages import pool_bytes_for  # noqa: E402

PROBE_FILES = ("assistant.jsonl", "user_turns.jsonl", "manifest.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a probe run directory (its probe files are copied, never changed)")
    p.add_argument("--judge", default=None, help="default: hybrid-voice:<the run's model>")
    p.add_argument("--out", default=None, help="default: benchmarks/results/cache_from_judge_<model>.json")
    a = p.parse_args(argv)
    run = Path(a.run)
    cfg = read_json(run / "manifest.json")["config"]
    judge_spec = a.judge or f"hybrid-voice:{cfg['model']}"
    lm = load_model(cfg["model"], dtype=cfg.get("dtype"), chat_template=cfg.get("chat_template"))
    out: dict = {"model": cfg["model"], "judge": judge_spec, "cpu": cpu_name(), "threads": torch.get_num_threads(),
                 "model_dtype": str(lm.dtype), "versions": versions()}
    with tempfile.TemporaryDirectory() as tmp:
        pooled, base = Path(tmp) / "pooled", Path(tmp) / "base"
        for d in (pooled, base):
            d.mkdir()
            for f in PROBE_FILES:
                shutil.copy(run / f, d / f)
        judge = make_judge(judge_spec, loaded=lm, cache_dir=False)
        judge.store.pool_bytes = max(judge.store.pool_bytes, pool_bytes_for(pooled, lm.model))
        t0 = time.perf_counter()
        summary = judge_run(pooled, judge=judge)
        out["judge_seconds"] = round(time.perf_counter() - t0, 1)
        out["turns"] = summary.n_records
        out["pool_mb"] = round(judge.store._pool_used / 2**20, 1)
        out["pooled_conversations"] = len(judge.store._pool)
        t0 = time.perf_counter()
        cache_run(base, lm)
        out["cache_seconds_from_nothing"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        cache_run(pooled, lm, prefixes=judge.store)
        out["cache_seconds_from_judge"] = round(time.perf_counter() - t0, 1)
        meta = read_json(pooled / "activations" / "manifest.json")
        out["prompts"] = meta["timing"]["forward_prompts"]
        out["prefix_hits"] = meta["timing"].get("prefix_hits", 0)
        out["forward_tokens_from_judge"] = meta["timing"]["forward_tokens"]
        out["forward_tokens_from_nothing"] = read_json(base / "activations" / "manifest.json")["timing"]["forward_tokens"]
        x, y = ActivationCache.load(pooled).stack(), ActivationCache.load(base).stack()
        rel = ((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).max()
        out["max_abs_diff"] = float((x - y).abs().max())
        out["max_rel_l2_diff"] = float(rel)
    out["cache_speedup"] = round(out["cache_seconds_from_nothing"] / max(out["cache_seconds_from_judge"], 1e-3), 2)
    print(json.dumps(out, indent=1))
    res = Path(a.out) if a.out else HERE / "results" / f"cache_from_judge_{cfg['model']}.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
