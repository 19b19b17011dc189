"""Boundary caching at all layers: each backend vs a raw HF forward without hooks, same records, one run.

    python benchmarks/bench_cache.py [--model smollm2-135m-instruct] [--n 64] [--batch-size 8] [--reps 3]
                                     [--device cpu|cuda] [--threads 2]
    python benchmarks/bench_cache.py --random llama-1b --device cuda     # no weights needed (GPU machines)

Not a test. Two parts:

1. **Throughput** (one process, modes interleaved rep by rep and the best rep kept, so drifting load from
   other processes hits every mode alike): the same ``n`` distinct probe prompts, sorted by length and cut
   into the batches ``cache_run`` uses, through (a) ``model(...)`` without hooks -- the raw HF forward,
   LM head included; (b) the decoder stack alone (``model.model``, no LM head); (c) each backend's
   ``capture`` of the boundary at all L+1 residual indices. Tokens/s counts real (unpadded) tokens.
   A parity column checks each backend against ``output_hidden_states`` of the *same* padded batch at the
   boundary (residual indices 0..L-1; HF's last entry is post-norm), so it is exact where kernels agree.
2. **cache_run per backend in a fresh process**: wall time (backend setup and shard writes included), peak
   RSS over the loaded model, and bytes on disk vs the exact ``N*(L+1)*d*2`` of float16 vectors.

Prints a markdown table and writes ``benchmarks/results/cache.json`` (or ``cache_<device>.json`` off CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mechprobe.activations.backends import BACKENDS, make_backend  # noqa: E402
from mechprobe.io import JsonlStore, versions  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.generation import left_pad  # noqa: E402
from mechprobe.lm.models import LoadedModel, load_model  # noqa: E402
from mechprobe.records import UserTurnRecord  # noqa: E402

QA = [("What is 17 * 23?", "17 * 23 = 391."),
      ("Explain photosynthesis briefly.", "Plants turn light, water and CO2 into sugar and oxygen."),
      ("Give me three tips for a job interview.", "Research the company, practise answers, and arrive early."),
      ("How do I reverse a list in Python?", "Use my_list[::-1], or my_list.reverse() to reverse it in place."),
      ("Why is the sky blue?", "Air scatters short blue wavelengths of sunlight more than red ones."),
      ("Write a haiku about autumn.", "Red leaves drift and fall / the cold wind hums through bare trees / the year exhales"),
      ("What is the capital of Australia?", "The capital of Australia is Canberra, not Sydney."),
      ("How many minutes are in a week?", "There are 7 * 24 * 60 = 10,080 minutes in a week.")]


RANDOM = {  # real shapes, random weights: for machines without the embedded model's weights
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     max_position_embeddings=4096, rope_theta=500000.0),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=2048),
}


def word_tokenizer(vocab_size: int = 128) -> object:
    """A minimal tokenizer for --random mode (hashed into the manifest; prompts are token ids already).

    Saved and re-loaded because TransformerLens re-loads tokenizers from ``name_or_path``.
    """
    import tempfile

    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="t1", unk_token="t0")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    d = tempfile.mkdtemp(prefix="bench_tok_")
    tok.save_pretrained(d)
    return AutoTokenizer.from_pretrained(d)


def load(model: str, random: str | None, device: str) -> LoadedModel:
    if not random:
        return load_model(model, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device(device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = AutoConfig.for_model(**RANDOM[random])
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa" if dev.type == "cuda" else "eager")
    return LoadedModel(model=m.to(dev).eval(), tokenizer=word_tokenizer(), name=f"random-{random}",
                       weight_hash=f"random-{random}-seed0", device=dev, dtype=dt)


def make_records(lm: LoadedModel, n: int) -> list[UserTurnRecord]:
    """``n`` distinct probe prompts (distinct, so prompt de-duplication cannot flatter cache_run).

    Real probe prompts from the chat template; random token ids of similar lengths for a random model.
    """
    out = []
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        q, a = QA[i % len(QA)]
        if lm.name.startswith("random-"):
            t = 60 + 20 * (i % 8)
            ids = torch.randint(10, int(lm.model.config.vocab_size), (t,), generator=g).tolist()
            boundary, span = t - 1, (20, t - 5)
        else:
            pp = chat.build_probe_prompt(lm.tokenizer, f"{q} (question {i})", a * (1 + i % 3))
            ids, boundary, span = pp.input_ids, pp.boundary_index, pp.assistant_span
        out.append(UserTurnRecord(record_id=f"q{i}", item_id=f"q{i}", dataset="bench", decoding="greedy",
                                  temperature=0.0, sample_index=0, seed=None, raw_text="", text="",
                                  stop_reason="end_of_turn", prompt_ids=ids, boundary_index=boundary,
                                  assistant_span=span))
    return out


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def throughput(lm: LoadedModel, recs: list[UserTurnRecord], batch_size: int, reps: int) -> dict:
    model, dev = lm.model, lm.device
    order = sorted(range(len(recs)), key=lambda i: len(recs[i].prompt_ids))  # as cache_run batches them
    batches = [[recs[i] for i in order[b:b + batch_size]] for b in range(0, len(order), batch_size)]
    padded = [left_pad([r.prompt_ids for r in b], 0, dev) for b in batches]
    n_tok = sum(len(r.prompt_ids) for r in recs)
    layers = list(range(lm.n_layers + 1))
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def raw() -> None:
        with torch.inference_mode():
            for ids, mask, pos in padded:
                model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)

    def raw_no_head() -> None:
        with torch.inference_mode():
            for ids, mask, pos in padded:
                base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)

    fns = {"raw HF forward (no hooks)": raw, "raw decoder stack (no LM head)": raw_no_head}
    setup: dict[str, float] = {}
    parity: dict[str, float] = {}
    for name in BACKENDS:
        try:
            t = time.perf_counter()
            be = make_backend(name, model, lm.tokenizer)
            setup[name] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - report an optional backend that cannot run, don't die
            fns[name] = f"unavailable: {type(e).__name__}: {e}"[:160]  # type: ignore[assignment]
            continue

        parity[name] = parity_error(be, model, batches[-1], padded[-1])

        def run(be=be) -> None:
            for b in batches:
                be.capture([r.prompt_ids for r in b], [{"boundary": r.boundary_index, "span": r.assistant_span}
                                                       for r in b], ["boundary"], layers)
        fns[name] = run
    best = {k: float("inf") for k, f in fns.items() if callable(f)}
    for k in best:  # warm-up
        fns[k]()
    for _ in range(reps):
        for k in best:
            t = time.perf_counter()
            fns[k]()
            sync(dev)
            best[k] = min(best[k], time.perf_counter() - t)
    raw_tps = n_tok / best["raw HF forward (no hooks)"]
    out = {}
    for k, f in fns.items():
        if not callable(f):
            out[k] = {"error": f}
            continue
        tps = n_tok / best[k]
        out[k] = {"tokens_s": tps, "ratio_to_raw_hf": tps / raw_tps, "best_s": best[k], "setup_s": setup.get(k),
                  "max_rel_err_vs_hidden_states": parity.get(k)}
    return {"n_tokens": n_tok, "n_padded_tokens": sum(int(ids.numel()) for ids, _, _ in padded), "modes": out}


def parity_error(be, model, batch: list[UserTurnRecord], padded: tuple) -> float:
    """Worst per-vector relative error of the boundary capture vs ``output_hidden_states[0..L-1]``, same batch."""
    ids, mask, pos = padded
    n_layers = be.n_layers
    got = be.capture([r.prompt_ids for r in batch], [{"boundary": r.boundary_index, "span": r.assistant_span}
                                                     for r in batch], ["boundary"], list(range(n_layers)))["boundary"]
    with torch.inference_mode():
        hs = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True,
                   use_cache=False).hidden_states
    ref = torch.stack([h[:, -1] for h in hs[:n_layers]], dim=1).float()  # prompts end at the boundary
    return ((got.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


CHILD = """
import json, os, resource, sys, tempfile, time
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads({threads})
sys.path.insert(0, {here!r})
from bench_cache import load, make_records, write_run
from mechprobe.activations.cache import cache_run
lm = load({model!r}, {random!r}, {device!r})
recs = make_records(lm, {n})
with torch.inference_mode():  # touch every weight page first (snapshots are memory-mapped)
    lm.model(input_ids=torch.tensor([recs[0].prompt_ids], device=lm.device))
