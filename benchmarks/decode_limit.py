"""How fast can this CPU decode at all? Memory bandwidth, bf16 matmul peak, and the HF bf16 decode rate as a
fraction of the limit they set, at several batch sizes. One run, idle machine.

``python benchmarks/decode_limit.py [--model qwen2.5-coder-1.5b-instruct] [--batch-sizes 1 8 32 64] [--dtype float32]``

Why: a decode step reads every weight once (bytes = the model's parameter bytes), whatever the batch, and
does 2 x params FLOPs per row. So tokens/s per step is bounded by ``bandwidth / weight_bytes`` rows-steps at
small batches and by ``matmul_peak / (2 x params)`` tokens at large ones:

    limit(B) = min(B * bandwidth / weight_bytes, matmul_peak / (2 * params))

Bandwidth: the best of a few copies of a 1 GiB tensor (bytes read + written / time). Peak: the best
``torch.matmul`` rate, in the decode dtype, of a [B x hidden] @ [hidden x intermediate] product (the model's MLP
shape) at B = 64 and 512. The decode dtype defaults to bf16 where the CPU has native bf16 and fp32 elsewhere
(emulated bf16 is ~100x slower, docs/gotchas.md).
Measured: mechprobe's greedy decode (``mechprobe.lm.generation.generate``), fixed new tokens, short prompts.

``--engine llamacpp`` measures the llama.cpp engine instead (rows decoded together, one KV stream each, the
GGUF's quantised weights): weight bytes are the GGUF file's, and the compute bound is llama.cpp's own
prefill rate on one 512-token prompt (its quantised matmuls at full width; torch's fp32/bf16 peak does not
apply to them), so ``limit(B) = min(B * bandwidth / gguf_bytes, prefill tokens/s)``.
Writes ``benchmarks/results/decode_limit_<model>[_llamacpp].json``; the CPU model is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.device import cpu_has_native_bf16, cpu_threads  # noqa: E402
from mechprobe.lm.generation import generate  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    n = int(gib * 2**30 // 4)
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def matmul_gflops(m: int, k: int, n: int, reps: int = 5, dtype: torch.dtype = torch.bfloat16) -> float:
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(k, n, dtype=dtype)
    torch.matmul(x, w)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def decode_rate(lm, batch: int, new_tokens: int) -> float:
    tok = lm.tokenizer
    qs = ["What is 17 * 23?", "Why is the sky blue?", "Write a haiku about autumn.", "How do I sort a list?"]
    prompts = [chat.tokenize_rendered(tok, chat.render(tok, [{"role": "user", "content": qs[i % len(qs)]}],
                                                       add_generation_prompt=True))[0] for i in range(batch)]
    generate(lm.model, prompts[:1], stop_ids={}, max_new_tokens=2, pad_id=tok.pad_token_id)  # warm-up
    t0 = time.perf_counter()
    generate(lm.model, prompts, stop_ids={}, max_new_tokens=1, pad_id=tok.pad_token_id)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(lm.model, prompts, stop_ids={}, max_new_tokens=new_tokens + 1, pad_id=tok.pad_token_id)
    total = time.perf_counter() - t0
    return batch * new_tokens / max(total - prefill, 1e-9)


def llamacpp_limit(model: str, batch_sizes: list[int], new_tokens: int, bw: float) -> dict:
    """Decode rate of the llama.cpp engine per batch size, against its bandwidth and prefill bounds."""
    from mechprobe.lm.llamacpp import load_engine, resolve_gguf

    lm_tok, eng = load_engine(model)
    tok = lm_tok.tokenizer
    eng.cache = None  # every call prefills: the timings below subtract a prefill-only call
    gguf = resolve_gguf(model)[0]
    gbytes = Path(gguf).stat().st_size
    qs = ["What is 17 * 23?", "Why is the sky blue?", "Write a haiku about autumn.", "How do I sort a list?"]

    def prompts(b: int) -> list[list[int]]:  # distinct prompts (a suffix), so no row shares another's prefill
        return [chat.tokenize_rendered(tok, chat.render(tok, [{"role": "user", "content": f"{qs[i % 4]} ({i})"}],
                                                        add_generation_prompt=True))[0] for i in range(b)]

    def timed(ps: list[list[int]], n: int) -> float:
        eng.multi(max(len(p) for p in ps) + new_tokens + 2).clear()
        t0 = time.perf_counter()
        eng.decode_batch(ps, stop_ids={}, max_new_tokens=n)
        return time.perf_counter() - t0

    long = (prompts(1)[0] * 64)[:512]
    timed([long[:16]], 1)  # warm-up
    peak_tok_s = len(long) / timed([long], 1)
    rows = []
    for b in batch_sizes:
        ps = prompts(b)
        got = b * new_tokens / max(timed(ps, new_tokens + 1) - timed(ps, 1), 1e-9)
        bw_bound = b * bw * 1e9 / gbytes
        limit = min(bw_bound, peak_tok_s)
        rows.append({"batch": b, "tok_s": round(got, 2), "limit_tok_s": round(limit, 2),
                     "fraction": round(got / limit, 3), "bound": "bandwidth" if bw_bound < peak_tok_s else "compute"})
        print(f"llama.cpp batch {b}: {got:.1f} tok/s, limit {limit:.1f} ({rows[-1]['bound']}), {got / limit:.0%}",
              flush=True)
    import llama_cpp  # type: ignore[import-not-found]

    return {"engine": "llamacpp", "llama_cpp_python": llama_cpp.__version__, "gguf": Path(gguf).name,
            "gguf_bytes": gbytes, "prefill_tok_s_512": round(peak_tok_s, 1), "max_rows": eng.max_rows, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="decode dtype (default: bfloat16 where the CPU has native bf16, else float32)")
    p.add_argument("--peak-rows", type=int, nargs="+", default=[64, 512])
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/decode_limit_<model>.json)")
    p.add_argument("--engine", choices=["hf", "llamacpp"], default="hf",
                   help="hf: mechprobe's torch decode (default); llamacpp: the llama.cpp engine over the GGUF")
    args = p.parse_args()
    torch.set_num_threads(cpu_threads())
    if args.engine == "llamacpp":
        bw = bandwidth_gbs(args.bandwidth_gib)
        res = {"cpu": cpu_name(), "threads": cpu_threads(), "model": args.model, "bandwidth_gb_s": round(bw, 2),
               "new_tokens": args.new_tokens} | llamacpp_limit(args.model, args.batch_sizes, args.new_tokens, bw)
        path = Path(args.out) if args.out else OUT / f"decode_limit_{args.model}_llamacpp.json"
        path.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
        return
    dtype = getattr(torch, args.dtype or ("bfloat16" if cpu_has_native_bf16() else "float32"))
    bw = bandwidth_gbs(args.bandwidth_gib)
    lm = load_model(args.model, device="cpu", dtype=dtype)
    hidden, inter = lm.model.config.hidden_size, lm.model.config.intermediate_size
    peak = max(matmul_gflops(m, hidden, inter, dtype=dtype) for m in args.peak_rows)
    params = sum(p.numel() for p in lm.model.parameters())
    wbytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    rows = []
    for b in args.batch_sizes:
        got = decode_rate(lm, b, args.new_tokens)
        limit = min(b * bw * 1e9 / wbytes, peak * 1e9 / (2 * params))
        rows.append({"batch": b, "tok_s": round(got, 2), "limit_tok_s": round(limit, 2),
                     "fraction": round(got / limit, 3),
                     "bound": "bandwidth" if b * bw * 1e9 / wbytes < peak * 1e9 / (2 * params) else "compute"})
        print(f"batch {b}: {got:.1f} tok/s, limit {limit:.1f} ({rows[-1]['bound']}), {got / limit:.0%}", flush=True)
    res = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
           "params": params, "weight_bytes": wbytes, "bandwidth_gb_s": round(bw, 2),
           "dtype": str(dtype).removeprefix("torch."), "matmul_gflop_s": round(peak, 1), "new_tokens": args.new_tokens, "rows": rows}
    path = Path(args.out) if args.out else OUT / f"decode_limit_{args.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


if __name__ == "__main__":
    main()
