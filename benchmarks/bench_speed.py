"""Generation stages before/after: tokens/s per stage, peak memory, per option, in one run.

    nice -n 10 python benchmarks/bench_speed.py --models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct \
        --configs hf-fp32 hf-bf16 llamacpp --items 4 --samples 2

Every (model, option) runs the probe's real assistant and user stages (``mechprobe.turns.pipeline``) on the same
GSM8K items in a *fresh process*, so its peak RSS is its own. Options:

* ``hf-fp32``: the HF engine in float32 (list it first: the first option is the baseline of every ratio);
* ``hf-bf16``: the HF engine with ``--dtype bfloat16`` (this CPU has AVX512-BF16);
* ``llamacpp``: ``--engine llamacpp`` over the same GGUF (needs ``llama-cpp-python``);
* a suffix ``@N`` sets the batch size (``hf-bf16@16``); for ``llamacpp`` the rows decoded together
  (``llamacpp@1`` = one row at a time, the engine before multi-row decoding); ``@auto`` = ``--batch-size auto``
  (rows chosen from free memory; the JSON's ``batch`` lists the rows picked per stage); the default is ``--batch-size``;
* a suffix ``:tN`` sets the threads (``hf-fp32:t1``); default: :func:`mechprobe.lm.device.cpu_threads`
  (the idle cores, or ``$MECHPROBE_THREADS``) for both engines.

Also, per model (``--parity``, fp32 and bf16 both in memory, so keep it to models <= 0.5B on a shared
machine): the relative error of bf16 boundary activations against fp32 at every residual index, and how
many greedy assistant turns of each option equal the fp32 HF turn token for token (and the mean length of
the common prefix). Writes ``benchmarks/results/speed.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _child(model: str, option: str, out: str, a: argparse.Namespace) -> dict:
    """Run the probe's two stages with one option; return timings and token counts."""
    import torch

    from mechprobe.io import read_jsonl
    from mechprobe.records import AssistantRecord
    from mechprobe.turns import pipeline

    name, _, threads = option.partition(":t")
    name, _, bs = name.partition("@")
    batch = None if bs == "auto" else int(bs) if bs else a.batch_size
    chosen: list[int] = []  # rows per decode call that --batch-size auto picked, per stage

    class _Rows(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            if rec.getMessage().startswith("--batch-size auto"):
                chosen.append(int(rec.args[0]))

    logging.getLogger("mechprobe.turns.pipeline").addHandler(_Rows())
    logging.getLogger("mechprobe.turns.pipeline").setLevel(logging.INFO)
    if threads:
        torch.set_num_threads(int(threads))
        os.environ["MECHPROBE_THREADS"] = threads
    engine = "llamacpp" if name == "llamacpp" else "hf"
    dtype = {"hf-fp32": "float32", "hf-bf16": "bfloat16", "llamacpp": None}[name]
    cfg = pipeline.ProbeConfig(model=model, dataset=a.dataset, limit=a.items, temperatures=[0.0, 1.0],
                               samples=a.samples, max_assistant_tokens=a.max_assistant_tokens,
                               max_user_tokens=a.max_user_tokens, batch_size=batch, dtype=dtype, engine=engine)
    n_threads = None
    t0 = time.perf_counter()
    if engine == "llamacpp":
        from mechprobe.lm.llamacpp import load_engine

        lm, eng = load_engine(model, **({"max_rows": batch} if batch else {}))
        n_threads = eng.llm.n_threads if hasattr(eng.llm, "n_threads") else None
    else:
        from mechprobe.lm.models import load_model

        lm, eng = load_model(model, dtype=dtype), None
    load_s = time.perf_counter() - t0
    items, _ = pipeline.load_items(cfg)
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    from mechprobe.io import JsonlStore

    skipped = JsonlStore(outp / "skipped_rows.jsonl", key="item_id")
    t = time.perf_counter()
    pipeline._assistant_stage(cfg, lm, pipeline._assistant_jobs(cfg, lm, items, outp), outp, False, eng, skipped)
    a_s = time.perf_counter() - t
    t = time.perf_counter()
    pipeline._user_stage(cfg, lm, {it.item_id for it in items}, pipeline.decoding_plan(cfg.temperatures, cfg.samples),
                         outp, False, eng, skipped)
    u_s = time.perf_counter() - t
    asst = [AssistantRecord.from_dict(r) for r in read_jsonl(outp / pipeline.ASSISTANT)]
    users = list(read_jsonl(outp / pipeline.USER_TURNS))
    a_tok = sum(r.n_tokens for r in asst)
    u_tok = sum(len(r["generated_ids"]) for r in users)
    return {"model": model, "option": option, "batch": batch if batch else "auto" + (f" {chosen}" if chosen else ""),
            "threads": n_threads if engine == "llamacpp" else torch.get_num_threads(), "loadavg": os.getloadavg()[0],
            "load_s": load_s, "assistant_s": a_s, "user_s": u_s, "assistant_tokens": a_tok, "user_tokens": u_tok,
            "assistant_tok_s": a_tok / a_s, "user_tok_s": u_tok / u_s, "total_tok_s": (a_tok + u_tok) / (a_s + u_s),
            "assistant_hit_cap": sum(r.stop_reason == "max_tokens" for r in asst), "n_items": len(asst),
            "n_user_turns": len(users), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _parity(model: str, runs: dict[str, str]) -> dict:
    """bf16 vs fp32 boundary activations on the fp32 run's probe prompts; greedy agreement of every option."""
    import torch

    from mechprobe.activations.backends import capture
    from mechprobe.io import read_jsonl
    from mechprobe.lm.models import load_model

    base = next(d for k, d in runs.items() if k.startswith("hf-fp32"))
    recs = [r for r in read_jsonl(Path(base) / "user_turns.jsonl") if r["decoding"] == "greedy"]
    lm = load_model(model, dtype="float32")
    layers = list(range(lm.n_layers + 1))
    prompts = [r["prompt_ids"] for r in recs]
    pos = [{"boundary": r["boundary_index"], "span": (0, 1)} for r in recs]

    def acts() -> torch.Tensor:
        out = [capture(lm.model, [p], [q], ["boundary"], layers, backend="hooks")["boundary"].float()
               for p, q in zip(prompts, pos)]
        return torch.cat(out)  # [rows, layers, d]

    a32 = acts()
    lm.model.to(torch.bfloat16)
    a16 = acts()
    rel = (a16 - a32).norm(dim=-1) / a32.norm(dim=-1).clamp_min(1e-12)  # [rows, layers]
    cos = torch.nn.functional.cosine_similarity(a16, a32, dim=-1)
    ref = {r["item_id"]: r["response"] for r in read_jsonl(Path(base) / "assistant.jsonl")}
    ref_ids = {r["item_id"]: r for r in read_jsonl(Path(base) / "user_turns.jsonl") if r["decoding"] == "greedy"}
    agree = {}
    tok = lm.tokenizer
    for opt, d in runs.items():
        other = {r["item_id"]: r["response"] for r in read_jsonl(Path(d) / "assistant.jsonl")}
        same = sum(other.get(k) == v for k, v in ref.items())
        prefix = []
        for k, v in ref.items():
            x, y = tok(v)["input_ids"], tok(other.get(k, ""))["input_ids"]
            n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            prefix.append(n)
        ug = {r["item_id"]: r for r in read_jsonl(Path(d) / "user_turns.jsonl") if r["decoding"] == "greedy"}
        same_u = sum(ug.get(k, {}).get("generated_ids") == v["generated_ids"] for k, v in ref_ids.items()
                     if ug.get(k, {}).get("prompt_ids") == v["prompt_ids"])
        same_prompt = sum(ug.get(k, {}).get("prompt_ids") == v["prompt_ids"] for k, v in ref_ids.items())
        agree[opt] = {"assistant_identical": same, "n": len(ref), "mean_common_prefix_tokens": sum(prefix) / len(prefix),
                      "greedy_user_identical_where_prompt_identical": f"{same_u}/{same_prompt}"}
    return {"bf16_rel_err_max": rel.max().item(), "bf16_rel_err_median": rel.median().item(),
            "bf16_rel_err_max_by_layer": [round(x, 5) for x in rel.max(0).values.tolist()],
            "bf16_cos_min": cos.min().item(), "n_rows": len(prompts), "greedy_agreement_vs_hf_fp32": agree}


def _prefill(model: str, a: argparse.Namespace) -> dict:
    """Prefill of probe-sized prompts, LM head on every position vs the last only (HF slice, and with compact strides)."""
    import torch

    from mechprobe.lm import chat
    from mechprobe.lm.generation import left_pad
    from mechprobe.lm.models import load_model
    from mechprobe.turns import pipeline

    lm = load_model(model, dtype="bfloat16")
    cfg = pipeline.ProbeConfig(model=model, dataset=a.dataset, limit=a.items)
    items, _ = pipeline.load_items(cfg)
    answer = " ".join(["Step: multiply the numbers, then add the remainder to get the total."] * 12)
    prompts = [chat.build_probe_prompt(lm.tokenizer, it.prompt, answer).input_ids for it in items]
    ids, mask, pos = left_pad(prompts, lm.tokenizer.pad_token_id, lm.device)
    out: dict = {"model": model, "rows": len(prompts), "prompt_tokens": int(mask.sum()), "threads": torch.get_num_threads()}
    from mechprobe.lm.forward import compact_lm_head_input

    with torch.inference_mode():
        for keep, compact in [(0, False), (1, False), (1, True)] * 3:
            t = time.perf_counter()
            with compact_lm_head_input(lm.model) if compact else contextlib.nullcontext():
                logits = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep).logits
            dt = time.perf_counter() - t
            key = "all_positions" if keep == 0 else "last_position_compact" if compact else "last_position"
            out[key + "_s"] = min(dt, out.get(key + "_s", float("inf")))
            out[key + "_logits_mb"] = logits.numel() * logits.element_size() / 2**20
    out["speedup"] = out["all_positions_s"] / out["last_position_s"]
    out["speedup_compact"] = out["all_positions_s"] / out["last_position_compact_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    p.add_argument("--configs", nargs="+", default=["hf-fp32", "hf-bf16", "llamacpp"])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-assistant-tokens", type=int, default=64)
    p.add_argument("--max-user-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--parity", action="store_true", help="bf16 activation error and greedy agreement (loads fp32)")
    p.add_argument("--out", default=str(HERE / "results" / "speed.json"))
    p.add_argument("--child", nargs=3, metavar=("MODEL", "OPTION", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--parity-child", nargs=2, metavar=("MODEL", "RUNS_JSON"), help=argparse.SUPPRESS)
    p.add_argument("--prefill", action="store_true", help="only time prefill: LM head on all vs last position")
    a = p.parse_args()
    if a.prefill:
        for m in a.models:
            print(json.dumps(_prefill(m, a)))
        return 0
    if a.child:
        print("RESULT " + json.dumps(_child(*a.child, a)))
        return 0
    if a.parity_child:
        print("RESULT " + json.dumps(_parity(a.parity_child[0], json.loads(a.parity_child[1]))))
        return 0

    fwd = ["--dataset", a.dataset, "--items", str(a.items), "--samples", str(a.samples), "--max-assistant-tokens",
           str(a.max_assistant_tokens), "--max-user-tokens", str(a.max_user_tokens), "--batch-size", str(a.batch_size)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}

    def sub(args: list[str]) -> dict:
        r = subprocess.run([sys.executable, __file__, *args, *fwd], capture_output=True, text=True, env=env)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            return {"error": (r.stderr or r.stdout)[-600:]}
        return json.loads(line[-1][7:])

    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "settings": vars(a) | {"child": None},
                     "loadavg_start": os.getloadavg(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m in a.models:
            rows, runs = {}, {}
            for opt in a.configs:
                d = str(Path(tmp) / f"{Path(m).name.removesuffix('.gguf')}-{opt}")
                rows[opt] = sub(["--child", m, opt, d])
                if "error" not in rows[opt]:
                    runs[opt] = d
                print(f"{m} {opt}: {json.dumps(rows[opt])}", file=sys.stderr, flush=True)
            base = rows.get(a.configs[0], {})  # the first option is the baseline of every ratio
            for r in rows.values():
                if "error" in r or "error" in base or not base:
                    continue
                for k in ("assistant_tok_s", "user_tok_s", "total_tok_s"):
                    r[k.replace("tok_s", "ratio")] = r[k] / base[k]
            entry = {"options": rows}
            if a.parity and any(k.startswith("hf-fp32") for k in runs):
                entry["parity"] = sub(["--parity-child", m, json.dumps(runs)])
            results["models"][m] = entry
    results["loadavg_end"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2))

    print(f"load average at start {results['loadavg_start'][0]:.1f}, at end {results['loadavg_end'][0]:.1f} "
          f"(2 cores; other jobs shared the CPU)\n")
    print(f"| model | option | threads | batch | assistant tok/s | user tok/s | all tok/s | ratio to {a.configs[0]} (all) "
          "| peak RSS MB | load s | assistant turns at cap |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for m, e in results["models"].items():
        for opt, r in e["options"].items():
            if "error" in r:
                print(f"| {Path(m).name.removesuffix('.gguf')} | {opt} | failed: {r['error'][-120:]!r} |")
                continue
            ratio = f"{r['total_ratio']:.2f}x" if "total_ratio" in r else "-"
            print(f"| {Path(m).name.removesuffix('.gguf')} | {opt} | {r['threads']} | {r['batch']} | {r['assistant_tok_s']:.1f} | {r['user_tok_s']:.1f} | "
                  f"{r['total_tok_s']:.1f} | {ratio} | {r['peak_rss_mb']:.0f} | {r['load_s']:.1f} | "
                  f"{r['assistant_hit_cap']}/{r['n_items']} |")
    for m, e in results["models"].items():
        if "parity" in e:
            print(f"\n{Path(m).name.removesuffix('.gguf')} parity: {json.dumps(e['parity'])}")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
