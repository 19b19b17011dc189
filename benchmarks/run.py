"""One command for the speed and memory story, measured in one run against raw HF baselines.

    python benchmarks/run.py [--model smollm2-135m-instruct] [--quick]

Prints markdown tables and writes ``benchmarks/results/run_<device>.json`` so later runs can be compared:

1. boundary caching (all layers) tokens/s per backend vs a raw HF forward over the same padded batches
   (ratio = backend / raw; the hooks backend stops after the last needed block, so it can beat 1.0);
2. steered greedy generation (mechprobe loop + steering hook) vs raw HF ``generate`` (time ratio);
3. offline judge throughput (turns/s);
4. end-to-end wall time of a small default pipeline per stage;
5. peak RSS of ``cache_run`` in a fresh process at N and 4N records (flat = streaming works);
6. before/after of the user-turn stage (the pipeline's biggest cost): batches in item order vs sorted by
   length, and separate vs shared prefill of the greedy row and k samples of one item (same tokens out);
7. model load: GGUF dequantisation vs the converted safetensors snapshot (fresh processes; skipped by --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mechprobe.activations.backends import capture  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.generation import generate, input_device, left_pad  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402
from mechprobe.steering.vector import SteeringVector, steer  # noqa: E402

QA = [("What is 17 * 23?", "17 * 23 = 391."),
      ("Explain photosynthesis briefly.", "Plants turn light, water and CO2 into sugar and oxygen."),
      ("Give me three tips for a job interview.", "Research the company, practise answers, and arrive early."),
      ("How do I reverse a list in Python?", "Use my_list[::-1] or my_list.reverse() to reverse in place."),
      ("Why is the sky blue?", "Air scatters short blue wavelengths of sunlight more than red ones."),
      ("Write a haiku about autumn.", "Red leaves drift and fall / the cold wind hums through bare trees / the year exhales slow"),
      ("What is the capital of Australia?", "The capital of Australia is Canberra."),
      ("How many minutes are in a week?", "There are 7 * 24 * 60 = 10,080 minutes in a week.")]


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def bench_caching(lm, prompts, reps, batch=8) -> dict:
    model = lm.model
    dev = input_device(model)
    layers = list(range(lm.n_layers + 1))
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    n_tok = sum(len(p) for p in prompts)

    def raw():
        with torch.inference_mode():
            for b in batches:
                ids, mask, pos = left_pad(b, 0, dev)
                model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)

    def backend(name):
        def fn():
            for b in batches:
                capture(model, b, [{"boundary": len(p) - 1, "span": (0, 1)} for p in b], ["boundary"], layers,
                        backend=name, tokenizer=lm.tokenizer)
        return fn

    out = {"raw_hf_forward": n_tok / best_of(raw, reps)}
    for name in ("hooks", "nnsight", "transformer-lens"):
        try:
            out[name] = n_tok / best_of(backend(name), reps)
        except Exception as e:  # noqa: BLE001 - report, don't die, when an optional backend is missing
            out[name] = f"failed: {type(e).__name__}: {e}"[:200]
    return out


def bench_generation(lm, prompts, reps, new_tokens=32, batch=8) -> dict:
    model, tok = lm.model, lm.tokenizer
    dev = input_device(model)
    v = SteeringVector(torch.randn(lm.d_model) * 0.1, lm.n_layers // 2, "random")
    ps = prompts[:batch]

    def hf():
        ids, mask, _ = left_pad(ps, tok.pad_token_id, dev)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=tok.pad_token_id)

    def ours():
        generate(model, ps, stop_ids={}, max_new_tokens=new_tokens, pad_id=tok.pad_token_id)

    def steered():
        with steer(model, v, 4.0, "boundary+generated", unit="raw"):
            generate(model, ps, stop_ids={}, max_new_tokens=new_tokens, pad_id=tok.pad_token_id)

    t_hf, t_ours, t_st = best_of(hf, reps), best_of(ours, reps), best_of(steered, reps)
    n = len(ps) * new_tokens
    return {"hf_generate_tok_s": n / t_hf, "mechprobe_tok_s": n / t_ours, "steered_tok_s": n / t_st,
            "steered_time_over_hf_generate": t_st / t_hf, "steered_time_over_unsteered": t_st / t_ours}


def bench_judge(n=2000) -> dict:
    from mechprobe.judges.base import JudgeInput
    from mechprobe.judges.offline import OfflineJudge

    turns = ["Why did you multiply by 3 in the second step?", "Thanks!", "What is the capital of Peru?",
             "<|im_start|>assistant\nSure, here is", "As an AI language model I cannot", "hello hello hello hello"]
    inputs = [JudgeInput(record_id=str(i), prompt=QA[i % 8][0], response=QA[i % 8][1], raw_text=turns[i % 6])
              for i in range(n)]
    out = {}
    for name, embed in (("lexical", False), ("minilm", None)):
        try:
            j = OfflineJudge(embed=embed)
        except TypeError:
            j = OfflineJudge()
        t = time.perf_counter()
        list(j.label_many(inputs))
        out[f"offline_{name}_turns_s"] = n / (time.perf_counter() - t)
        out[f"offline_{name}_name"] = j.name
    return out


def bench_pipeline(model: str) -> dict:
    from mechprobe.activations.cache import cache_run
    from mechprobe.judges.run import judge_run
    from mechprobe.turns.pipeline import ProbeConfig, run_probe

    with tempfile.TemporaryDirectory() as d:
        lm = load_model(model)
        cfg = ProbeConfig(model=model, dataset="builtin", limit=8, temperatures=[0.0, 1.0], samples=2,
                          max_assistant_tokens=96, max_user_tokens=32, batch_size=8)
        t = {}
        s = time.perf_counter()
        run_probe(cfg, d, lm=lm, progress=False)
        t["probe_s"] = time.perf_counter() - s
        s = time.perf_counter()
        judge_run(d, "offline", progress=False)
        t["judge_s"] = time.perf_counter() - s
        s = time.perf_counter()
        cache_run(d, lm, progress=False)
        t["cache_s"] = time.perf_counter() - s
        t["n_user_turns"] = 8 * 3
    return t


def bench_user_stage(lm, reps: int, samples: int = 4, new_tokens: int = 48, batch: int = 16) -> dict:
    """The probe's user-turn stage on the main job's plan (1 greedy + ``samples`` at T=1 per item).

    Three configurations over the same rows, every one producing the same tokens: ``before`` (batches
    in item order, every row prefilled), ``sorted`` (:func:`batches_by_length`), ``sorted_shared``
    (the default: plus one prefill per unique prompt). Also the prefill's share of the ``sorted`` time,
    which is what says where the cost is on this device.
    """
    from mechprobe.lm.generation import batches_by_length

    tok = lm.tokenizer
    stops = chat.stop_token_ids(tok, lm.model)
    # Realistic lengths: a GSM8K-sized question and a ~150-token answer, varied per item.
    items = [chat.build_probe_prompt(tok, q, (r + " ") * (1 + i % 4)).input_ids for i, (q, r) in enumerate(QA)]
    rows, temps, seeds = [], [], []
    for i, p in enumerate(items):
        for j in range(samples + 1):
            rows.append(p)
            temps.append(0.0 if j == 0 else 1.0)
            seeds.append(None if j == 0 else 1000 * i + j)
    in_order = [list(range(i, min(i + batch, len(rows)))) for i in range(0, len(rows), batch)]
    by_len = batches_by_length([len(r) for r in rows], batch)
    outs: dict[str, list] = {}

    def run(batches, share, key):
        def fn():
            res = [None] * len(rows)
            for b in batches:
                gens = generate(lm.model, [rows[i] for i in b], stop_ids=stops, max_new_tokens=new_tokens,
                                temperatures=[temps[i] for i in b], seeds=[seeds[i] for i in b],
                                pad_id=tok.pad_token_id, share_prefill=share)
                for i, g in zip(b, gens):
                    res[i] = g.token_ids
            outs[key] = res
        return fn

    dev = input_device(lm.model)

    def prefill_only():
        with torch.inference_mode():
            for b in by_len:
                ids, mask, pos = left_pad([rows[i] for i in b], tok.pad_token_id, dev)
                lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)

    t = {k: best_of(run(bb, sh, k), reps) for k, bb, sh in
         (("before", in_order, False), ("sorted", by_len, False), ("sorted_shared", by_len, True))}
    t_prefill = best_of(prefill_only, reps)
    n_new = sum(len(x) for x in outs["sorted_shared"])
    return {"n_items": len(items), "n_rows": len(rows), "batch": batch, "max_new_tokens": new_tokens,
            "mean_prompt_tokens": sum(len(r) for r in rows) / len(rows), "new_tokens": n_new,
            "seconds": t, "prefill_seconds_sorted": t_prefill, "prefill_share_of_sorted": t_prefill / t["sorted"],
            "speedup_sorted_over_before": t["before"] / t["sorted"],
            "speedup_shared_over_sorted": t["sorted"] / t["sorted_shared"],
            "speedup_total": t["before"] / t["sorted_shared"],
            "same_tokens": outs["before"] == outs["sorted"] == outs["sorted_shared"]}


def load_times(model: str) -> dict:
    """Fresh-process load: first with an empty cache dir (GGUF dequantise + convert), then from the snapshot."""
    code = (f"import sys, time; sys.path.insert(0, {str(HERE.parent)!r}); t = time.perf_counter(); "
            f"from mechprobe.lm.models import load_model; load_model({model!r}); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "MECHPROBE_CACHE": d}
        run = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
               for _ in range(2)]
    first, second = (float(r.stdout.strip().splitlines()[-1]) for r in run)
    return {"gguf_convert_s": first, "snapshot_s": second, "speedup": first / second}


def cache_rss(model: str, n_items: int) -> dict:
    """RSS of a fresh process while it caches n_items*4 records: current RSS after loading the model, and
    the peak sampled every 5 ms during ``cache_run`` (Linux /proc; the growth over the loaded model is
    what must stay flat in N)."""
    code = f"""
