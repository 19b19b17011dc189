"""Cache residual activations at the user-role boundary of every user turn of a run (RUN/activations).

    mechprobe cache runs/smol-gsm8k --layers 0 6 12 --positions boundary assistant_last
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mechprobe.activations.backends import BACKENDS, CACHE_POSITIONS
from mechprobe.activations.cache import LAYERS_HELP, cache_run, run_model
from mechprobe.cli import common
from mechprobe.io import read_json
from mechprobe.lm.models import load_model

HELP = "cache residual activations at the user-role boundary"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the cache command's flags to ``p``."""
    common.add_run(p, "run directory (holds user_turns.jsonl)")
    p.add_argument("--backend", default="hooks", choices=list(BACKENDS),
                   help="hooks (fastest), nnsight, or transformer-lens; all give the same numbers")
    p.add_argument("--positions", nargs="+", default=["boundary"],
                   help=f"one or more of {', '.join(CACHE_POSITIONS)} (space-separated, or one comma string)")
    p.add_argument("--layers", nargs="+", default=["all"], help=LAYERS_HELP)
    p.add_argument("--store-dtype", "--dtype", dest="dtype", default="float16", choices=["float16", "float32", "bfloat16"],
                   help="storage dtype (float16: ~3e-4 relative round-off per vector)")
    p.add_argument("--batch-size", type=int, default=8, help="rows (user turns) per forward pass")
    p.add_argument("--model", default=None, help="default: the run's model (from its manifest)")
    common.add_device(p)
    common.add_no_progress(p)


def run(a: argparse.Namespace) -> int:
    """Cache the run's activations (extending a cache made with the same options); prints a one-line JSON summary."""
    run_dir = Path(a.run)
    lm = None
    if a.model:
        lm = load_model(a.model, device=a.device)
    elif a.device:
        lm = run_model(run_dir, device=a.device)
    out = cache_run(run_dir, lm, backend=a.backend, positions=a.positions, dtype=a.dtype, batch_size=a.batch_size,
                    layers=a.layers, progress=not getattr(a, "no_progress", False))
    meta = read_json(out / "manifest.json")
    print(json.dumps({"cache": str(out), "rows": meta["n_done"], "layers": len(meta["layers"]),
                      "positions": meta["positions"], "backend": meta["backend"], "dtype": meta["dtype"],
                      "repaired_shards": meta.get("repaired", [])}))
    return 0
