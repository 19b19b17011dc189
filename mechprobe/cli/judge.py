"""Label every user turn of a run (labels.jsonl), reusing the labels already there.

    mechprobe judge runs/smol-gsm8k                        # the default judge (see --judge)
    mechprobe judge runs/smol-gsm8k --judge openai:MODEL   # an OpenAI-compatible endpoint (--base-url)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mechprobe.cli import common
from mechprobe.judges.run import LABELS_FILE, judge_run

HELP = "label every user turn of a run (labels.jsonl)"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the judge command's flags to ``p``."""
    common.add_run(p, "probe run directory (holds user_turns.jsonl and assistant.jsonl)")
    common.add_judge(p)
    p.add_argument("--base-url", default=None,
                   help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL, else api.openai.com)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="name of the environment variable holding the API key (keys never go on the "
                        "command line, where shell history and `ps` would keep them)")
    p.add_argument("--concurrency", type=int, default=None, help="parallel requests (LLM judge; default 4)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per request (LLM judge; default 60)")
    p.add_argument("--max-retries", type=int, default=None, help="retries on 429/5xx/timeouts (default 5)")
    p.add_argument("--cache-dir", default=None,
                   help="LLM judge cache (default: $MECHPROBE_CACHE/judge or ~/.cache/mechprobe/judge)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the LLM judge cache")
    p.add_argument("--labels", default=LABELS_FILE, help="labels file name inside RUN")
    p.add_argument("--limit", type=int, default=None, help="judge at most N new rows (0 = no limit, as on every command)")
    p.add_argument("--keep-errors", action="store_true", help="do not retry earlier judge_error rows")
    common.add_no_progress(p)


def run(a: argparse.Namespace) -> int:
    """Label the run and print the summary table; exit 2 when every judged turn is a judge error."""
    # Every judge option goes to the factory, which keeps those the judge's kind takes (the judge registry).
    opts: dict[str, Any] = {"base_url": a.base_url, "concurrency": a.concurrency, "timeout": a.timeout,
                            "max_retries": a.max_retries, "api_key": os.environ.get(a.api_key_env) or None,
                            "cache_dir": False if a.no_cache else a.cache_dir}
    s = judge_run(a.run, a.judge, labels_file=a.labels, retry_errors=not a.keep_errors, limit=a.limit or None,
                  progress=not a.no_progress, **opts)
    print(s.table())
    if s.n_errors and not s.n_labelled:
        print(f"mechprobe: error: every judged turn ({s.n_errors}) is a judge error "
              f"({'; '.join(f'{r} x{c}' for r, c in s.errors.items())}); nothing usable was labelled. Check the "
              f"endpoint, key and model; re-running retries the error rows", file=sys.stderr)
        return 2  # a problem the user fixes (endpoint, key, model), like every UserError
    return 0


def main(argv: list[str] | None = None) -> int:
    """``mechprobe judge`` with a parser of its own (``argv`` without the command name); returns the exit code."""
    p = common.command_parser(add_args, __doc__, "mechprobe judge")
    return common.friendly(lambda: run(p.parse_args(argv)), p)
