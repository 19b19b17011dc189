"""mechprobe: user-turn probe, judge, boundary activations, linear probes and steering, on run directories.

    mechprobe probe runs/smol-gsm8k --dataset gsm8k             # generate assistant + user turns
    mechprobe judge RUN [--judge openai:MODEL]                   # label the user turns
    mechprobe judges evaluate [--fit] | features | fit [SET]     # judges vs blind labels per model; fit judges
    mechprobe cache RUN [--layers 0 6 12]                        # residual activations at the boundary
    mechprobe probes RUN                                         # linear probes per layer
    mechprobe steer RUN --alpha 4                                # steering vectors, with controls
    mechprobe agreement A B                                      # agreement between two label sources
    mechprobe audit RUN --n 80 --by condition                    # blind audit sheet; --labels F.json: corrected rates
    mechprobe post-train --model NAME                            # LoRA SFT or DPO, then before/after evaluation
    mechprobe study [--quick]                                    # the paper's studies over every embedded model
    mechprobe relabel-steering RUN --judge SPEC                  # re-judge a steering run's turns
    mechprobe serve --model NAME                                 # OpenAI-compatible server on loopback
    mechprobe models list | fetch NAME                           # embedded models
    mechprobe findings [--check FILE ...]                        # the findings' numbers from committed files

RUN is the run directory, a positional in every command that takes one (--run still works where it did).
List flags take space-separated values or one comma string. python -m mechprobe is the same command line;
experiments/<command>.py runs the same code with the same flags. mechprobe COMMAND --help shows a command's flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

from mechprobe.cli import (
    agreement,
    audit,
    cache,
    common,
    findings,
    interventions,
    judge,
    judge_eval,
    judges,
    linear_probe,
    models,
    post_train,
    probe,
    relabel_steering,
    serve,
    steer,
    study,
)

# Command name -> its module (each has add_args, run and a one-line HELP). A hyphenated name also answers to its
# underscore spelling, the name of its experiments/ script.
COMMANDS: dict[str, ModuleType] = {
    "probe": probe, "judge": judge, "judges": judges, "cache": cache, "probes": linear_probe, "steer": steer,
    "agreement": agreement, "audit": audit, "post-train": post_train, "study": study,
    "relabel-steering": relabel_steering, "serve": serve, "models": models, "findings": findings,
    "interventions": interventions, "judge-eval": judge_eval,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``mechprobe`` parser: one subcommand per entry of :data:`COMMANDS`, each with its module's flags."""
    p = argparse.ArgumentParser(prog="mechprobe", description=common.plain(__doc__),
                                formatter_class=common.HelpFormatter, epilog=common.EXIT_CODES)
    p.add_argument("--version", action="version", version=f"mechprobe {common.package_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    for name, mod in COMMANDS.items():
        aliases = [name.replace("-", "_")] if "-" in name else []
        sp = sub.add_parser(name, aliases=aliases, help=mod.HELP, description=common.plain(mod.__doc__),
                            formatter_class=common.HelpFormatter, epilog=common.EXIT_CODES)
        mod.add_args(sp)
        sp.set_defaults(func=mod.run)
    return common.accept_negative_numbers(p)


def main(argv: list[str] | None = None) -> int:
    """The ``mechprobe`` script: parse ``argv``, run the command, return its exit code (see the help's epilog)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    p = build_parser()
    a = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    return common.friendly(lambda: a.func(a), common.command_of(p, a.cmd))


if __name__ == "__main__":
    raise SystemExit(main())
