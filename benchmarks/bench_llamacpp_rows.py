"""llama.cpp engine: decode tokens/s by rows decoded together, in one run.

    python benchmarks/bench_llamacpp_rows.py --model qwen2.5-coder-1.5b-instruct --rows 1 4 9 16 32

The workload is the probe's user stage in miniature: ``--items`` real GSM8K probe prompts (question + a
fixed assistant answer, then the user header), each decoded as ``--per-item`` rows (1 greedy + samples at
T=1) of ``--new`` tokens with no stop token, so every option decodes the same number of tokens. ``rows = 1``
is the engine as it was (one row at a time). Prefill and decode are timed apart: prefill is compute-bound
and shared by an item's rows; decode is where rows together pay off. Writes ``results/llamacpp_rows_*.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9, 16, 32])
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--per-item", type=int, default=9)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from mechprobe.lm import chat
    from mechprobe.lm.device import cpu_threads
    from mechprobe.lm.llamacpp import load_engine
    from mechprobe.turns.datasets import load_dataset

    lm, eng = load_engine(a.model)
    items = load_dataset("gsm8k", limit=a.items).items
    answer = "Let's compute step by step. " * 12
    prompts = [chat.build_probe_prompt(lm.tokenizer, it.prompt, answer).input_ids for it in items]
    rows = [p for p in prompts for _ in range(a.per_item)]
    temps = [0.0 if i % a.per_item == 0 else 1.0 for i in range(len(rows))]
    seeds = list(range(len(rows)))
    res = []
    for r in a.rows:
        eng.max_rows = r
        eng.close()
        # Prefill alone: every distinct prompt once (what any row count must do at least once per group).
        t = time.perf_counter()
        eng.decode_batch(prompts, stop_ids={}, max_new_tokens=1, temperatures=0.0)
        pre = time.perf_counter() - t
        eng.multi().clear()  # the timed call starts from an empty KV, like a fresh stage
        before = eng.multi().n_prefills
        t = time.perf_counter()
        gens = eng.decode_batch(rows, stop_ids={}, max_new_tokens=a.new, temperatures=temps, seeds=seeds)
        total = time.perf_counter() - t
        n = sum(len(g.token_ids) for g in gens)
        n_prefill = eng.multi().n_prefills - before  # the engine's own count (a prompt is reused across groups)
        decode = max(1e-9, total - pre / len(prompts) * n_prefill)
        res.append({"rows": r, "tokens": n, "seconds": total, "prefills": n_prefill, "prefill_s_per_prompt":
                    pre / len(prompts), "decode_s": decode, "decode_tok_s": n / decode, "all_tok_s": n / total,
                    "threads": cpu_threads(), "loadavg": os.getloadavg()[0]})
        print(f"rows {r:3d}: {n} tokens in {total:.1f} s (all {n / total:.1f} tok/s, decode ~{n / decode:.1f} tok/s, "
              f"{n_prefill} prefills)", flush=True)
    base = res[0]["all_tok_s"]
    print("\n| rows together | tokens | seconds | all tok/s | decode tok/s (prefill subtracted) | ratio (all) |")
    print("|---|---|---|---|---|---|")
    for x in res:
        print(f"| {x['rows']} | {x['tokens']} | {x['seconds']:.1f} | {x['all_tok_s']:.1f} | {x['decode_tok_s']:.1f} | "
              f"{x['all_tok_s'] / base:.2f}x |")
    out = Path(a.out or HERE / "results" / f"llamacpp_rows_{a.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "items": a.items, "per_item": a.per_item, "new": a.new,
                               "results": res}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
