"""Judges against blind labels: evaluate every judge per subject model, refit the text-fit judge, fit the trained one.

    mechprobe judges evaluate                               # the per-model kappa table (reports/judge/)
    mechprobe judges evaluate --fit                         # refit textfit: train items fit, dev items choose
    mechprobe judges features reports/labelled_turns        # the trained judge's features (0.5B model; resumable)
    mechprobe judges fit reports/labelled_turns             # its weights -> the package's trained_judge.json, fit.md
    mechprobe judges fit SET --weights my_weights.json      # elsewhere (TrainedJudge(MODEL, weights=PATH))

`mechprobe judge-eval` is the same command as `judges evaluate`.

The fit reads the dev split only; item-grouped cross-validation picks the regularisation and the threshold
(docs/judging.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mechprobe.cli import common, judge_eval
from mechprobe.judges.fit_trained import LabelledTurns, compute_features, fit_trained_judge

HELP = "judges vs blind labels: evaluate (per-model kappa table), features | fit (the trained judge)"
DEFAULT_SET = "reports/labelled_turns"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add ``features SET`` and ``fit SET [--weights PATH]`` to ``p``."""
    sub = p.add_subparsers(dest="judges_cmd", required=True, metavar="ACTION", title="actions")
    e = sub.add_parser("evaluate", help=judge_eval.HELP, description=common.plain(judge_eval.__doc__),
                       formatter_class=common.HelpFormatter)
    judge_eval.add_args(e)
    f = sub.add_parser("features", help="every labelled turn's judge features and offline verdict (resumable)",
                       description="Append to SET/features.jsonl the features and offline verdict of every turn "
                                   "that has none yet (loads the scoring model).",
                       formatter_class=common.HelpFormatter)
    t = sub.add_parser("fit", help="fit the weights on the dev split; write them and SET/fit.md",
                       description="Fit the trained judge on the dev split of SET (item-grouped CV picks C and the "
                                   "threshold) and write its weights and SET/fit.md.",
                       formatter_class=common.HelpFormatter)
    for sp in (f, t):
        sp.add_argument("set", nargs="?", default=DEFAULT_SET, metavar="SET",
                        help="labelled-turn set directory (turns.jsonl, labels/)")
    common.add_no_progress(f)
    t.add_argument("--weights", default=None,
                   help="where the weights go (default: the package's own trained_judge.json, what "
                        "--judge trained:MODEL loads)")


def run(a: argparse.Namespace) -> int:
    """Evaluate the judges, compute the trained judge's features, or fit it and print the fit report."""
    if a.judges_cmd == "evaluate":
        return judge_eval.run(a)
    turns = LabelledTurns(Path(a.set)).check()
    if a.judges_cmd == "features":
        n = compute_features(turns, progress=not a.no_progress)
        print(f"{n} turns' features written to {turns.features_file}")
        return 0
    fit = fit_trained_judge(turns, a.weights)
    print(fit.report)
    print(f"weights: {fit.weights_path}\nreport: {fit.report_path}")
    return 0
