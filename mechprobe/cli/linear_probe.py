"""Linear probes per layer on the user-role boundary states of a run, with controls.

    mechprobe probes                                   # embedded default model: builds every missing stage
    mechprobe probes runs/smol-gsm8k --judge offline --layers all
    mechprobe probes --transfer-datasets mt_bench ifeval   # + a train-on-A / test-on-B matrix

python experiments/linear_probe.py takes the same flags. Without RUN the default run runs/<model>-<dataset> is
built or reused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mechprobe.cli import common
from mechprobe.errors import UserError
from mechprobe.linear.experiment import LinearProbeConfig, run_linear_probe
from mechprobe.turns.datasets import NAMES

HELP = "linear probes per layer on the cached activations (+ controls)"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the probes command's flags to ``p`` (also ``experiments/linear_probe.py``'s); every default is
    :class:`LinearProbeConfig`'s, so it is written once."""
    d = common.config_defaults(LinearProbeConfig)
    common.add_run(p, "run directory (default runs/<model>-<dataset>)", flag="--run")
    p.add_argument("--model", default=d["model"], help="default: the run's model, else the embedded default model")
    p.add_argument("--dataset", default=d["dataset"], help="default: gsm8k when ../shared/data is found, else builtin")
    p.add_argument("--datasets", nargs="+", default=d["datasets"],
                   help="several datasets: one run each (runs/<model>-<dataset>), propensity probes on the pooled "
                        "items with dataset-stratified folds and a transfer matrix across them (turn target: the "
                        "first is probed, the rest become --transfer-datasets)")
    p.add_argument("--target", default=d["target"], choices=["auto", "propensity", "turn"],
                   help="propensity: one row per item, target = fraction of its samples at "
                        "--propensity-temperature judged genuine (the boundary state is shared by all samples of "
                        "an item, so this is what it can predict); turn: one row per user turn. auto (default): "
                        "propensity when the run has >= 8 samples at that temperature, else turn")
    p.add_argument("--propensity-temperature", type=float, default=d["propensity_temperature"],
                   help="temperature whose samples define the propensity (default 1.0)")
    p.add_argument("--min-samples", type=int, default=d["min_samples"],
                   help="propensity target: drop items with fewer judged samples than this (judge errors skipped)")
    common.add_new_run(p)
    common.add_judge(p)
    p.add_argument("--layers", nargs="+", default=d["layers"],
                   help="all, or residual indices like 0 6 12 (or 0,6,12; 0 is always added): r = input of block r "
                        "(TransformerLens resid_pre), 0 = embeddings; steering-vectors/repeng/nnsight layer L = our L+1")
    p.add_argument("--relabel", action="store_true",
                   help="labels.jsonl is from another judge (or judge version): move it aside and relabel")
    p.add_argument("--backend", default=d["backend"], choices=["hooks", "nnsight", "transformer-lens"],
                   help="activation backend of the cache stage; all give the same numbers")
    g = p.add_argument_group("probe stage (only used when turns are missing)")
    g.add_argument("--limit", type=int, default=d["limit"],
                   help="items per run (default: 60 for the embedded default model; for other models 200 items in "
                        "all, split over --datasets; 0 = no limit: every item)")
    g.add_argument("--samples", type=int, default=d["samples"], help="samples per temperature > 0")
    g.add_argument("--temperatures", type=float, nargs="+", default=d["temperatures"], help="0 = greedy")
    g.add_argument("--max-assistant-tokens", type=int, default=d["max_assistant_tokens"], help="cap of each assistant answer (tokens)")
    g.add_argument("--max-user-tokens", type=int, default=d["max_user_tokens"], help="cap of each user turn (tokens)")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], help="rows per decode call")
    common.add_engine(g)
    common.add_dtype(g)
    g = p.add_argument_group("analysis")
    g.add_argument("--folds", type=int, default=d["folds"], help="grouped cross-validation folds (items never straddle two)")
    g.add_argument("--n-boot", type=int, default=d["n_boot"], help="item-bootstrap draws for the 95%% CIs")
    g.add_argument("--no-shuffled", action="store_true", help="skip the shuffled-label probe (halves probe time)")
    common.add_seed(g)
    g.add_argument("--transfer-datasets", nargs="*", default=d["transfer_datasets"],
                   help="also build runs of these datasets with the same config and report a transfer matrix")
    g.add_argument("--transfer-runs", nargs="*", default=d["transfer_runs"], help="existing runs (same model) for the transfer matrix")
    common.add_include_truncated(p)
    common.add_figures(p)


# Fewer item-bootstrap draws than this and the 2.5/97.5 percentiles are just the extreme draws.
MIN_BOOT = 20


def validate_probes_args(a: argparse.Namespace) -> None:
    """Refuse analysis options that would give NaN or meaningless numbers, before any stage runs."""

    bad = []
    if a.folds < 2:
        bad.append(f"--folds must be >= 2 (grouped cross-validation), got {a.folds}")
    if a.n_boot < MIN_BOOT:
        bad.append(f"--n-boot must be >= {MIN_BOOT} (item-bootstrap draws for the 95% CIs), got {a.n_boot}")
    unknown = [d for d in a.transfer_datasets if d not in NAMES]
    if unknown:
        bad.append(f"--transfer-datasets {unknown} unknown; choose from {', '.join(NAMES)}")
    not_runs = [r for r in getattr(a, "transfer_runs", None) or [] if not (Path(r) / "manifest.json").exists()]
    if not_runs:
        bad.append(f"--transfer-runs {not_runs} are not runs (no manifest.json): pass existing run directories")
    datasets = list(getattr(a, "datasets", None) or [])
    unknown = [d for d in datasets if d not in NAMES]
    if unknown:
        bad.append(f"--datasets {unknown} unknown; choose from {', '.join(NAMES)}")
    if len(set(datasets)) != len(datasets):
        bad.append(f"--datasets {datasets} names a dataset twice")
    if datasets and (a.run or a.dataset):
        bad.append("--datasets builds one run per dataset (runs/<model>-<dataset>): drop --run/--dataset, or pass "
                   "one --run with --transfer-runs")
    if getattr(a, "min_samples", 2) < 2:
        bad.append(f"--min-samples must be >= 2 (a propensity from one sample is a coin flip), got {a.min_samples}")
    t = getattr(a, "propensity_temperature", 1.0)
    if not (isinstance(t, int | float) and t > 0 and t == t and t != float("inf")):
        bad.append(f"--propensity-temperature must be a finite number > 0, got {t}")
    if bad:
        raise UserError("; ".join(bad))


def config_from_args(a: argparse.Namespace) -> LinearProbeConfig:
    """Validate the namespace and turn it into the experiment's typed config."""
    common.merge_run(a)
    validate_probes_args(a)
    return LinearProbeConfig.from_namespace(a)


def run(a: argparse.Namespace) -> int:
    """Run the probes and print their result (the summary on stdout, why nothing is reported on stderr)."""
    res = run_linear_probe(config_from_args(a))
    if res.summary:
        print(res.summary)
    if res.message:
        print(res.message, file=sys.stderr)
    return res.exit_code


def main(argv: list[str] | None = None) -> int:
    """``python experiments/linear_probe.py ...``: the same flags and code as ``mechprobe probes``; the exit code."""
    p = common.command_parser(add_args, __doc__)
    return common.friendly(lambda: run(p.parse_args(argv)), p)
