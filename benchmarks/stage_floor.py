"""Where a finding command's time goes, against the CPU's compute floor, from one finished run directory.

    python benchmarks/stage_floor.py runs/qwen2.5-coder-1.5b-instruct-gsm8k --items 200 \\
        --limit benchmarks/results/decode_limit_qwen2.5-coder-1.5b-instruct_llamacpp.json \\
        --hf-limit benchmarks/results/decode_limit_qwen2.5-coder-1.5b-instruct.json

Reads the stage seconds the run's manifests recorded (answers, user turns, judge, boundary cache) and counts
the token forwards each stage cannot avoid: the answers' and the probe prompts' prefill, every generated token,
the judge's conversation prefix (once per item with a model-scored turn) plus its passes over each scored turn
(user slot, null slot; assistant slot for the voice check), and the cache's one forward per item (the tokens it
recorded running, ``forward_tokens``, where it read the judge's kept conversations instead). The floor is
those tokens at the compute bound ``benchmarks/decode_limit.py`` measured on the same CPU (llama.cpp's prefill
rate for the generation stages, the HF peak for the judge and the cache). Prints a markdown table and writes
``results/stage_floor_<run>.json``; per-item figures scale to ``--items`` as a projection, never a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mechprobe.io import read_json, read_jsonl  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--items", type=int, default=200, help="scale the per-item figures to this many items")
    p.add_argument("--limit", required=True, help="decode_limit JSON of the generation engine (llama.cpp)")
    p.add_argument("--hf-limit", required=True, help="decode_limit JSON of the HF path (judge and cache)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    run = Path(a.run)
    man = read_json(run / "manifest.json")["timing"]
    judge_s = read_json(run / "labels_manifest.json")["timing"]["seconds"]
    cache_timing = read_json(run / "activations" / "manifest.json")["timing"]
    cache_s = cache_timing["forward_seconds"]
    answers = read_jsonl(run / "assistant.jsonl")
    turns = read_jsonl(run / "user_turns.jsonl")
    labels = {r["record_id"]: r for r in read_jsonl(run / "labels.jsonl")}
    n = len(answers)
    prompt = {t["item_id"]: len(t["prompt_ids"]) for t in turns}
    gen_peak = read_json(Path(a.limit))["prefill_tok_s_512"]
    hf = read_json(Path(a.hf_limit))
    hf_peak = hf["matmul_gflop_s"] * 1e9 / (2 * hf["params"])
    ans_tokens = sum(x["n_tokens"] for x in answers)
    # the answer prompt is the probe prompt without the answer and the user header: bounded by it minus the answer
    ans_prompt = sum(max(prompt.get(x["item_id"], 0) - x["n_tokens"], 0) for x in answers)
    turn_tokens = sum(len(t["generated_ids"]) for t in turns)
    scored = [t for t in turns if "pmi" in (labels.get(t["record_id"], {}).get("probs") or {})]
    voiced = [t for t in turns if "voice" in (labels.get(t["record_id"], {}).get("probs") or {})]
    judge_tokens = (sum(prompt[i] for i in {t["item_id"] for t in scored})
                    + sum(2 * len(t["generated_ids"]) for t in scored) + sum(len(t["generated_ids"]) for t in voiced))
    # the tokens the cache stage recorded running (fewer where it read the judge's kept conversations), else all
    cache_tokens = cache_timing.get("forward_tokens", sum(prompt.values()))
    stages = [
        ("answers", man["assistant_seconds"], ans_prompt + ans_tokens, gen_peak),
        ("user turns", man["user_seconds"], sum(prompt.values()) + turn_tokens, gen_peak),
        ("judge", judge_s, judge_tokens, hf_peak),
        ("boundary cache", cache_s, cache_tokens, hf_peak),
    ]
    rows = []
    for name, sec, toks, peak in stages:
        floor = toks / peak
        rows.append({"stage": name, "seconds": round(sec, 1), "token_forwards": toks, "floor_seconds": round(floor, 1),
                     "of_floor": round(floor / sec, 3), "projected_minutes": round(sec / n * a.items / 60, 1),
                     "floor_minutes": round(floor / n * a.items / 60, 1)})
    tot = {k: round(sum(r[k] for r in rows), 1) for k in ("seconds", "floor_seconds", "projected_minutes",
                                                           "floor_minutes")}
    res = {"run": run.name, "items": n, "turns": len(turns), "scored_turns": len(scored), "voiced_turns": len(voiced),
           "generation_peak_tok_s": gen_peak, "hf_peak_tok_s": round(hf_peak, 1), "cpu": hf.get("cpu"),
           "projection_items": a.items, "stages": rows, "total": tot}
    print(f"| stage | seconds ({n} items) | token forwards | floor, s | measured / floor | "
          f"{a.items} items: projected min | floor min |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['seconds']} | {r['token_forwards']:,} | {r['floor_seconds']} | "
              f"{r['seconds'] / max(r['floor_seconds'], 1e-9):.2f}x | {r['projected_minutes']} | {r['floor_minutes']} |")
    print(f"| total | {tot['seconds']} | | {tot['floor_seconds']} | "
          f"{tot['seconds'] / tot['floor_seconds']:.2f}x | {tot['projected_minutes']} | {tot['floor_minutes']} |")
    out = Path(a.out) if a.out else HERE / "results" / f"stage_floor_{run.name}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
