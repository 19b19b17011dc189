"""Judges against every committed blind-labelled set: the per-model table (kappa with item-clustered CIs, the
confusion, the positive rate each judge implies beside the labellers'), from committed labels and verdicts.

    mechprobe judges evaluate              # recompute reports/judge/ (verdicts, split, table.md, table.json)
    mechprobe judges evaluate --fit        # refit the textfit judge: train items fit, dev items choose
    mechprobe judges evaluate --speed 20   # also time textfit and the research default on 20 test turns
    mechprobe judges evaluate --hidden qwen2.5-coder-0.5b-instruct --fit-hidden   # fit the hidden-state judge
    mechprobe judges evaluate --hidden qwen2.5-coder-0.5b-instruct --fit-hidden --hidden-protocol pool
                                           # ... choosing by item-grouped CV over every labelled item but the tests

`mechprobe judge-eval` is the same command (its older name).

The labelled sets are listed in mechprobe.audit.blind_sets.SOURCES (a missing folder is skipped and named in
the report), so a new set of blind labels is one more entry and this one command recomputes the table. Items are
split train / dev / test by the query's hash (the same rule for every subject model); the test split is what the
table reports and never what a head is chosen on. Verdicts of judges that run a language model (hybrid,
trained) are read from the files committed beside the labels, not recomputed.
"""

from __future__ import annotations

import argparse

from mechprobe.cli import common
from mechprobe.errors import UsageError
from mechprobe.judges.hidden import FEATURE_KINDS
from mechprobe.judges.judge_eval import JudgeEvalConfig, run_judge_eval

HELP = "judges vs every committed blind-labelled set: per-model kappa table (reports/judge/)"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the judge-eval command's flags to ``p``."""
    d = common.config_defaults(JudgeEvalConfig)
    p.add_argument("--root", default=d["root"], help="the repository (its reports/ holds the labelled sets)")
    p.add_argument("--out", default=d["out"], help="report folder, relative to --root")
    p.add_argument("--fit", action="store_true",
                   help="refit the textfit heads (fit on train items, choose on dev items) and write --weights")
    p.add_argument("--weights", default=d["weights"],
                   help="textfit weights file (default: the package's mechprobe/data/textfit_judge.json)")
    p.add_argument("--cache", default=d["cache"], help="feature cache folder, relative to --root")
    p.add_argument("--splits", nargs="+", default=list(d["splits"]), choices=["train", "dev", "test"],
                   help="splits the table shows")
    p.add_argument("--n-boot", type=int, default=d["n_boot"], help="bootstrap draws per kappa interval")
    p.add_argument("--speed", type=int, default=d["speed_turns"], metavar="N",
                   help="time --speed-judges on N test turns and append to speed.jsonl (0 = do not time)")
    p.add_argument("--speed-judges", nargs="+", default=list(d["speed_judges"]), metavar="SPEC",
                   help="judge specs timed by --speed")
    p.add_argument("--speed-source", default=d["speed_source"], metavar="SOURCE",
                   help="time turns of this labelled set (a blind_sets.SOURCES name) instead of the test split's")
    p.add_argument("--speed-whole-answers", action="store_true",
                   help="time every turn of each answer together, as a run holds them (default: one turn per "
                        "answer, the worst case for a reader judge, which reads each answer once)")
    p.add_argument("--hidden", default=d["hidden"], metavar="MODEL",
                   help="also score the hidden-state judge read by MODEL (its verdicts in their own committed file)")
    p.add_argument("--fit-hidden", action="store_true",
                   help="(re)fit the hidden-state judge's heads on --hidden's reader: train items fit, dev choose")
    p.add_argument("--hidden-layers", nargs="+", type=int, default=list(d["hidden_layers"]), metavar="L",
                   help="residual indices --fit-hidden tries (default: every 4th from the middle layer to the last)")
    p.add_argument("--hidden-protocol", default=d["hidden_protocol"], choices=["split", "pool"],
                   help="how --fit-hidden chooses: split (train items fit, dev items choose) or pool (item-grouped "
                        "cross-validation over every labelled item outside the held-out fresh test sets)")
    p.add_argument("--hidden-features", default=d["hidden_features"], choices=list(FEATURE_KINDS),
                   help="the rows --fit-hidden reads: turn ([last token, turn mean] of the reader prompt) or "
                        "answer-contrast (those and their difference from the prompt read with the answer hidden)")


def run(a: argparse.Namespace) -> int:
    """Recompute the table (and refit or time when asked); print the report."""
    if a.n_boot < 1 or a.speed < 0:
        raise UsageError("--n-boot must be >= 1 and --speed >= 0")
    if a.fit_hidden and not a.hidden:
        raise UsageError("--fit-hidden needs --hidden MODEL (the reader whose hidden states the heads read)")
    cfg = JudgeEvalConfig(root=a.root, out=a.out, fit=a.fit, weights=a.weights, cache=a.cache,
                          splits=tuple(a.splits), n_boot=a.n_boot, speed_turns=a.speed,
                          speed_judges=tuple(a.speed_judges), speed_source=a.speed_source,
                          speed_whole_answers=a.speed_whole_answers, hidden=a.hidden, fit_hidden=a.fit_hidden,
                          hidden_layers=tuple(a.hidden_layers), hidden_protocol=a.hidden_protocol,
                          hidden_features=a.hidden_features)
    res = run_judge_eval(cfg)
    print(res.markdown)
    print("wrote " + ", ".join(str(p) for p in res.written))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``mechprobe judge-eval`` with a parser of its own (``argv`` without the command name)."""
    p = common.command_parser(add_args, __doc__, "mechprobe judge-eval")
    return common.friendly(lambda: run(p.parse_args(argv)), p)
