"""Regenerate ``mechprobe/data/splits/gsm8k_steering_v1.json`` bit for bit from the GSM8K test file.

    python scripts/make_steering_split.py [--data /path/to/shared/data] [--check]

The rule (seed, index range, sizes) is :data:`mechprobe.splits.STEERING_SPLIT_RULE`; ``--check`` compares
with the committed file instead of writing it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe.splits import STEERING_SPLIT, STEERING_SPLIT_RULE, draw_item_split, split_text  # noqa: E402
from mechprobe.turns.datasets import find_data_dir  # noqa: E402


def build(data_dir: Path) -> str:
    r = STEERING_SPLIT_RULE
    return split_text(draw_item_split(data_dir / r["source"], **r))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="folder laid out like shared/data (default: found as the loaders do)")
    p.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    a = p.parse_args(argv)
    data = Path(a.data) if a.data else find_data_dir()
    if data is None:
        print("no data folder found: pass --data /path/to/shared/data", file=sys.stderr)
        return 2
    text = build(data)
    if a.check:
        same = STEERING_SPLIT.exists() and STEERING_SPLIT.read_text() == text
        print("identical" if same else f"{STEERING_SPLIT} differs from a regeneration")
        return 0 if same else 1
    STEERING_SPLIT.parent.mkdir(parents=True, exist_ok=True)
    STEERING_SPLIT.write_text(text)
    print(f"wrote {STEERING_SPLIT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
