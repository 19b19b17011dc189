"""Steering NLLs: ``NllScorer`` (shared unsteered prefixes, batched) vs ``steered_nll`` (the whole prompt per condition).

    python benchmarks/bench_nll.py --run runs/qwen2.5-coder-1.5b-instruct-gsm8k [--n 16] [--conditions 5]
                                   [--dtypes float32 bfloat16] [--layer 14] [--alpha 0.4]

Not a test. One process, one real run: the first ``n`` items' probe prompts and their greedy user turns
(``user_turns.jsonl``) scored under ``conditions`` settings -- alpha 0, then random vectors of norm
``alpha`` x the mean boundary residual norm at ``layer`` (``boundary+generated``), as a steering run scores
its conditions. Per dtype: seconds per item-condition for ``steered_nll`` (the baseline: what steer.py ran
before) and for ``NllScorer`` (its first condition computes the prefixes; the rest reuse them), the ratio,
and the largest |difference| between the two (float summation order only). Writes
``benchmarks/results/nll_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mechprobe.io import read_json, read_jsonl, versions  # noqa: E402
from mechprobe.lm import chat  # noqa: E402
from mechprobe.lm.generation import input_device, left_pad  # noqa: E402
from mechprobe.lm.models import load_model  # noqa: E402
from mechprobe.records import AssistantRecord  # noqa: E402
from mechprobe.steering.evaluate import NllScorer, steered_nll  # noqa: E402
from mechprobe.steering.vector import SteeringVector  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--conditions", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layer", type=int, default=None, help="default: n_layers // 2")
    p.add_argument("--alpha", type=float, default=0.4)
    a = p.parse_args(argv)
    run = Path(a.run)
    cfg = read_json(run / "manifest.json")["config"]
    asst = [AssistantRecord.from_dict(r) for r in read_jsonl(run / "assistant.jsonl", key="item_id")][: a.n]
    greedy = {r["item_id"]: r for r in read_jsonl(run / "user_turns.jsonl") if r.get("decoding") == "greedy"}
    asst = [x for x in asst if x.item_id in greedy]
    out: dict = {"model": cfg["model"], "run": str(run), "n_items": len(asst), "conditions": a.conditions,
                 "alpha": a.alpha, "machine": platform.processor() or platform.machine(),
                 "threads": torch.get_num_threads(), "versions": versions(), "rows": []}
    for dt in a.dtypes:
        lm = load_model(cfg["model"], dtype=dt, chat_template=cfg.get("chat_template"))
        tok = lm.tokenizer
        prompts = [list(chat.build_probe_prompt(tok, x.prompt, x.response, system=cfg.get("system"),
                                                history=x.messages or None).input_ids) for x in asst]
        conts = [list(tok(greedy[x.item_id]["raw_text"], add_special_tokens=False).input_ids) or [tok.eos_token_id]
                 for x in asst]
        layer = a.layer if a.layer is not None else lm.model.config.num_hidden_layers // 2
        with torch.inference_mode():
            ids, mask, pos = left_pad(prompts[:8], tok.pad_token_id, input_device(lm.model))
            h = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         output_hidden_states=True).hidden_states[layer][:, -1].float()
        resid = float(h.norm(dim=-1).mean())
        g = torch.Generator().manual_seed(0)
        conds: list[SteeringVector | None] = [None]
        for _ in range(a.conditions - 1):
            v = torch.randn(h.shape[1], generator=g)
            conds.append(SteeringVector(v / v.norm() * resid, layer, "random", {}))
        steered_nll(lm, prompts[:2], conts[:2], None, 0.0, "boundary+generated")  # warm-up (kernels, allocator)
        t = time.time()
        base = [steered_nll(lm, prompts, conts, v, a.alpha if v is not None else 0.0, "boundary+generated")
                for v in conds]
        t_base = time.time() - t
        sc = NllScorer(lm)
        t = time.time()
        first = sc(prompts, conts, conds[0], 0.0)
        t_first = time.time() - t
        t = time.time()
        rest = [sc(prompts, conts, v, a.alpha) for v in conds[1:]]
        t_rest = time.time() - t
        diff = max(abs(x - y) for got, ref in zip([first, *rest], base) for x, y in zip(got, ref))
        n_ic = len(asst) * len(conds)
        row = {"dtype": dt, "layer": layer, "resid_norm": resid,
               "steered_nll_s_per_item_condition": t_base / n_ic,
               "scorer_s_per_item_condition": (t_first + t_rest) / n_ic,
               "scorer_first_condition_s_per_item": t_first / len(asst),
               "scorer_later_conditions_s_per_item": t_rest / max(1, len(asst) * (len(conds) - 1)),
               "ratio": t_base / (t_first + t_rest), "max_abs_diff": diff}
        out["rows"].append(row)
        print(json.dumps(row))
        del lm, sc
    print(f"\n{out['model']}, {len(asst)} items x {a.conditions} conditions (alpha 0 + random vectors at "
          f"{a.alpha:g} x resid norm), {out['threads']} threads\n")
    print("| dtype | steered_nll s/item-cond | NllScorer s/item-cond | of which first / later cond s/item | ratio "
          "| max abs diff |\n|---|---|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['dtype']} | {r['steered_nll_s_per_item_condition']:.3f} | {r['scorer_s_per_item_condition']:.3f} "
              f"| {r['scorer_first_condition_s_per_item']:.3f} / {r['scorer_later_conditions_s_per_item']:.3f} "
              f"| {r['ratio']:.1f}x | {r['max_abs_diff']:.2g} |")
    dest = HERE / "results" / f"nll_{out['model']}.json"
    dest.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
