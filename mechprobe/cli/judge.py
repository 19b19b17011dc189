"""`mechprobe judge RUN`: label every user turn of a run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from mechprobe.cli import common
from mechprobe.errors import UserError
from mechprobe.io import read_json
from mechprobe.judges.run import LABELS_FILE, judge_run
from mechprobe.stages import auto_judge


def add_judge_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mechprobe judge`` (the CLI module calls this and :func:`run_judge_cli`)."""
    p.add_argument("run_dir", help="probe run directory (holds user_turns.jsonl and assistant.jsonl)")
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
    p.add_argument("--labels", default=LABELS_FILE, help="labels file name inside RUN_DIR")
    p.add_argument("--limit", type=int, default=None, help="judge at most N new rows (0 = no limit, as on every command)")
    p.add_argument("--keep-errors", action="store_true", help="do not retry earlier judge_error rows")
    common.add_no_progress(p)


def run_judge_cli(a: argparse.Namespace) -> int:
    """Run the stage from parsed arguments and print the summary table."""
    spec = a.judge
    if spec in (None, "auto"):
        run = Path(a.run_dir)
        man = read_json(run / "manifest.json") if (run / "manifest.json").is_file() else {}
        spec = auto_judge(run, str((man.get("config") or {}).get("model") or ""))
    opts: dict[str, Any] = {}
    if spec.startswith("openai:"):
        opts = {"base_url": a.base_url, "concurrency": a.concurrency, "timeout": a.timeout,
                "max_retries": a.max_retries, "api_key": os.environ.get(a.api_key_env) or None}
        opts["cache_dir"] = False if a.no_cache else a.cache_dir
    elif spec.startswith(("local:", "hybrid:", "hybrid2:")):
        opts = {"cache_dir": False if a.no_cache else a.cache_dir}
    try:
        s = judge_run(a.run_dir, spec, labels_file=a.labels, retry_errors=not a.keep_errors, limit=a.limit or None,
                      progress=not a.no_progress, **opts)
    except UserError as e:  # configuration errors with a fix (JudgeMismatch, JudgeFatal, ModelLoadError): one line
        print(f"mechprobe judge: error: {e}", file=sys.stderr)
        return 2
    print(s.table())
    if s.n_errors and not s.n_labelled:
        print(f"mechprobe judge: error: every judged turn ({s.n_errors}) is a judge error "
              f"({'; '.join(f'{r} x{c}' for r, c in s.errors.items())}); nothing usable was labelled. Check the "
              f"endpoint, key and model; re-running retries the error rows", file=sys.stderr)
        return 2  # a problem the user fixes (endpoint, key, model), like every UserError
    return 0


def main_judge(argv: list[str] | None = None) -> int:
    """``mechprobe judge RUN_DIR [--judge openai:MODEL | --judge offline] ...``"""
    p = argparse.ArgumentParser(prog="mechprobe judge", description="Label the user turns of a probe run.")
    add_judge_args(p)
    return run_judge_cli(p.parse_args(argv))
