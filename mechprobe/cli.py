"""``mechprobe`` command line: one subcommand per stage, each reading and writing a run directory."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from .chat import ChatTemplateError
from .errors import UserError
from .io import ManifestMismatch
from .models import ModelLoadError

# Errors a user can fix: printed as one clear line, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ModelLoadError, ChatTemplateError, ManifestMismatch,
                                                FileNotFoundError, ValueError, KeyError)


def friendly(fn: Callable[[], int | None]) -> int:
    """Run ``fn`` and turn user-fixable errors into a one-line message and exit code 2."""
    try:
        return int(fn() or 0)
    except USER_ERRORS as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"mechprobe: error: {msg}", file=sys.stderr)
        return 2


def _probe(a: argparse.Namespace) -> int:
    from .pipeline import config_from_args, default_run_dir, run_probe, summarize_run

    cfg = config_from_args(a)
    out = Path(a.out) if a.out else default_run_dir(cfg)
    run_probe(cfg, out)
    print(f"\nrun: {out}\n")
    print(summarize_run(out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .pipeline import add_probe_args

    p = argparse.ArgumentParser(prog="mechprobe", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", help="generate assistant + user turns into a run directory")
    add_probe_args(pr)
    pr.add_argument("--out", default=None, help="run directory (default runs/<model>-<dataset>)")
    pr.set_defaults(func=_probe)
    _add_optional_stages(sub)
    return p


def _add_optional_stages(sub: argparse._SubParsersAction) -> None:
    """Stages whose modules add their own arguments (judge, cache)."""
    try:
        from .judge import add_judge_args, run_judge_cli

        j = sub.add_parser("judge", help="label every user turn of a run (labels.jsonl)")
        add_judge_args(j)
        j.set_defaults(func=run_judge_cli)
    except ImportError:
        pass
    try:
        from .activations import add_cache_args, run_cache_cli

        c = sub.add_parser("cache", help="cache residual activations at the user-role boundary")
        add_cache_args(c)
        c.set_defaults(func=run_cache_cli)
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    return friendly(lambda: a.func(a))


if __name__ == "__main__":
    raise SystemExit(main())
