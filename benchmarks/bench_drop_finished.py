"""Finished rows leaving the batch (``generate(drop_finished=True)``) vs decoding them to the end, same rows.

    MECHPROBE_THREADS=1 nice -n 10 python benchmarks/bench_drop_finished.py [MODEL]

User-turn rows as the probe builds them (per item 1 greedy + 3 samples at T=1, real end-of-turn stops, <= 48
tokens), bf16. Prints the seconds of each (best of 2, alternating) and checks that the tokens are equal.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import time  # noqa: E402

import torch  # noqa: E402

from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.generation import generate  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402

lm = load_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
tok = lm.tokenizer
QA = [("What is 17 * 23?", "17 * 23 = 391."), ("Why is the sky blue?", "Air scatters short blue wavelengths more than red ones."),
      ("How do I reverse a list in Python?", "Use my_list[::-1]."), ("What is the capital of Australia?", "Canberra.")]
ps = [chat.build_probe_prompt(tok, q, a).input_ids for q, a in QA]
rows, temps, seeds = [], [], []
for i, p in enumerate(ps):
    for j in range(4):
        rows.append(p)
        temps.append(0.0 if j == 0 else 1.0)
        seeds.append(None if j == 0 else 10 * i + j)
stops = chat.stop_token_ids(tok, lm.model)
res: dict[bool, float] = {}
outs: dict[bool, list] = {}
for rep in range(2):
    for drop in (False, True):
        t = time.time()
        g = generate(lm.model, rows, stop_ids=stops, max_new_tokens=48, temperatures=temps, seeds=seeds, pad_id=tok.pad_token_id, drop_finished=drop)
        d = time.time() - t
        res[drop] = min(d, res.get(drop, 1e9))
        outs[drop] = [x.token_ids for x in g]
        print(rep, "drop" if drop else "keep", round(d, 2), "lengths", sorted(len(x.token_ids) for x in g), flush=True)
print("same tokens:", outs[True] == outs[False])
print("speedup drop/keep", round(res[False] / res[True], 2), "threads", torch.get_num_threads())