def status_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
try:  # reset the high-water mark so the peak is the caching's, not the model loading's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    loaded = status_mb("VmRSS")
except OSError:
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with tempfile.TemporaryDirectory() as d:
    write_run(d, recs)
    t = time.perf_counter()
    out = cache_run(d, lm, backend={backend!r}, batch_size={batch_size}, shard_rows={shard_rows}, progress=False)
    wall = time.perf_counter() - t
    disk = sum(f.stat().st_size for f in out.glob("shard_*.safetensors"))
    manifest = (out / "manifest.json").stat().st_size
print(json.dumps({{"wall_s": wall, "rss_after_load_mb": loaded,
                  "peak_rss_mb": status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "bytes_on_disk": disk, "manifest_bytes": manifest,
                  "exact_bytes": {n} * (lm.n_layers + 1) * lm.d_model * 2}}))
"""


def write_run(d: str | Path, recs: list[UserTurnRecord]) -> None:
    st = JsonlStore(Path(d) / "user_turns.jsonl", key="record_id")
    st.extend(r.to_dict() for r in recs)


def cache_run_child(a: argparse.Namespace, backend: str, n: int) -> dict:
    code = CHILD.format(repo=str(HERE.parent), here=str(HERE), threads=a.threads, model=a.model, random=a.random,
                        device=a.device,
                        n=n, backend=backend, batch_size=a.batch_size, shard_rows=a.shard_rows)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--n", type=int, default=64, help="distinct probe prompts")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--random", default=None, choices=sorted(RANDOM), help="random-init model of these shapes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shard-rows", type=int, default=64, help="small, so the streaming path is exercised")
    p.add_argument("--skip-rss", action="store_true", help="skip the fresh-process cache_run part")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load(a.model, a.random, a.device)
    recs = make_records(lm, a.n)
    res = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "threads": a.threads,
           "attn": getattr(lm.model.config, "_attn_implementation", None), "n_records": a.n,
           "batch_size": a.batch_size, "n_layers": lm.n_layers, "d_model": lm.d_model,
           "loadavg_start": os.getloadavg(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "versions": versions()}
    if lm.device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    res["throughput"] = throughput(lm, recs, a.batch_size, a.reps)
    res["loadavg_end"] = os.getloadavg()
    if not a.skip_rss:
        res["cache_run"] = {b: cache_run_child(a, b, a.n) for b in BACKENDS}
        res["cache_run_4n"] = {"hooks": cache_run_child(a, "hooks", 4 * a.n)}
    res["peak_rss_mb_this_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    t = res["throughput"]
    print(f"\n{res['model']} on {res['device']} ({res['dtype']}, attn {res['attn']}, {a.threads} threads); {a.n} prompts, "
          f"{t['n_tokens']} tokens ({t['n_padded_tokens']} padded), batch {a.batch_size}, all {lm.n_layers + 1} "
          f"residual indices at the boundary; best of {a.reps}; load average {res['loadavg_start'][0]:.1f} -> "
          f"{res['loadavg_end'][0]:.1f}\n")
    print("| mode | tokens/s | ratio to raw HF | max rel err vs hidden_states | backend setup s | cache_run s "
          "| peak RSS MB (over model) | bytes on disk / exact |\n|---|---|---|---|---|---|---|---|")
    for k, v in t["modes"].items():
        if "error" in v:
            print(f"| {k} | {v['error']} | | | | | | |")
            continue
        c = res.get("cache_run", {}).get(k, {})
        cr = (f"{c['wall_s']:.2f} | {c['peak_rss_mb']:.0f} (+{c['peak_rss_mb'] - c['rss_after_load_mb']:.0f}) | "
              f"{c['bytes_on_disk']} / {c['exact_bytes']}") if "wall_s" in c else (c.get("error", "-") + " | - | -")
        setup = f"{v['setup_s']:.2f}" if v.get("setup_s") is not None else "-"
        err = v.get("max_rel_err_vs_hidden_states")
        err_s = "-" if err is None else f"{err:.1e}"
        print(f"| {k} | {v['tokens_s']:.0f} | {v['ratio_to_raw_hf']:.2f} | {err_s} | {setup} | {cr} |")
    if "cache_run_4n" in res and "wall_s" in res["cache_run_4n"]["hooks"]:
        c1, c4 = res["cache_run"]["hooks"], res["cache_run_4n"]["hooks"]
        if "peak_rss_mb" in c1:
            print(f"\nhooks cache_run peak RSS over the loaded model: {c1['peak_rss_mb'] - c1['rss_after_load_mb']:.0f} MB "
                  f"at N={a.n}, {c4['peak_rss_mb'] - c4['rss_after_load_mb']:.0f} MB at N={4 * a.n} "
                  f"(disk {c4['bytes_on_disk']} vs exact {c4['exact_bytes']})")
    tag = "" if lm.device.type == "cpu" and not a.random else f"_{lm.device.type}" + (f"_{a.random}" if a.random else "")
    out = Path(a.out) if a.out else HERE / "results" / f"cache{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
