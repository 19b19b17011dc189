"""``mechprobe`` command line: every subcommand in one place, each reading and writing a run directory.

    mechprobe probe --dataset gsm8k --out runs/smol-gsm8k      # generate assistant + user turns
    mechprobe judge RUN [--judge openai:MODEL]                  # label the user turns
    mechprobe cache RUN [--layers 0 6 12]                       # residual activations at the boundary
    mechprobe probes RUN                                        # linear probes per layer (experiments/linear_probe.py)
    mechprobe steer RUN --alpha 4                               # steering (experiments/steer.py, in a clone)
    mechprobe agreement A B                                     # agreement between two label sources
    mechprobe serve --model NAME                                # OpenAI-compatible server on loopback
    mechprobe models list | fetch NAME                          # embedded models

The run directory is the positional ``RUN`` of judge, cache, probes and steer (``--run`` still works where
it did). List flags take space-separated values or one comma string. ``python -m mechprobe`` is the same.
The argument definitions stay beside the code they configure (``add_*_args`` in each module); this module
only wires them, so a reader finds every command here.

Errors: a :class:`~mechprobe.errors.UserError` (bad flag, missing file, mismatched run) prints one line and
exits 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from .errors import UsageError, UserError

# Any decimal or scientific number (-1, -.5, -1e308, -2.5E-3): argparse before Python 3.12 takes only -1 and -0.5
# for numbers, so `--alpha 0 -1e308` read -1e308 as an unknown flag.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def accept_negative_numbers(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let numeric list flags take negative numbers in any notation; also for ``p``'s subcommands."""
    p._negative_number_matcher = _NEGATIVE_NUMBER  # noqa: SLF001 - argparse has no public hook for this
    for action in p._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
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


def _probe(a: argparse.Namespace) -> int:
    from .pipeline import config_from_args, default_run_dir, run_probe, summarize_run

    cfg = config_from_args(a)
    out = Path(a.out) if a.out else default_run_dir(cfg)
    run_probe(cfg, out)
    print(f"\nrun: {out}\n")
    print(summarize_run(out))
    return 0


def _run_positional(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_pos", nargs="?", default=None, metavar="RUN", help="run directory (same as --run)")


def _merge_run(a: argparse.Namespace, dest: str = "run") -> None:
    """Positional RUN and ``--run`` name the same thing: accept either, refuse two different ones."""
    pos = getattr(a, "run_pos", None)
    if pos is None:
        return
    given = getattr(a, dest, None)
    if given is not None and Path(given) != Path(pos):
        raise UsageError(f"two run directories given ({pos} and --{dest} {given}): pass one")
    setattr(a, dest, pos)


def _probes(a: argparse.Namespace) -> int:
    from .probes import run_probes_cli

    _merge_run(a)
    return run_probes_cli(a)


def steer_script() -> Path:
    """``experiments/steer.py`` of the clone this package is imported from."""
    return Path(__file__).resolve().parents[1] / "experiments" / "steer.py"


def _load_steer() -> ModuleType:
    path = steer_script()
    if not path.exists():
        raise UsageError(f"`mechprobe steer` runs {path}, which only exists in a clone of the repository: "
                         "run it from a clone (pip install -e .)")
    spec = importlib.util.spec_from_file_location("mechprobe_experiment_steer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _steer(argv: list[str]) -> int:
    """Delegate to the experiment's ``main``; a leading positional RUN becomes ``--run RUN``."""
    if argv and not argv[0].startswith("-"):
        if "--run" in argv[1:]:
            raise UsageError(f"two run directories given ({argv[0]} and --run): pass one")
        argv = ["--run", argv[0], *argv[1:]]
    return int(_load_steer().main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    from .activations import add_cache_args, run_cache_cli
    from .agreement import add_agreement_args, run_agreement_cli
    from .judge import add_judge_args, run_judge_cli
    from .models import add_models_args, run_models_cli
    from .pipeline import add_probe_args
    from .probes import add_probes_args
    from .server import add_serve_args, run_serve_cli

    p = argparse.ArgumentParser(prog="mechprobe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("probe", help="generate assistant + user turns into a run directory")
    add_probe_args(pr)
    pr.add_argument("--out", default=None, help="run directory (default runs/<model>-<dataset>)")
    pr.set_defaults(func=_probe)

    j = sub.add_parser("judge", help="label every user turn of a run (labels.jsonl)")
    add_judge_args(j)
    j.set_defaults(func=run_judge_cli)

    c = sub.add_parser("cache", help="cache residual activations at the user-role boundary")
    add_cache_args(c)
    c.set_defaults(func=run_cache_cli)

    lp = sub.add_parser("probes", help="linear probes per layer on the cached activations (+ controls)")
    _run_positional(lp)
    add_probes_args(lp)
    lp.set_defaults(func=_probes)

    # Parsed by experiments/steer.py itself (see main): registered here for --help and the command list.
    sub.add_parser("steer", add_help=False, help="steering vectors and their effect (experiments/steer.py; "
                                                 "`mechprobe steer --help` for its flags)")

    ag = sub.add_parser("agreement", help="agreement between two label sources (kappa, confusion)")
    add_agreement_args(ag)
    ag.set_defaults(func=run_agreement_cli)

    sv = sub.add_parser("serve", help="serve a local model as an OpenAI-compatible endpoint on 127.0.0.1")
    add_serve_args(sv)
    sv.set_defaults(func=run_serve_cli)

    md = sub.add_parser("models", help="list embedded models, or fetch one's weights")
    add_models_args(md)
    md.set_defaults(func=run_models_cli)
    return accept_negative_numbers(p)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "steer":
        return friendly(lambda: _steer(argv[1:]))
    a = build_parser().parse_args(argv)
    return friendly(lambda: a.func(a))


if __name__ == "__main__":
    raise SystemExit(main())