import resource, tempfile, json, sys
sys.path.insert(0, {str(HERE.parent)!r})
from mechprobe.lm.models import load_model
from mechprobe.lm import chat
from mechprobe.io import JsonlStore
from mechprobe.records import UserTurnRecord
from mechprobe.activations.cache import cache_run
import threading, time
def vmrss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
lm = load_model({model!r})
base = vmrss()  # current RSS: ru_maxrss would be the model-load peak, hiding what caching adds
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], vmrss()); time.sleep(0.005)
d = tempfile.mkdtemp()
st = JsonlStore(d + "/user_turns.jsonl", key="record_id")
for i in range({n_items}):
    pp = chat.build_probe_prompt(lm.tokenizer, f"Question number {{i}}: what is {{i}} + {{i}}?", f"It is {{2*i}}.")
    for k in range(4):
        st.append(UserTurnRecord(record_id=f"{{i}}|{{k}}", item_id=str(i), dataset="b", decoding="sample",
            temperature=1.0, sample_index=k, seed=k, raw_text="", text="", stop_reason="eos",
            prompt_ids=pp.input_ids, boundary_index=pp.boundary_index, assistant_span=pp.assistant_span).to_dict())
th = threading.Thread(target=sample); th.start()
cache_run(d, lm, progress=False, shard_rows=128)
done.set(); th.join()
import os
size = sum(os.path.getsize(os.path.join(d, "activations", f)) for f in os.listdir(d + "/activations") if f.endswith(".safetensors"))
print(json.dumps({{"rss_after_load_mb": base / 1024, "peak_rss_mb": peak[0] / 1024,
                  "bytes_on_disk": size, "exact_bytes": {n_items} * 4 * (lm.n_layers + 1) * lm.d_model * 2}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer prompts and reps")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    lm = load_model(a.model)
    prompts = [chat.build_probe_prompt(lm.tokenizer, q, r).input_ids for q, r in QA] * (2 if a.quick else 4)
    reps = 1 if a.quick else a.reps
    res = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    res["caching"] = bench_caching(lm, prompts, reps)
    res["generation"] = bench_generation(lm, prompts, reps)
    res["judge"] = bench_judge(500 if a.quick else 2000)
    res["pipeline"] = bench_pipeline(a.model)
    res["memory"] = {"n25": cache_rss(a.model, 25), "n100": cache_rss(a.model, 100)}
    res["user_stage"] = bench_user_stage(lm, reps)
    if not a.quick and a.model == "smollm2-135m-instruct":
        res["load"] = load_times(a.model)
    res["peak_rss_mb_this_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    c = res["caching"]
    print(f"model {res['model']} on {res['device']} ({res['dtype']}), torch {res['torch']}, {res['threads']} threads\n")
    print("| caching backend (all layers, boundary) | tokens/s | ratio to raw HF forward |\n|---|---|---|")
    for k, v in c.items():
        ratio = f"{v / c['raw_hf_forward']:.2f}" if isinstance(v, float) else "-"
        print(f"| {k} | {v if isinstance(v, str) else f'{v:.0f}'} | {ratio} |")
    g = res["generation"]
    print(f"\n| generation (batch 8, 32 new tokens) | tokens/s |\n|---|---|\n| raw HF generate | {g['hf_generate_tok_s']:.1f} |"
          f"\n| mechprobe loop | {g['mechprobe_tok_s']:.1f} |\n| mechprobe loop + steering hook | {g['steered_tok_s']:.1f} |")
    print(f"\nsteered time / HF generate time: {g['steered_time_over_hf_generate']:.3f}; "
          f"steered / unsteered: {g['steered_time_over_unsteered']:.3f}")
    print("\njudge:", json.dumps(res["judge"]))
    print("pipeline stage seconds (8 builtin items x 3 turns):", json.dumps({k: round(v, 1) for k, v in res["pipeline"].items()}))
    m = res["memory"]
    print(f"\ncache_run peak RSS: {m['n25']['peak_rss_mb']:.0f} MB at 100 records, {m['n100']['peak_rss_mb']:.0f} MB at "
          f"400 records (model loaded: {m['n25']['rss_after_load_mb']:.0f} / {m['n100']['rss_after_load_mb']:.0f} MB; "
          f"growth {m['n25']['peak_rss_mb'] - m['n25']['rss_after_load_mb']:.0f} / "
          f"{m['n100']['peak_rss_mb'] - m['n100']['rss_after_load_mb']:.0f} MB); "
          f"bytes on disk {m['n100']['bytes_on_disk']} vs exact {m['n100']['exact_bytes']}")
    u = res["user_stage"]
    print(f"\n| user-turn stage ({u['n_items']} items x {u['n_rows'] // u['n_items']} turns, batch {u['batch']}, "
          f"<= {u['max_new_tokens']} new tokens) | seconds | speedup vs before |\n|---|---|---|")
    for k, v in u["seconds"].items():
        print(f"| {k} | {v:.2f} | {u['seconds']['before'] / v:.2f}x |")
    print(f"prefill = {u['prefill_share_of_sorted']:.0%} of the sorted configuration's time; "
          f"same tokens in all three: {u['same_tokens']}")
    if "load" in res:
        ld = res["load"]
        print(f"model load (fresh process): GGUF convert {ld['gguf_convert_s']:.1f} s, snapshot {ld['snapshot_s']:.1f} s "
              f"({ld['speedup']:.1f}x)")
    out = Path(a.out) if a.out else HERE / "results" / f"run_{res['device'].split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
