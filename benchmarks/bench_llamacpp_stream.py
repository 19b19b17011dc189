"""llama.cpp engine: continuous batching against fixed groups on the probe's answer stage, in one run.

    python benchmarks/bench_llamacpp_stream.py --model qwen2.5-coder-1.5b-instruct --items 64 --max-new 512

The workload is the probe's assistant stage as the finding commands run it: ``--items`` GSM8K questions, greedy,
stopping at the template's end of turn or ``--max-new`` tokens, ``--rows`` rows decoded together. Fixed groups
run ``rows`` answers until the longest of them ends; continuous batching (the default) gives a finished row's
sequence to the next question at once. Both schedulers decode the same questions on the same engine with the
prompt-state cache off (each prefills every prompt), and must give the same tokens. The baseline is measured in
the same run. Writes ``results/llamacpp_stream_<model>.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.decode_limit import cpu_name  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.llamacpp import load_engine  # noqa: E402
from mechprobe.lm.models import cpu_threads  # noqa: E402
from mechprobe.turns.datasets import load_dataset  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    lm, eng = load_engine(a.model, max_rows=a.rows)
    eng.cache = None
    tok = lm.tokenizer
    stops = chat.stop_token_ids(tok, lm.model)
    items = load_dataset("gsm8k", limit=a.items).items
    prompts = [chat.tokenize_rendered(tok, chat.render(tok, [{"role": "user", "content": it.prompt}],
                                                       add_generation_prompt=True))[0] for it in items]
    res: dict = {"cpu": cpu_name(), "threads": cpu_threads(), "model": a.model, "items": len(prompts),
                 "rows": a.rows, "max_new": a.max_new}
    out = {}
    for name, stream in (("grouped", False), ("continuous", True)):
        eng.stream = stream
        eng.multi(max(len(q) for q in prompts) + a.max_new).clear()
        t = time.perf_counter()
        gens = eng.decode_batch(prompts, stop_ids=stops, max_new_tokens=a.max_new, temperatures=0.0)
        sec = time.perf_counter() - t
        n = sum(len(g.token_ids) for g in gens)
        out[name] = [g.token_ids for g in gens]
        res[name] = {"seconds": round(sec, 1), "tokens": n, "tok_s": round(n / sec, 2),
                     "at_cap": sum(g.stop_reason == "max_tokens" for g in gens)}
        print(name, res[name], flush=True)
    res["same_tokens"] = out["grouped"] == out["continuous"]
    res["speedup"] = round(res["grouped"]["seconds"] / res["continuous"]["seconds"], 2)
    lens = sorted(len(t) for t in out["continuous"])
    res["answer_tokens_median_max"] = [lens[len(lens) // 2], lens[-1]]
    print(json.dumps(res))
    path = Path(a.out) if a.out else HERE / "results" / f"llamacpp_stream_{a.model}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
