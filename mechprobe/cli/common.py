"""Flags, error handling and run-directory arguments shared by every command (each defined once)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from mechprobe.errors import UsageError, UserError

# Any decimal or scientific number (-1, -.5, -1e308, -2.5E-3): argparse before Python 3.12 takes only -1 and -0.5
# for numbers, so `--alpha 0 -1e308` read -1e308 as an unknown flag.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def accept_negative_numbers(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let numeric list flags take negative numbers in any notation; also for ``p``'s subcommands."""
    p._negative_number_matcher = _NEGATIVE_NUMBER  # argparse has no public hook for this
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                accept_negative_numbers(sp)
    return p


def friendly(fn: Callable[[], int | None]) -> int:
    """Run ``fn``; a :class:`UserError` becomes one line on stderr and exit code 2, anything else propagates."""
    try:
        return int(fn() or 0)
    except UserError as e:
        print(f"mechprobe: error: {e}", file=sys.stderr)
        return 2


def run_positional(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_pos", nargs="?", default=None, metavar="RUN", help="run directory (same as --run)")


def merge_run(a: argparse.Namespace, dest: str = "run") -> None:
    """Positional RUN and ``--run`` name the same thing: accept either, refuse two different ones."""
    pos = getattr(a, "run_pos", None)
    if pos is None:
        return
    given = getattr(a, dest, None)
    if given is not None and Path(given) != Path(pos):
        raise UsageError(f"two run directories given ({pos} and --{dest} {given}): pass one")
    setattr(a, dest, pos)


# ------------------------------------------------------------------ flags shared by several commands, defined once

JUDGE_HELP = ("offline | offline-lexical | hybrid:MODEL | hybrid2:MODEL | local:MODEL | openai:MODEL | auto (default). "
              "auto: openai:$MECHPROBE_JUDGE_MODEL when set; else the judge that already labelled the run; else "
              "offline for the embedded default model; else the best-validated judge this machine can run "
              "(hybrid2 on the 1.5B Qwen when fetched, else offline)")
DTYPES = ("float32", "bfloat16", "float16")


def add_judge(p: argparse.ArgumentParser | argparse._ArgumentGroup, required: bool = False) -> None:
    """``--judge``: one meaning everywhere; ``auto`` is resolved by :func:`mechprobe.judges.factory.default_judge`."""
    if required:
        p.add_argument("--judge", required=True, help=JUDGE_HELP.split(" | auto")[0])
    else:
        p.add_argument("--judge", default="auto", help=JUDGE_HELP)


def add_dtype(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
              help: str = "HF weights dtype (default: the run's own; for a new run fp32 on CPU, bf16 on CUDA)") -> None:
    """``--dtype``: the dtype the model's weights are loaded in (never a storage dtype: see ``--store-dtype``)."""
    p.add_argument("--dtype", default=default, choices=list(DTYPES), help=help)


def add_engine(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
               help: str = "generation engine: hf (exact, hookable), llamacpp (GGUF on CPU, docs/cpu_speed.md), "
                           "vllm (GPU)") -> None:
    """``--engine``: which runtime generates turns."""
    p.add_argument("--engine", default=default, choices=["hf", "llamacpp", "vllm"], help=help)


def add_model(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
              help: str = "embedded name, HF id/dir, or .gguf file") -> None:
    p.add_argument("--model", default=default, help=help)


def add_seed(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--seed", type=int, default=0)


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None) -> None:
    p.add_argument("--device", default=default, help="cpu | cuda | cuda:N (default: cuda when available)")


def add_figures(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None) -> None:
    p.add_argument("--figures", default=default,
                   help="folder for the figure (default: <run>/figures, inside the ignored run directory, so a run "
                        "never dirties the repo; pass --figures figures to publish into the committed folder)")


def add_data_path(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--data-path", default=None,
                   help="dataset file or folder laid out like shared/data (default: ../shared/data or $MECHPROBE_DATA_DIR)")


def add_no_progress(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_new_run(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--new``: building a run at an explicit ``--run`` must be asked for, so a mistyped path is refused."""
    p.add_argument("--new", action="store_true",
                   help="--run names a run to build (from nothing): without it a --run that is not a run yet is "
                        "refused, so a mistyped path does not start a full build; the default run is always built")


def add_include_truncated(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--include-truncated``: keep the user turns that follow a truncated assistant answer in the rates."""
    p.add_argument("--include-truncated", action="store_true",
                   help="keep user turns after an assistant answer that hit its token cap in the follow-up rates "
                        "(default: counted and left out; every table says 'k of n answers truncated, excluded')")
