"""The ``mechprobe`` command line: one module per command, every shared flag defined once in :mod:`.common`.

Each command module has ``add_args(parser)`` (its flags) and ``run(args) -> int`` (the exit code);
:mod:`.main` registers them all. The top layer of the package: nothing below ``cli`` imports it, and no
argparse namespace travels below it (each command turns its namespace into a typed config first).
"""

from mechprobe.cli.common import friendly
from mechprobe.cli.main import build_parser, main

__all__ = ["build_parser", "friendly", "main"]
