"""``python -m mechprobe``: the same command line as the ``mechprobe`` script (:mod:`mechprobe.cli`)."""

from mechprobe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
