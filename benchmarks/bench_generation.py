"""Generation throughput: mechprobe's decode loop vs raw HF ``generate``, same prompts, one run.

``python benchmarks/bench_generation.py [--model NAME] [--device cuda] [--batch-sizes 1 8]``

Greedy, fixed number of new tokens (no early stop) so both sides decode the same amount of work.
Prints generated tokens/s and the ratio ours/HF, and writes ``benchmarks/results/generation.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mechprobe.lm import chat
from mechprobe.lm.generation import generate, input_device, left_pad
from mechprobe.lm.models import load_model

QUESTIONS = [
    "What is 17 * 23?", "Explain photosynthesis in two sentences.", "Give me three tips for a job interview.",
    "How do I reverse a list in Python?", "Why is the sky blue?", "Write a haiku about autumn.",
    "What is the capital of Australia?", "How many minutes are in a week?",
] * 4


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def bench(lm, prompts, batch_size: int, new_tokens: int, reps: int) -> dict:
    tok, model = lm.tokenizer, lm.model
    dev = input_device(model)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    out = {}
    for name in ("hf_generate", "mechprobe"):
        best = float("inf")
        for _ in range(reps):
            _sync(dev)
            t = time.perf_counter()
            for b in batches:
                if name == "mechprobe":
                    generate(model, b, stop_ids={}, max_new_tokens=new_tokens, pad_id=tok.pad_token_id)
                else:
                    ids, mask, _ = left_pad(b, tok.pad_token_id, dev)
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            _sync(dev)
            best = min(best, time.perf_counter() - t)
        out[name] = len(prompts) * new_tokens / best
    out["ratio_mechprobe_over_hf"] = out["mechprobe"] / out["hf_generate"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "generation.json"))
    a = p.parse_args()
    lm = load_model(a.model, device=a.device)
    prompts = [chat.build_assistant_prompt(lm.tokenizer, q) for q in QUESTIONS[: a.n_prompts]]
    rows = {}
    print(f"model={lm.name} device={lm.device} dtype={lm.dtype} prompts={len(prompts)} new_tokens={a.new_tokens}")
    print("| batch | HF generate tok/s | mechprobe tok/s | ratio |\n|---|---|---|---|")
    for bs in a.batch_sizes:
        r = bench(lm, prompts, bs, a.new_tokens, a.reps)
        rows[bs] = r
        print(f"| {bs} | {r['hf_generate']:.1f} | {r['mechprobe']:.1f} | {r['ratio_mechprobe_over_hf']:.2f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype),
                                       "new_tokens": a.new_tokens, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
