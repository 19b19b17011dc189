"""``mechprobe`` command line: every subcommand in one place, each reading and writing a run directory.

    mechprobe probe --dataset gsm8k --out runs/smol-gsm8k      # generate assistant + user turns
    mechprobe judge RUN [--judge openai:MODEL]                  # label the user turns
    mechprobe cache RUN [--layers 0 6 12]                       # residual activations at the boundary
    mechprobe probes RUN                                        # linear probes per layer (experiments/linear_probe.py)
    mechprobe steer RUN --alpha 4                               # steering vectors (experiments/steer.py)
    mechprobe agreement A B                                     # agreement between two label sources
    mechprobe audit RUN --n 80 --by condition                   # blind audit sheet; --labels F.json: corrected rates
    mechprobe serve --model NAME                                # OpenAI-compatible server on loopback
    mechprobe models list | fetch NAME                          # embedded models

The run directory is the positional ``RUN`` of judge, cache, probes and steer (``--run`` still works where
it did). List flags take space-separated values or one comma string. ``python -m mechprobe`` is the same.
Each command's flags live in its own module of :mod:`mechprobe.cli`; flags shared by several commands are
defined once in :mod:`mechprobe.cli.common`.

Errors: a :class:`~mechprobe.errors.UserError` (bad flag, missing file, mismatched run) prints one line and
exits 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mechprobe.cli import agreement, audit, cache, common, judge, linear_probe, models, probe, serve, steer
from mechprobe.cli.common import friendly, run_positional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mechprobe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("probe", help="generate assistant + user turns into a run directory")
    probe.add_probe_args(pr)
    pr.add_argument("--out", default=None, help="run directory (default runs/<model>-<dataset>)")
    pr.set_defaults(func=probe.run)

    j = sub.add_parser("judge", help="label every user turn of a run (labels.jsonl)")
    judge.add_judge_args(j)
    j.set_defaults(func=judge.run_judge_cli)

    c = sub.add_parser("cache", help="cache residual activations at the user-role boundary")
    cache.add_cache_args(c)
    c.set_defaults(func=cache.run_cache_cli)

    lp = sub.add_parser("probes", help="linear probes per layer on the cached activations (+ controls)")
    run_positional(lp)
    linear_probe.add_probes_args(lp)
    lp.set_defaults(func=linear_probe.run)

    # Parsed by mechprobe.cli.steer itself (see main): registered here for --help and the command list.
    sub.add_parser("steer", add_help=False, help="steering vectors and their effect, with controls "
                                                 "(`mechprobe steer --help` for its flags)")

    ag = sub.add_parser("agreement", help="agreement between two label sources (kappa, confusion)")
    agreement.add_agreement_args(ag)
    ag.set_defaults(func=agreement.run_agreement_cli)

    au = sub.add_parser("audit", help="blind audit of the judge: a sheet to label, then judge-only vs corrected rates")
    audit.add_args(au)
    au.set_defaults(func=audit.run)

    sv = sub.add_parser("serve", help="serve a local model as an OpenAI-compatible endpoint on 127.0.0.1")
    serve.add_serve_args(sv)
    sv.set_defaults(func=serve.run_serve_cli)

    md = sub.add_parser("models", help="list embedded models, or fetch one's weights")
    models.add_models_args(md)
    md.set_defaults(func=models.run_models_cli)
    return common.accept_negative_numbers(p)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "steer":
        return friendly(lambda: steer.main(argv[1:]))
    a = build_parser().parse_args(argv)
    return friendly(lambda: a.func(a))


if __name__ == "__main__":
    raise SystemExit(main())
