"""Generate assistant and user turns into a run directory (the user-turn probe).

    mechprobe probe runs/smol-gsm8k --dataset gsm8k --limit 50     # = python experiments/probe.py ... --out RUN
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mechprobe.cli import common
from mechprobe.lm.registry import DEFAULT_MODEL
from mechprobe.turns.pipeline import ProbeConfig, default_run_dir, run_probe, summarize_run

HELP = "generate assistant + user turns into a run directory"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the probe command's flags to ``p``."""
    common.add_run(p, "run directory to write (default runs/<model>-<dataset>)", flag="--out")
    common.add_model(p, DEFAULT_MODEL)
    p.add_argument("--dataset", default="builtin",
                   help="builtin | gsm8k | math500 | ifeval | mt_bench | hh_rlhf | topical_chat")
    common.add_data_path(p)
    p.add_argument("--limit", type=int, default=50, help="first N items (0 = no limit: every item)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    p.add_argument("--samples", type=int, default=3, help="samples per temperature > 0")
    p.add_argument("--max-assistant-tokens", type=int, default=256, help="cap of each assistant answer (tokens)")
    p.add_argument("--max-user-tokens", type=int, default=64, help="cap of each user turn (tokens)")
    common.add_seed(p)
    p.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    p.add_argument("--chat-template", default=None, help="Jinja template file, for models without one")
    p.add_argument("--batch-size", type=common.batch_size_arg, default=None, metavar="N|auto",
                   help="rows per decode call (default auto: as many as fit in half the free memory, <= 64)")
    common.add_device(p)
    common.add_dtype(p, help="HF weights dtype (default: fp32 on CPU, bf16 on CUDA)")
    common.add_engine(p, default="hf",
                   help="hf: exact and hookable (default); vllm: GPU throughput for large sampling runs; "
                        "llamacpp: GGUF models on CPU, several times faster (pip install llama-cpp-python)")


def config_from_args(a: Any) -> ProbeConfig:
    """The probe's typed config from parsed flags."""
    return ProbeConfig(model=a.model, dataset=a.dataset, data_path=a.data_path, limit=a.limit or None,
                       temperatures=list(a.temperatures), samples=a.samples,
                       max_assistant_tokens=a.max_assistant_tokens, max_user_tokens=a.max_user_tokens,
                       seed=a.seed, system=a.system, chat_template=a.chat_template, batch_size=a.batch_size,
                       device=a.device, dtype=a.dtype, engine=a.engine)


def run(a: argparse.Namespace) -> int:
    """Generate the run (reusing what exists), then print its directory and summary."""
    common.merge_run(a, "out")
    cfg = config_from_args(a)
    out = Path(a.out) if a.out else default_run_dir(cfg)
    run_probe(cfg, out)
    print(f"\nrun: {out}\n")
    print(summarize_run(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python experiments/probe.py ...``: the same flags and code as ``mechprobe probe``; returns the exit code."""
    p = common.command_parser(add_args, __doc__)
    return common.friendly(lambda: run(p.parse_args(argv)), p)
