"""Redraw a post-training evaluation figure from its committed summary (no runs needed).

    python scripts/plot_post_train_eval.py reports/post_train/qwen2.5-coder-0.5b-instruct_eval_summary.json
    python scripts/plot_post_train_eval.py reports/post_train/qwen2.5-coder-0.5b-instruct_dpo_eval_summary.json

Reads ``<model>[_dpo]_eval_summary.json`` (what ``experiments/post_train.py`` writes as ``eval_summary*.json``)
and writes ``figures/post_train_eval[_dpo]_<model>.png`` with :func:`mechprobe.plots.post_train.plot_eval`, the
function the command itself draws with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mechprobe.plots.post_train import plot_eval

SUFFIX = "_eval_summary.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", nargs="+", type=Path, help="<model>[_dpo]_eval_summary.json")
    p.add_argument("--figures-dir", type=Path, default=Path("figures"))
    a = p.parse_args(argv)
    for path in a.summary:
        stem = path.name.removesuffix(SUFFIX)
        dpo = stem.endswith("_dpo")
        model = stem.removesuffix("_dpo")
        summary = json.loads(path.read_text())
        out = a.figures_dir / f"post_train_eval{'_dpo' if dpo else ''}_{model}.png"
        print(plot_eval(summary, summary.get("boundary_shift", {}), out, model, "DPO" if dpo else "post-trained"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
