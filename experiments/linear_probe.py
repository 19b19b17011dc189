"""Linear probes on the user-role boundary state, layer by layer, with controls.

    python experiments/linear_probe.py                          # embedded default model, builds every stage
    python experiments/linear_probe.py --run runs/smol-gsm8k --judge offline --layers all
    python experiments/linear_probe.py --transfer-datasets mt_bench ifeval   # + train-on-A/test-on-B matrix

Runs (or reuses) probe -> judge -> cache, then writes ``<run>/probes/metrics.json``, ``metrics.md``,
``directions.safetensors`` + ``directions.json`` (per-layer probe and difference-of-means directions, for
steering) and ``<run>/figures/linear_probe_<run>.png`` (``--figures figures`` publishes into the repo). Exit code 3 (and ``status: insufficient_positives`` in
metrics.json) when the labels have too few positives for grouped CV: no numbers are reported then.
The work is done by :func:`mechprobe.probes.run_probes_cli`, so ``mechprobe probes`` can share it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.cli import accept_negative_numbers, friendly  # noqa: E402
from mechprobe.probes import add_probes_args, run_probes_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probes_args(p)
    return accept_negative_numbers(p)


def main(argv: list[str] | None = None) -> int:
    return run_probes_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(friendly(lambda: main()))
