"""Agreement between two label sources (Cohen's kappa, confusion matrix), or a judge on real vs swapped turns.

    mechprobe agreement runs/a runs/b                          # two runs' labels.jsonl
    mechprobe agreement FIXTURE offline --split test           # a judge run on the rows of a labelled fixture
    mechprobe agreement --human-reference hybrid-voice:MODEL --n 100
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mechprobe.cli import common
from mechprobe.errors import UsageError
from mechprobe.judges import human_reference
from mechprobe.judges.agreement import compare, is_judge_spec, judge_source, load_labels, report_markdown

HELP = "agreement between two label sources (kappa, confusion)"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the agreement command's flags to ``p``."""
    p.add_argument("a", nargs="?", metavar="A",
                   help="labels.jsonl, run dir, or model-written label fixture (the reference)")
    p.add_argument("b", nargs="?", metavar="B", help="labels.jsonl, run dir, fixture, or a judge spec (offline, "
                                        "offline-lexical, openai:MODEL, local:MODEL, hybrid:MODEL) to run on A's rows")
    p.add_argument("--human-reference", metavar="JUDGE", default=None,
                   help="instead of A/B: judge real vs swapped next human turns of HH-RLHF and Topical-Chat "
                        "conversations with JUDGE (docs/judge_agreement.md)")
    p.add_argument("--n", type=int, default=100, help="--human-reference: conversations per dataset")
    p.add_argument("--max-chars", type=int, default=1500,
                   help="--human-reference: skip conversations longer than this (prompt+reply+next turn)")
    p.add_argument("--judge-dtype", "--dtype", dest="dtype", default=None, choices=list(common.DTYPES),
                   help="local or hybrid judge weights dtype (default: bf16 on CPU)")
    p.add_argument("--few-shot", type=int, default=None, help="local judge: dev-split examples in the prompt")
    p.add_argument("--threshold", type=float, default=None,
                   help="hybrid judge: grounding-PMI threshold (default: the one chosen on the dev split)")
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument("--split", default=None, help="only rows of this split (dev|test) of a fixture")
    p.add_argument("--name-a", default=None, help="A's name in the report (default: from its path)")
    p.add_argument("--name-b", default=None, help="B's name in the report (default: from its path or judge)")
    p.add_argument("--title", default=None, help="the report's title")
    p.add_argument("--save-labels", default=None, help="when B is a judge: also write its labels here (JSONL)")
    p.add_argument("--base-url", default=None, help="LLM judge endpoint (default $OPENAI_BASE_URL)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the LLM judge's API key")
    p.add_argument("--concurrency", type=int, default=None, help="parallel requests of the LLM judge (default 4)")


def run(a: argparse.Namespace) -> int:
    """Compare the two sources of parsed arguments ``a`` and print (and optionally write) the report."""
    # Every judge option goes to the factory, which keeps those the judge's kind takes (the judge registry).
    opts = {"dtype": a.dtype, "few_shot": a.few_shot, "threshold": a.threshold}

    if a.human_reference:
        text, _ = human_reference.run(a.human_reference, n=a.n, save=a.save_labels, max_chars=a.max_chars,
                      **opts)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(text, encoding="utf-8")
        print(text)
        return 0
    if a.a is None or a.b is None:
        raise UsageError("pass two label sources A and B, or --human-reference JUDGE")
    src_a = load_labels(a.a, a.split, a.name_a)
    if is_judge_spec(a.b):
        if not src_a.rows or "raw_text" not in src_a.rows[0]:
            raise UsageError(f"B={a.b!r} is a judge, so A must hold self-contained rows (prompt, response, "
                             "raw_text): pass the model-written label fixture as A")
        src_b = judge_source(a.b, src_a.rows, save=a.save_labels, base_url=a.base_url,
                             api_key=os.environ.get(a.api_key_env) or None, concurrency=a.concurrency, **opts)
        if a.name_b:
            src_b.name = a.name_b
    else:
        src_b = load_labels(a.b, a.split, a.name_b)
    ag = compare(src_a, src_b, a.split)
    text = report_markdown(ag, a.title)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text, encoding="utf-8")
    print(text)
    return 0
