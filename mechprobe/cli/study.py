"""The paper's studies over every embedded chat model, as one resumable command (docs/study.md).

    mechprobe study --quick              # few items, samples and temperatures
    mechprobe study --report-only        # regenerate the report and figures from the runs

python experiments/study.py takes the same flags.
"""

from __future__ import annotations

import argparse

from mechprobe.cli import common
from mechprobe.io import read_json
from mechprobe.judges.factory import default_judge
from mechprobe.study.data import PLAN
from mechprobe.study.run import (
    DATASETS,
    MODELS,
    PROFILES,
    StudyConfig,
    StudyResult,
    config_from_namespace,
    report,
    run_study,
)
from mechprobe.turns.perturb import VARIANTS

HELP = "the paper's studies over every embedded chat model (resumable)"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the study command's flags to ``p`` (also ``experiments/study.py``'s)."""
    p.add_argument("--models", nargs="+", default=None, help=f"default: {' '.join(MODELS)}")
    p.add_argument("--datasets", nargs="+", default=None, help=f"default: {' '.join(DATASETS)}")
    p.add_argument("--variants", nargs="+", default=None, help=f"default: {' '.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="few items, samples and temperatures (see docs/study.md)")
    p.add_argument("--report-only", action="store_true", help="regenerate the report and figures from the runs")
    common.add_judge(p)
    common.add_engine(p, default="hf")
    common.add_dtype(p, help="HF weights dtype (default: bfloat16 on a CPU with native bf16, AVX512-BF16/AMX: "
                                 "2-5x fp32, benchmarks/README.md; else the model's default)")
    p.add_argument("--limit", type=int, default=None, help="items per dataset (default: the profile's; 0 = no limit: every item)")
    p.add_argument("--samples", type=int, default=None, help="samples per temperature > 0 (default: the profile's)")
    p.add_argument("--variant-samples", type=int, default=None,
                   help="samples at T=1.0 per perturbation variant, beside its greedy turn (default: the profile's: "
                        "1 full, 2 quick; a resumed root keeps its own)")
    p.add_argument("--temperatures", nargs="+", default=None, help="main-run temperatures (default: the profile's)")
    p.add_argument("--max-assistant-tokens", type=int, default=None, help="default: per model (see docs/study.md)")
    p.add_argument("--max-user-tokens", type=int, default=None, help="cap of each user turn (default: the profile's)")
    p.add_argument("--batch-size", type=common.batch_size_arg, default=None, metavar="N|auto",
                   help="rows per decode call (default auto: as many as fit in memory)")
    common.add_data_path(p)
    p.add_argument("--root", default=None, help="runs folder (default runs/study/<profile>)")
    p.add_argument("--report-dir", default="reports/study", help="where the study report goes")
    p.add_argument("--figures-dir", default="figures", help="where the study's figures go")
    common.add_include_truncated(p)
    common.add_no_progress(p)


def build_parser() -> argparse.ArgumentParser:
    """The study command's flags in a parser of its own (``python experiments/study.py``)."""
    return common.command_parser(add_args, __doc__)


def config_from_args(a: argparse.Namespace) -> StudyConfig:
    """The study's typed config from parsed flags; ``--judge auto`` keeps the judge of an existing study root."""
    sc = config_from_namespace(a)
    if a.judge in (None, "auto"):
        # The judge the existing runs were labelled by (plan.json), so a resumed study or --report-only keeps
        # reading the same labels; a new study root gets the best-validated judge available.
        plan = sc.root_dir() / PLAN
        sc.judge = (read_json(plan).get("judge") if plan.exists() else None) or default_judge()
    plan = sc.root_dir() / PLAN
    if a.variant_samples is None and plan.exists():
        # A root made before variant_samples was recorded ran its variants with `samples` (2): keep that, so
        # resuming it neither mixes plans nor regenerates finished variants.
        sc.variant_samples = read_json(plan).get("variant_samples", PROFILES[sc.profile].samples)
    return sc


def run(a: argparse.Namespace) -> int:
    """Run (or resume) the studies, or only regenerate the report; prints what it wrote."""
    sc = config_from_args(a)
    sc.validate()
    show(report(sc) if a.report_only else run_study(sc))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python experiments/study.py ...``: the same flags and code as ``mechprobe study``; returns the exit code."""
    p = build_parser()
    return common.friendly(lambda: run(p.parse_args(argv)), p)


def show(res: StudyResult) -> None:
    """The README written (models skipped and failures were printed as they happened, and are in the README)."""
    print(f"wrote {res.readme}")
