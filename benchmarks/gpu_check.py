"""The CUDA path, checked and timed on a random-init model of a real 0.5B config (no weights needed).

``python benchmarks/gpu_check.py [--arch qwen2] [--out benchmarks/results/gpu.json]``

Checks: bf16 placement (``load_model`` defaults on CUDA), ``device_map="auto"`` loading from a saved
directory, batched == unbatched greedy in bf16 (reported as a rate: bf16 rounding can flip near-ties),
steering with alpha 0 == no steering, boundary capture == ``output_hidden_states``; times generation
(mechprobe decode loop vs HF ``generate``) and boundary caching (hooks vs raw forward). Exits non-zero on
a failed check; prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from mechprobe.lm.forward import get_blocks
from mechprobe.lm.generation import generate, left_pad
from mechprobe.lm.models import load_model

CONFIGS = {
    # Qwen2.5-0.5B's shapes (the paper's lineage), random weights.
    "qwen2": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True),
    # Llama-3.2-1B's shapes.
    "llama": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  max_position_embeddings=4096, tie_word_embeddings=True),
}


def timed(fn, reps: int = 3) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen2", choices=sorted(CONFIGS))
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory saved beside the random weights, so load_model() itself is used")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    a = p.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version()}
    import transformers

    res["transformers"] = transformers.__version__
    failures: list[str] = []

    cfg_kwargs = dict(CONFIGS[a.arch])
    cfg = AutoConfig.for_model(cfg_kwargs.pop("model_type"), **cfg_kwargs)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
        t = time.perf_counter()
        if a.tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(a.tokenizer).save_pretrained(d)
            lm = load_model(d)  # the package's loader: default device, dtype, attention
            model = lm.model
            res["attn_implementation"] = model.config._attn_implementation
        else:
            model = _load_without_tokenizer(d)
        res["load_s"] = round(time.perf_counter() - t, 2)
        res["dtype"] = str(next(model.parameters()).dtype)
        res["device"] = str(next(model.parameters()).device)
        if res["dtype"] != "torch.bfloat16" or not res["device"].startswith("cuda"):
            failures.append(f"default placement is {res['device']}/{res['dtype']}, want cuda/bf16")
        dm = _load_without_tokenizer(d, device_map="auto")
        res["device_map_auto"] = sorted({str(v) for v in getattr(dm, "hf_device_map", {}).values()})
        del dm
    res["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(48, 160, (32,), generator=g).tolist()
    prompts = [torch.randint(100, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    dev = torch.device("cuda")

    # Generation throughput, mechprobe loop vs HF generate, same prompts and new tokens.
    new = 64
    gen_rows = {}
    for bs in (1, 8, 32):
        ps = prompts[:bs] if bs > 1 else prompts[:4]
        def ours(ps=ps):
            generate(model, ps, stop_ids={}, max_new_tokens=new, pad_id=0)
        def hf(ps=ps):
            ids, mask, _ = left_pad(ps, 0, dev)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        t_o, t_h = timed(ours), timed(hf)
        n_tok = len(ps) * new
        gen_rows[bs] = {"mechprobe_tok_s": n_tok / t_o, "hf_tok_s": n_tok / t_h, "ratio": t_h / t_o}
    res["generation"] = gen_rows

    # Batched == unbatched greedy in bf16 (rate of identical continuations).
    ps = prompts[:8]
    batched = generate(model, ps, stop_ids={}, max_new_tokens=24, pad_id=0)
    same = sum(b.token_ids == generate(model, [p], stop_ids={}, max_new_tokens=24, pad_id=0)[0].token_ids
               for p, b in zip(ps, batched))
    res["bf16_batched_equals_unbatched"] = f"{same}/{len(ps)}"

    # Boundary capture with plain hooks vs output_hidden_states, and its speed vs a raw forward.
    ids, mask, pos = left_pad(prompts, 0, dev)
    blocks = get_blocks(model)
    got: dict[int, torch.Tensor] = {}

    def hook(i):
        def fn(_m, _inp, out):
            h = out[0] if isinstance(out, tuple) else out
            got[i] = h[:, -1].detach().clone()
        return fn

    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states
        hs = [blk.register_forward_hook(hook(i)) for i, blk in enumerate(blocks)]
        try:
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
        finally:
            for h in hs:
                h.remove()
        # hidden_states[i+1] is block i's output, except the last, which HF returns after the final norm.
        err = max(((got[i].float() - ref[i + 1][:, -1].float()).norm() / ref[i + 1][:, -1].float().norm()).item()
                  for i in range(len(blocks) - 1))
    res["hooks_vs_hidden_states_max_rel_err_bf16"] = err
    if err > 1e-2:
        failures.append(f"hook capture differs from hidden_states by {err}")

    def raw():
        with torch.inference_mode():
            model.model(input_ids=ids, attention_mask=mask, position_ids=pos)

    def hooked():
        hs = [blk.register_forward_hook(hook(i)) for i, blk in enumerate(blocks)]
        try:
            with torch.inference_mode():
                model.model(input_ids=ids, attention_mask=mask, position_ids=pos)
        finally:
            for h in hs:
                h.remove()

    t_raw, t_hook = timed(raw), timed(hooked)
    n_tok = int(mask.sum())
    res["caching"] = {"raw_tok_s": n_tok / t_raw, "hooks_tok_s": n_tok / t_hook, "ratio": t_raw / t_hook}

    try:
        from mechprobe.steering import vector as steering

        vec = torch.randn(cfg.hidden_size, generator=g).to(dev)
        base = generate(model, prompts[:4], stop_ids={}, max_new_tokens=16, pad_id=0)
        sv = steering.SteeringVector(vector=vec, layer=len(blocks) // 2, kind="random")
        with steering.steer(model, sv, alpha=0.0, positions="boundary+generated", unit="raw"):
            zero = generate(model, prompts[:4], stop_ids={}, max_new_tokens=16, pad_id=0)
        res["steer_alpha0_equal"] = all(x.token_ids == y.token_ids for x, y in zip(base, zero))
        if not res["steer_alpha0_equal"]:
            failures.append("alpha 0 steering changed tokens")
        def steered():
            with steering.steer(model, sv, alpha=4.0, positions="boundary+generated", unit="raw"):
                generate(model, prompts[:8], stop_ids={}, max_new_tokens=new, pad_id=0)
        def plain():
            generate(model, prompts[:8], stop_ids={}, max_new_tokens=new, pad_id=0)
        res["steered_generation_time_ratio"] = timed(steered) / timed(plain)
    except (ImportError, AttributeError, TypeError) as e:
        res["steering"] = f"not checked: {e}"

    # Shared prefill: one item's greedy row and 4 samples (the main job's plan), 8 items of ~400-token
    # prompts, one batch of 40 rows; same tokens either way (checked), time ratio reported.
    long_prompts = [torch.randint(100, cfg.vocab_size, (n,), generator=g).tolist()
                    for n in torch.randint(300, 500, (8,), generator=g).tolist()]
    rows = [p for p in long_prompts for _ in range(5)]
    temps = [0.0 if j == 0 else 1.0 for _ in long_prompts for j in range(5)]
    seeds = [None if j == 0 else 10 * i + j for i in range(len(long_prompts)) for j in range(5)]
    outs = {}

    def user_stage(share):
        def fn():
            outs[share] = [x.token_ids for x in generate(model, rows, stop_ids={}, max_new_tokens=48,
                                                         temperatures=temps, seeds=seeds, pad_id=0,
                                                         share_prefill=share)]
        return fn

    t_sep, t_shared = timed(user_stage(False)), timed(user_stage(True))
    # In bf16 a different prefill batch size picks different GEMM kernels, so near-tied logits of a
    # random-init model can flip, as they do between batched and unbatched decoding above.
    same = [outs[True][i] == outs[False][i] for i in range(len(rows))]
    res["shared_prefill"] = {"rows": len(rows), "separate_s": t_sep, "shared_s": t_shared,
                             "speedup": t_sep / t_shared,
                             "greedy_rows_equal_bf16": f"{sum(same[0::5])}/{len(same[0::5])}",
                             "all_rows_equal_bf16": f"{sum(same)}/{len(same)}"}
    with torch.autocast("cuda", enabled=False):
        model32 = model.float()
        t32 = {}
        for share in (False, True):
            user_stage(share)()
            t32[share] = outs[share]
        res["shared_prefill"]["all_rows_equal_fp32"] = f"{sum(a == b for a, b in zip(t32[True], t32[False]))}/{len(rows)}"
        model = model32.to(torch.bfloat16)

    res["failures"] = failures
    print(f"GPU {res['gpu']}, torch {res['torch']}, transformers {res['transformers']}, {a.arch} "
          f"{res['params_M']}M params random-init, {res['device']} {res['dtype']}")
    print("| batch | mechprobe tok/s | HF generate tok/s | HF time / ours |\n|---|---|---|---|")
    for bs, r in gen_rows.items():
        print(f"| {bs} | {r['mechprobe_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['ratio']:.2f} |")
    print(json.dumps({k: v for k, v in res.items() if k != "generation"}, indent=1, default=str))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    return 1 if failures else 0


def _load_without_tokenizer(d: str, device_map: str | None = None):
    """``load_model``'s placement logic for a directory without a tokenizer (random-init checkpoints)."""
    from transformers import AutoModelForCausalLM

    from mechprobe.lm.device import default_device, default_dtype

    dev = default_device()
    kw = {"dtype": default_dtype(dev)}
    if device_map:
        kw["device_map"] = device_map
    m = AutoModelForCausalLM.from_pretrained(d, **kw)
    if not device_map:
        m = m.to(dev)
    return m.eval()


if __name__ == "__main__":
    raise SystemExit(main())
