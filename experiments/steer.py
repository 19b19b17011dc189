"""Steering vectors that raise genuine follow-ups under greedy decoding, with controls.

    python experiments/steer.py --alpha 4                       # embedded default, builds missing stages
    python experiments/steer.py --run runs/smol-gsm8k --layer 12 --alpha 0 1 2 4 8 --positions boundary+generated

Writes ``<run>/steering/alpha_<a>_<kind>.jsonl`` (greedy held-out user turns under steering, judged),
``results.json`` / ``results.md`` and ``<run>/figures/steer_<run>.png``. ``alpha`` multiplies the raw
difference-of-means vector (CAA convention; see docs/steering.md).

An existing ``--run`` is resolved exactly like ``experiments/linear_probe.py`` does it
(:func:`mechprobe.stages.resolve_run`): its own data file, item count, system prompt and token caps,
so nothing is added to it and alpha 0 reproduces its greedy turns.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.activations import ActivationCache  # noqa: E402
from mechprobe.cli import friendly  # noqa: E402
from mechprobe.errors import UserError  # noqa: E402
from mechprobe.io import JsonlStore, read_json, read_jsonl, write_json  # noqa: E402
from mechprobe.judge import JudgeInput, make_judge  # noqa: E402
from mechprobe.plots import plot_steering  # noqa: E402
from mechprobe.probes import figures_dir  # noqa: E402
from mechprobe.records import AssistantRecord  # noqa: E402
from mechprobe.stages import Stages, ensure_stages, resolve_run  # noqa: E402
from mechprobe.steer_eval import SteeredTurn, assistant_accuracy, split_of, steered_user_turns, summarize  # noqa: E402
from mechprobe.steering import SteeringVector, diff_of_means, from_direction  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the run's model, else the embedded default model")
    p.add_argument("--dataset", default=None, help="default: the run's dataset, else the main job's")
    p.add_argument("--run", default=None, help="run directory (default runs/<model>-<dataset>)")
    p.add_argument("--judge", default="offline")
    p.add_argument("--engine", default=None, choices=["hf", "llamacpp", "vllm"],
                   help="engine for the probe stage when the run must be built (steering itself runs on HF)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="HF weights dtype when the run must be built (default: the run's own)")
    p.add_argument("--layer", type=int, default=None, help="residual index; default: chosen on train items")
    p.add_argument("--candidate-layers", type=int, nargs="+", default=None,
                   help="layers swept on train items (default: top probe layers, else L/3, L/2, 2L/3)")
    p.add_argument("--alpha", type=float, nargs="+", default=[4.0])
    p.add_argument("--positions", default="boundary+generated",
                   choices=["boundary", "generated", "boundary+generated", "all"])
    p.add_argument("--kinds", default="diff_means,random,negative,probe")
    p.add_argument("--max-user-tokens", type=int, default=None,
                   help="cap of the steered user turns (default: the run's own, so alpha 0 reproduces it)")
    p.add_argument("--max-heldout", type=int, default=None, help="cap held-out items (speed)")
    p.add_argument("--no-assistant-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--figures", default=None,
                   help="folder for the figure (default: <run>/figures; --figures figures publishes into the repo)")
    return p


def judge_turns(judge, turns: list[SteeredTurn], by_item: dict[str, AssistantRecord], key: str) -> dict[str, str]:
    inputs = [JudgeInput(record_id=f"{key}|{t.item_id}", prompt=by_item[t.item_id].prompt,
                         response=by_item[t.item_id].response, raw_text=t.raw_text, text=t.text,
                         stop_reason=t.stop_reason, dataset=by_item[t.item_id].dataset, decoding="greedy",
                         item_id=t.item_id) for t in turns]
    return {r.record_id: r.label for r in judge.label_many(inputs)}


KINDS = ("diff_means", "random", "negative", "probe")


def validate_args(a: argparse.Namespace) -> None:
    """Refuse options that would run and give meaningless numbers, before any stage runs."""
    bad = [f"--alpha {x} is not a finite number" for x in a.alpha if not math.isfinite(x)]
    if a.max_user_tokens is not None and a.max_user_tokens < 1:
        bad.append(f"--max-user-tokens must be >= 1, got {a.max_user_tokens}")
    if a.max_heldout is not None and a.max_heldout < 1:
        bad.append(f"--max-heldout must be >= 1, got {a.max_heldout}")
    for la in ([a.layer] if a.layer is not None else []) + (a.candidate_layers or []):
        if la < 0:
            bad.append(f"layer {la} < 0: layers are residual indices 0..n_layers")
    unknown = sorted(set(a.kinds.split(",")) - set(KINDS))
    if unknown:
        bad.append(f"--kinds {unknown} unknown; choose from {','.join(KINDS)}")
    if bad:
        raise UserError("; ".join(bad))


def run_condition(lm, judge, vec, alpha, a, heldout, by_item, out_dir, system=None) -> tuple[dict, list[SteeredTurn]]:
    kind = vec.kind if (vec is not None and alpha != 0) else "none"
    key = f"{kind}|a{alpha:g}"
    path = out_dir / f"alpha_{alpha:g}_{kind}.jsonl"
    store = JsonlStore(path, key="item_id")
    done = {r["item_id"]: r for r in read_jsonl(path, key="item_id")}
    todo = [x for x in heldout if x.item_id not in done]
    if todo:
        turns = steered_user_turns(lm, todo, vec if alpha != 0 else None, alpha, a.positions, a.max_user_tokens,
                                   system=system)
        labels = judge_turns(judge, turns, by_item, key)
        for t in turns:
            store.append({**asdict(t), "label": labels.get(f"{key}|{t.item_id}")})
    rows = [r for r in read_jsonl(path, key="item_id") if r["item_id"] in {x.item_id for x in heldout}]
    turns = [SteeredTurn(**{k: v for k, v in r.items() if k != "label"}) for r in rows]
    labels = {f"{key}|{r['item_id']}": r["label"] for r in rows}
    res = summarize(turns, labels, key)
    return {"kind": kind, "alpha": alpha, **res}, turns


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    t0 = time.time()
    validate_args(a)
    run, cfg = resolve_run(a.run, a.model, a.dataset, engine=a.engine, dtype=a.dtype)
    st = Stages(run, cfg)
    ensure_stages(run, cfg, a.judge, stages=st)
    if a.max_user_tokens is None:
        a.max_user_tokens = cfg.max_user_tokens
    elif a.max_user_tokens != cfg.max_user_tokens:
        print(f"note: --max-user-tokens {a.max_user_tokens} differs from the run's {cfg.max_user_tokens}: alpha 0 "
              "will not reproduce the run's own turns")
    lm = st.model()
    judge = make_judge(a.judge)

    cache = ActivationCache.load(run)
    mask = cache.labeled_mask()
    y = cache.labels("genuine")
    train_rows = torch.tensor([split_of(i) == "train" for i in cache.item_ids]) & mask
    pos_rows, neg_rows = train_rows & (y == 1), train_rows & (y == 0)
    print(f"train rows: {int(pos_rows.sum())} genuine / {int(neg_rows.sum())} not (vectors are built from these)")
    if int(pos_rows.sum()) < 2:
        raise UserError(f"only {int(pos_rows.sum())} genuine follow-ups among train rows of {run}: a difference of "
                        f"means needs at least 2. Add items to the run first, e.g. `python experiments/linear_probe.py "
                        f"--run {run} --limit {2 * len(set(cache.item_ids))}` (more samples per item need a new run: "
                        f"`python experiments/linear_probe.py --run NEW_DIR --samples {2 * cfg.samples}`), then re-run "
                        f"this script with that --run")

    assistants = [AssistantRecord.from_dict(r) for r in read_jsonl(run / "assistant.jsonl", key="item_id")]
    by_item = {x.item_id: x for x in assistants}
    train_items = [x for x in assistants if split_of(x.item_id) == "train"]
    heldout = [x for x in assistants if split_of(x.item_id) == "heldout"][: a.max_heldout]
    out_dir = run / "steering"
    out_dir.mkdir(parents=True, exist_ok=True)

    def vec_at(layer: int) -> SteeringVector:
        x = cache.resid(layer)
        return diff_of_means(x[pos_rows], x[neg_rows], layer, weight_hash=cache.meta["identity"]["weight_hash"],
                             source_run=str(run), position="boundary")

    # Layer choice on train items only.
    n_layers = cache.meta["n_layers_model"]
    too_deep = [la for la in [a.layer, *(a.candidate_layers or [])] if la is not None and la > n_layers]
    if too_deep:
        raise UserError(f"layers {too_deep} exceed the model's {n_layers} blocks (residual indices 0..{n_layers})")
    if a.layer is not None:
        layer, sweep = a.layer, []
    else:
        cands = a.candidate_layers
        metrics_path = run / "probes" / "metrics.json"
        if cands is None and metrics_path.exists() and read_json(metrics_path).get("status") == "ok":
            per = read_json(metrics_path)["per_layer"]
            cands = [r["layer"] for r in sorted(per, key=lambda r: -r["logreg_auroc"]["value"]) if r["layer"] > 0][:3]
        cands = cands or [n_layers // 3, n_layers // 2, 2 * n_layers // 3]
        alpha_sel = max(a.alpha)
        sweep = []
        for cand in cands:
            v = vec_at(cand)
            turns = steered_user_turns(lm, train_items, v, alpha_sel, a.positions, a.max_user_tokens,
                                       system=cfg.system)
            key = f"sweep|L{cand}"
            labels = judge_turns(judge, turns, by_item, key)
            s = summarize(turns, labels, key)
            sweep.append({"layer": cand, "alpha": alpha_sel, **s})
            print(f"  train sweep layer {cand} alpha {alpha_sel:g}: follow-up {s['followup_rate']:.3f} "
                  f"degenerate {s['degenerate_rate']:.3f}")
        layer = max(sweep, key=lambda r: (r["followup_rate"], -r["degenerate_rate"]))["layer"]
    v = vec_at(layer)
    v.save(out_dir / f"vector_L{layer}_diff_means")
    print(v.describe())

    kinds = a.kinds.split(",")
    vectors: list[SteeringVector] = []
    if "diff_means" in kinds:
        vectors.append(v)
    if "random" in kinds:
        vectors.append(v.random_like(a.seed))
    if "negative" in kinds:
        vectors.append(v.negated())
    dpath = run / "probes" / "directions.safetensors"
    if "probe" in kinds and dpath.exists():
        from safetensors.torch import load_file

        d = load_file(str(dpath))
        if f"probe_{layer}" in d:
            vectors.append(from_direction(d[f"probe_{layer}"], v, kind="probe"))

    rows = []
    base, _ = run_condition(lm, judge, None, 0.0, a, heldout, by_item, out_dir, cfg.system)
    for vec in vectors:
        rows.append({**base, "kind": vec.kind})
        for alpha in sorted(set(a.alpha) - {0.0}):
            r, _ = run_condition(lm, judge, vec, alpha, a, heldout, by_item, out_dir, cfg.system)
            rows.append(r)
    acc = None
    if not a.no_assistant_check:
        n = min(len(heldout), 24)
        acc = {"unsteered": assistant_accuracy(lm, heldout[:n], None, 0.0, cfg.max_assistant_tokens,
                                               system=cfg.system),
               f"diff_means_alpha_{max(a.alpha):g}": assistant_accuracy(lm, heldout[:n], v, max(a.alpha),
                                                                      cfg.max_assistant_tokens, system=cfg.system),
               "n_items": n, "positions": "all"}
    lines = [f"layer {layer}, positions {a.positions}, {len(heldout)} held-out items, judge {judge.name}; "
             f"{v.describe()}", "",
             "| vector | alpha | genuine follow-up [95% CI] | degenerate | mean NLL | labels |", "|---|---|---|---|---|---|"]
    for r in rows:
        nll = f"{r['mean_nll']:.2f}" if r["mean_nll"] is not None else "n/a"
        labs = ", ".join(f"{k} {c}" for k, c in sorted(r["labels"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['kind']} | {r['alpha']:g} | {r['followup_rate']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] "
                     f"| {r['degenerate_rate']:.3f} | {nll} | {labs} |")
    if acc:
        lines += ["", f"assistant task accuracy with the vector on at every position ({acc['n_items']} held-out items): "
                  + json.dumps({k: val for k, val in acc.items() if k not in ('n_items', 'positions')})]
    table = "\n".join(lines)
    (out_dir / "results.md").write_text(table + "\n")
    write_json(out_dir / "results.json", {"layer": layer, "positions": a.positions, "vector": v.describe(),
                                          "vector_meta": v.meta, "sweep_train": sweep, "heldout": rows,
                                          "assistant_accuracy": acc, "judge": judge.name,
                                          "seconds": round(time.time() - t0, 1)})
    fig = plot_steering(rows, figures_dir(a.figures, run) / f"steer_{run.name}.png",
                        f"{cfg.model} · layer {layer} · {a.positions} · {len(heldout)} held-out items")
    print("\n" + table + f"\n\nwrote {out_dir}/results.md, results.json and {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(friendly(lambda: main()))
