"""`mechprobe cache RUN`: residual activations at the user-role boundary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mechprobe.activations.backends import BACKENDS, CACHE_POSITIONS
from mechprobe.activations.cache import LAYERS_HELP, _run_model, cache_run
from mechprobe.cli import common
from mechprobe.io import read_json
from mechprobe.lm.models import load_model


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mechprobe cache RUN_DIR``."""
    p.add_argument("run", help="run directory (holds user_turns.jsonl)")
    p.add_argument("--backend", default="hooks", choices=list(BACKENDS),
                   help="hooks (fastest), nnsight, or transformer-lens; all give the same numbers")
    p.add_argument("--positions", nargs="+", default=["boundary"],
                   help=f"one or more of {', '.join(CACHE_POSITIONS)} (space-separated, or one comma string)")
    p.add_argument("--layers", nargs="+", default=["all"], help=LAYERS_HELP)
    p.add_argument("--store-dtype", "--dtype", dest="dtype", default="float16", choices=["float16", "float32", "bfloat16"],
                   help="storage dtype (float16: ~3e-4 relative round-off per vector)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default=None, help="default: the run's model (from its manifest)")
    common.add_device(p)
    common.add_no_progress(p)


def run_cache_cli(a: argparse.Namespace) -> int:
    """Entry point of ``mechprobe cache``; prints a one-line JSON summary."""
    run = Path(a.run)
    lm = None
    if a.model:
        lm = load_model(a.model, device=a.device)
    elif a.device:
        lm = _run_model(run, device=a.device)
    out = cache_run(run, lm, backend=a.backend, positions=a.positions, dtype=a.dtype, batch_size=a.batch_size,
                    layers=a.layers, progress=not getattr(a, "no_progress", False))
    meta = read_json(out / "manifest.json")
    print(json.dumps({"cache": str(out), "rows": meta["n_done"], "layers": len(meta["layers"]),
                      "positions": meta["positions"], "backend": meta["backend"], "dtype": meta["dtype"],
                      "repaired_shards": meta.get("repaired", [])}))
    return 0
