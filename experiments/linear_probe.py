"""Linear probes on the user-role boundary state, layer by layer, with controls.

    python experiments/linear_probe.py                          # embedded default model, builds every stage
    python experiments/linear_probe.py --run runs/smol-gsm8k --judge offline --layers all

Runs (or reuses) probe -> judge -> cache, then writes ``<run>/probes/metrics.json``, ``metrics.md``,
``directions.safetensors`` (per-layer probe and difference-of-means directions, for steering) and
``figures/linear_probe_<run>.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from mechprobe.activations import ActivationCache, parse_layers
from mechprobe.cli import friendly
from mechprobe.io import read_json, read_jsonl, write_json
from mechprobe.models import DEFAULT_MODEL
from mechprobe.pipeline import default_run_dir
from mechprobe.plots import plot_layer_auroc
from mechprobe.probes import (
    InsufficientPositives,
    controls,
    directions,
    multiclass_confusion,
    probe_layers,
    results_table,
    to_jsonable,
    transfer_matrix,
)
from mechprobe.stages import Stages, probe_config

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dataset", default=None, help="default: gsm8k when ../shared/data is found, else builtin")
    p.add_argument("--run", default=None, help="run directory (default runs/<model>-<dataset>)")
    p.add_argument("--judge", default="offline", help="offline | openai:MODEL")
    p.add_argument("--layers", default="all", help="all, or residual indices like 0,6,12")
    p.add_argument("--backend", default="hooks", choices=["hooks", "nnsight", "transformer-lens"])
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--temperatures", type=float, nargs="+", default=None)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--figures", default=str(REPO / "figures"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    t0 = time.time()
    cfg = probe_config(a.model, a.dataset, limit=a.limit, samples=a.samples, temperatures=a.temperatures)
    run = Path(a.run) if a.run else default_run_dir(cfg)
    if (run / "manifest.json").exists() and a.run:
        # An existing run keeps its own configuration; only missing stages are built.
        ident = read_json(run / "manifest.json")["identity"]
        cfg = probe_config(ident["model"], ident["config"]["dataset"], **{
            k: v for k, v in ident["config"].items() if k not in ("model", "dataset")})
    st = Stages(run, cfg)
    print(f"run: {run}  (model {cfg.model}, dataset {cfg.dataset})")
    st.probe()
    summary = st.labels(a.judge)
    print(summary.table())
    st.cache(backend=a.backend)

    cache = ActivationCache.load(run)
    layers = parse_layers(a.layers, cache.meta["n_layers_model"])
    mask = cache.labeled_mask().numpy()
    y = cache.labels("genuine").numpy()[mask].astype(int)
    label_names = [lab for lab, m in zip(cache.labels("label"), mask) if m]
    groups = np.asarray(cache.item_ids)[mask]
    turns = {r["record_id"]: r for r in read_jsonl(run / "user_turns.jsonl")}
    assistants = {r["item_id"]: r for r in read_jsonl(run / "assistant.jsonl")}
    rids = [rid for rid, m in zip(cache.record_ids, mask) if m]
    greedy = np.asarray([turns[r]["decoding"] == "greedy" for r in rids])
    datasets = [turns[r]["dataset"] for r in rids]
    texts = [assistants[turns[r]["item_id"]]["prompt"] + "\n" + assistants[turns[r]["item_id"]]["response"]
             for r in rids]
    stack = np.stack([cache.resid(layer).numpy()[mask] for layer in layers], axis=1)
    out_dir = run / "probes"
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {"run": str(run), "model": cfg.model, "judge": summary.judge, "n_rows": int(len(y)),
            "n_positive": int(y.sum()), "n_items": int(len(set(groups))), "layers": layers}
    try:
        results, folds = probe_layers(stack, layers, y, groups, greedy, n_splits=a.folds, seed=a.seed)
    except InsufficientPositives as e:
        write_json(out_dir / "metrics.json", {**base, "status": "insufficient_positives", "reason": str(e)})
        print(f"\nNot reporting probe metrics: {e}", file=sys.stderr)
        return 3
    best = max(results, key=lambda r: r.logreg_auroc.value)
    ctrl = controls(stack, layers, best.layer, y, groups, folds, texts, seed=a.seed)
    bi = layers.index(best.layer)
    mc = multiclass_confusion(stack[:, bi], label_names, groups, folds, a.seed)
    tm = transfer_matrix(stack[:, bi], y, datasets, a.seed) if len(set(datasets)) > 1 else None
    from safetensors.numpy import save_file

    save_file(directions(stack, layers, y, a.seed), str(out_dir / "directions.safetensors"))
    write_json(out_dir / "directions.json", {"layers": layers, "model": cfg.model,
                                             "weight_hash": cache.meta["identity"]["weight_hash"],
                                             "n_pos": int(y.sum()), "n_neg": int(len(y) - y.sum()),
                                             "position": "boundary", "source_run": str(run)})
    metrics = {**base, "status": "ok", "best_layer": best.layer, "per_layer": to_jsonable(results),
               "controls": to_jsonable(ctrl), "multiclass_best_layer": mc, "transfer": tm,
               "stage_seconds": st.timings, "total_seconds": round(time.time() - t0, 1)}
    write_json(out_dir / "metrics.json", metrics)
    table = results_table(results, ctrl)
    (out_dir / "metrics.md").write_text(table + "\n")
    fig = plot_layer_auroc(results, ctrl, Path(a.figures) / f"linear_probe_{run.name}.png",
                           f"{cfg.model} · {cfg.dataset} · {len(y)} turns ({int(y.sum())} genuine) · judge {summary.judge}")
    print("\n" + table)
    print(f"\nbest layer {best.layer}: AUROC {best.logreg_auroc.fmt()}; "
          + "; ".join(f"{k} {v.fmt()}" for k, v in ctrl.items()))
    print(f"multi-class balanced accuracy at layer {best.layer}: {mc['balanced_accuracy']:.3f} "
          f"(chance {mc['chance_balanced_accuracy']:.3f})")
    print(f"wrote {out_dir}/metrics.json, metrics.md, directions.safetensors and {fig}")
    print(json.dumps({"stage_seconds": st.timings, "total_seconds": metrics["total_seconds"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(friendly(lambda: main()))
