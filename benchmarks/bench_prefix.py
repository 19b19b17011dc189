"""Reusing the conversation's KV cache: the probe's stages and a steering arm, before/after, in one process.

    nice -n 10 python benchmarks/bench_prefix.py --model qwen2.5-coder-0.5b-instruct --dtype bfloat16 \
        --dataset ifeval --items 16 --max-assistant-tokens 384 --max-user-tokens 64

1. **Probe** (``run_probe`` on the same items, same loaded model): *before* = every user turn prefills
   [query, answer, user header] again (``continue_from_answer=False``); *after* = each answer batch's user turns
   continue from that batch's KV cache (the default). Seconds per stage from the runs' manifests, ratio
   after / before. ``--one-answer-stage`` generates the answers once (the after run) and runs the before user
   stage on a copy of them, charging it the same assistant seconds. Greedy user turns identical between the two (bf16: a share; fp32: all expected).
2. **Numerics** of the rows that differ: at each differing greedy turn's first differing token, the plain
   run's logit gap between its token and the reused run's token (a near tie flips on rounding); and the
   relative difference of the final-layer boundary state, reused vs plain prefill, next to the same
   quantity for the plain prefill batched vs alone (what batching alone changes).
3. **Steering arm** over the after run's fixed conversations: one greedy user turn per conversation with a
   random vector at the middle layer (``positions="boundary+generated"``), without the store (every prompt
   prefilled whole) vs with a :class:`~mechprobe.lm.prefix.PrefixStore` built once (build time reported
   apart: every later arm reuses it). ``--arm-copies K`` renders each conversation K times with K different
   system prompts (K x items distinct conversations, same answers), to reach the study's 120 conversations
   without generating more answers.

Writes ``benchmarks/results/prefix_<model>_<dtype>.json`` and prints the markdown table
(model, stage, before, after, ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mechprobe.io import read_json, read_jsonl  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.generation import auto_batch_size, batches_by_length, generate  # noqa: E402
from mechprobe.lm.kv import call_kind  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402
from mechprobe.lm.prefix import PrefixStore  # noqa: E402
from mechprobe.steering.vector import SteeringVector, steer  # noqa: E402
from mechprobe.turns.pipeline import ProbeConfig, run_probe  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{os.cpu_count()}-core {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def probe(lm, a, out: Path, reuse: bool) -> dict:
    cfg = ProbeConfig(model=a.model, dataset=a.dataset, limit=a.items,
                      temperatures=[0.0, 1.0] if a.samples else [0.0], samples=a.samples,
                      max_assistant_tokens=a.max_assistant_tokens, max_user_tokens=a.max_user_tokens,
                      dtype=a.dtype, batch_size=a.batch_size)
    load0 = load_avg()
    t = time.perf_counter()
    run_probe(cfg, out, lm=lm, progress=False, continue_from_answer=reuse)
    wall = time.perf_counter() - t
    timing = read_json(out / "manifest.json")["timing"]
    return {"assistant_s": timing["assistant_seconds"], "user_s": timing["user_seconds"], "probe_s": round(wall, 2),
            "user_rows": timing["user_rows"], "load_start": load0, "load_end": load_avg()}


def greedy(run: Path) -> dict[str, dict]:
    return {r["item_id"]: r for r in read_jsonl(run / "user_turns.jsonl") if r["decoding"] == "greedy"}


@torch.inference_mode()
def logit_gap(lm, prompt: list[int], common: list[int], mine: int, other: int) -> float:
    """Plain-prefill logit of the plain run's token minus the reused run's token at the first difference."""
    logits = lm.model(input_ids=torch.tensor([prompt + common])).logits[0, -1].float()
    return float(logits[mine] - logits[other])


@torch.inference_mode()
def boundary_states(lm, prompts: list[list[int]], store: PrefixStore | None) -> list[torch.Tensor]:
    """Final-layer residual at the boundary of each prompt, batched, with or without the store."""
    got: list[torch.Tensor] = []
    norm = lm.model.model.norm

    def hook(_m, inp, _out):
        if not got and call_kind() != "prefix":  # the boundary call, not a prefix computed for the store
            got.append(inp[0][:, -1].float().clone())
    h = norm.register_forward_hook(hook)
    try:
        generate(lm.model, prompts, stop_ids={}, max_new_tokens=1, pad_id=lm.tokenizer.pad_token_id,
                 prefix_store=store)
    finally:
        h.remove()
    return list(got[0])


def numerics(lm, before: Path, after: Path, store: PrefixStore) -> dict:
    b, r = greedy(before), greedy(after)
    same = [k for k in b if k in r and b[k]["generated_ids"] == r[k]["generated_ids"]]
    gaps = []
    for k in b:
        if k not in r or k in same:
            continue
        x, y = b[k]["generated_ids"], r[k]["generated_ids"]
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        if n < min(len(x), len(y)):
            gaps.append(round(logit_gap(lm, b[k]["prompt_ids"], x[:n], x[n], y[n]), 4))
    prompts = [b[k]["prompt_ids"] for k in sorted(b)]
    plain = boundary_states(lm, prompts, None)
    reused = boundary_states(lm, prompts, store)
    alone = [boundary_states(lm, [p], None)[0] for p in prompts]

    def rel(u, v):
        return float((u - v).norm() / v.norm())
    return {"greedy_turns": len(b), "identical": len(same), "first_diff_logit_gaps": gaps,
            "boundary_rel_diff_reused_vs_plain": [round(rel(u, v), 5) for u, v in zip(reused, plain)],
            "boundary_rel_diff_batched_vs_alone": [round(rel(u, v), 5) for u, v in zip(plain, alone)]}


def steering_arm(lm, run: Path, a) -> dict:
    answers = read_jsonl(run / "assistant.jsonl")
    tok = lm.tokenizer
    rows = [r["prompt_ids"] for r in sorted(greedy(run).values(), key=lambda r: r["item_id"])]
    for k in range(1, a.arm_copies):  # the same answers under another system prompt: distinct conversations
        rows += [chat.build_probe_prompt(tok, r["prompt"], r["response"], history=r.get("messages") or None,
                                         system=f"You are a helpful assistant (conversation copy {k}).").input_ids
                 for r in answers]
    vec = SteeringVector(torch.randn(lm.d_model, generator=torch.Generator().manual_seed(0)), layer=lm.n_layers // 2)
    alpha = a.alpha / float(vec.vector.norm())  # a push of `alpha` in raw residual units
    stops = chat.stop_token_ids(lm.tokenizer, lm.model)
    pad = lm.tokenizer.pad_token_id
    n_rows = a.batch_size or auto_batch_size(lm.model, max(len(p) for p in rows), a.max_user_tokens)

    def arm(store):
        out = []
        t = time.perf_counter()
        with steer(lm.model, vec, alpha=alpha, positions="boundary+generated", unit="raw"):
            for batch in batches_by_length([len(p) for p in rows], n_rows):
                gens = generate(lm.model, [rows[i] for i in batch], stop_ids=stops, max_new_tokens=a.max_user_tokens,
                                pad_id=pad, prefix_store=store)
                out += [(i, g.token_ids) for i, g in zip(batch, gens)]
        return time.perf_counter() - t, dict(out)

    res = {"conversations": len(rows), "mean_prompt_tokens": round(sum(map(len, rows)) / len(rows), 1),
           "rows_per_call": n_rows, "load_start": load_avg()}
    res["without_store_s"], plain = arm(None)
    store = PrefixStore(lm, disk_dir=None)
    t = time.perf_counter()
    store.build(rows, pad_id=pad)
    res["store_build_s"] = time.perf_counter() - t
    res["store_bytes"] = store.nbytes
    res["with_store_s"], reused = arm(store)
    res["identical_turns"] = sum(plain[i] == reused[i] for i in plain)
    res["load_end"] = load_avg()
    store.close()
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dataset", default="ifeval")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--samples", type=int, default=0, help="sampled user turns per item at T=1 (0: greedy only)")
    ap.add_argument("--max-assistant-tokens", type=int, default=384)
    ap.add_argument("--max-user-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=None, help="rows per decode call (default: auto)")
    ap.add_argument("--arm-copies", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=8.0, help="norm of the added vector, raw residual units")
    ap.add_argument("--skip-arm", action="store_true")
    ap.add_argument("--one-answer-stage", action="store_true",
                    help="generate the answers once (the after run) and give 'before' the same answers and assistant "
                         "seconds: saves one assistant stage on a slow machine; 'before' then differs only in its "
                         "user stage")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lm = load_model(a.model, dtype=a.dtype)
    res: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "model": a.model, "dtype": a.dtype,
                 "args": vars(a)}
    with tempfile.TemporaryDirectory() as tmp:
        before, after = Path(tmp) / "before", Path(tmp) / "after"
        if a.one_answer_stage:  # the answers once (with their KV kept), then the plain user stage on a copy of them
            res["after"] = probe(lm, a, after, reuse=True)
            before.mkdir()
            shutil.copy(after / "assistant.jsonl", before / "assistant.jsonl")
            res["before"] = probe(lm, a, before, reuse=False)
            res["before"]["assistant_s"] = res["after"]["assistant_s"]
            res["before"]["probe_s"] = round(res["before"]["probe_s"] + res["after"]["assistant_s"], 2)
        else:
            res["before"] = probe(lm, a, before, reuse=False)
            res["after"] = probe(lm, a, after, reuse=True)
        res["assistant_identical"] = (read_jsonl(before / "assistant.jsonl") == read_jsonl(after / "assistant.jsonl"))
        store = PrefixStore(lm, progress=False)
        res["numerics"] = numerics(lm, before, after, store)
        store.close()
        if not a.skip_arm:
            res["arm"] = steering_arm(lm, after, a)
    b, r = res["before"], res["after"]
    print(f"\n{res['cpu']}, {res['threads']} threads, {a.model} {a.dtype}, {a.items} {a.dataset} items, "
          f"answers <= {a.max_assistant_tokens}, user turns <= {a.max_user_tokens} (1 greedy + {a.samples} samples)\n")
    print("| model | stage | before s | after s | ratio |\n|---|---|---|---|---|")
    for stage, kb in (("assistant turns", "assistant_s"), ("user turns", "user_s"), ("whole probe", "probe_s")):
        print(f"| {a.model} | {stage} | {b[kb]:.1f} | {r[kb]:.1f} | {r[kb] / b[kb]:.2f}x |")
    if "arm" in res:
        m = res["arm"]
        print(f"| {a.model} | steering arm, {m['conversations']} conversations | {m['without_store_s']:.1f} | "
              f"{m['with_store_s']:.1f} | {m['with_store_s'] / m['without_store_s']:.2f}x |")
        print(f"\nprefix store built once in {m['store_build_s']:.1f} s ({m['store_bytes'] / 2**20:.0f} MiB); "
              f"identical steered turns {m['identical_turns']}/{m['conversations']}")
    n = res["numerics"]
    print(f"greedy user turns identical before/after: {n['identical']}/{n['greedy_turns']}; logit gaps at the first "
          f"difference: {n['first_diff_logit_gaps']}")
    out = Path(a.out) if a.out else HERE / "results" / f"prefix_{Path(a.model).name}_{a.dtype}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
