"""Does a llama.cpp row decode the same tokens in a batch as alone, on this CPU? Greedy GSM8K answers, one run.

    python benchmarks/llamacpp_batch_invariance.py --model qwen2.5-coder-1.5b-instruct --items 8 --new 48

Decodes ``--items`` answer prompts together (one KV stream per row, as the engine always does), then each alone
(padded to two rows, as the engine does), prompt-state cache off, and reports the rows whose tokens differ and the
first differing position. The engine's tests check this on the 135M model; ggml's kernels and hence the answer
depend on the CPU and the model (see docs/gotchas.md). Writes ``results/llamacpp_invariance_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.decode_limit import cpu_name  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.device import cpu_threads  # noqa: E402
from mechprobe.lm.llamacpp import load_engine  # noqa: E402
from mechprobe.turns.datasets import load_dataset  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, eng = load_engine(a.model)
    eng.cache = None
    tok = lm.tokenizer
    stops = chat.stop_token_ids(tok, lm.model)
    prompts = [chat.tokenize_rendered(tok, chat.render(tok, [{"role": "user", "content": it.prompt}],
                                                       add_generation_prompt=True))[0]
               for it in load_dataset("gsm8k", limit=a.items).items]
    together = eng.decode_batch(prompts, stop_ids=stops, max_new_tokens=a.new, temperatures=0.0)
    rows = []
    for i, prompt in enumerate(prompts):
        eng.multi().clear()
        alone = eng.decode_batch([prompt], stop_ids=stops, max_new_tokens=a.new, temperatures=0.0)[0].token_ids
        both = together[i].token_ids
        k = next((j for j in range(min(len(alone), len(both))) if alone[j] != both[j]), None)
        rows.append({"row": i, "same": alone == both, "first_difference": k})
    res = {"cpu": cpu_name(), "threads": cpu_threads(), "model": a.model, "items": len(prompts), "new": a.new,
           "rows_differing": sum(not r["same"] for r in rows), "rows": rows}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), [r["first_difference"] for r in rows])
    path = Path(a.out) if a.out else HERE / "results" / f"llamacpp_invariance_{a.model}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
