"""The evidence bundle of a propensity finding: every answer, user turn and verdict of a probe run, one line per
item, beside the run's manifest, label summary and propensity report, so the committed numbers can be recomputed
without the run folder (which is not committed: its activations are large).

    python scripts/propensity_evidence.py runs/q15-gsm8k-hidden-v5 reports/propensity/q15-gsm8k-hidden-v5

Writes ``OUT/evidence.jsonl`` (item_id, dataset, query, answer, answer_stop_reason, turns: record_id, decoding,
temperature, text, stop_reason, judge, label, genuine, p_genuine) and copies ``manifest.json``,
``labels_summary.md`` and ``probes/propensity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from mechprobe.io import read_jsonl
from mechprobe.taxonomy import GENUINE

__all__ = ["evidence_rows", "relative_paths", "main"]

ROOT = Path(__file__).resolve().parents[1]


def relative_paths(obj: Any, root: Path = ROOT) -> Any:
    """``obj`` with every absolute path beside ``root`` (under its parent) written relative to ``root``: a run's
    manifest names its data file by absolute path, and no committed file may hold a machine's paths."""
    if isinstance(obj, dict):
        return {k: relative_paths(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative_paths(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith("/") and Path(obj).is_relative_to(root.parent):
        return os.path.relpath(obj, root)
    return obj


def evidence_rows(run: Path) -> list[dict[str, Any]]:
    """One row per answered item of ``run`` (by item id), its turns in the run's order, each with the run's verdict on it.

    Raises:
        SystemExit: a turn without a verdict (judge the run first).
    """
    labels = {r["record_id"]: r for r in read_jsonl(run / "labels.jsonl", key="record_id")}
    turns: dict[str, list[dict[str, Any]]] = {}
    for t in read_jsonl(run / "user_turns.jsonl", key="record_id"):
        lab = labels.get(t["record_id"])
        if lab is None:
            raise SystemExit(f"{run}: turn {t['record_id']} has no verdict in labels.jsonl; judge the run first")
        turns.setdefault(t["item_id"], []).append({
            "record_id": t["record_id"], "decoding": t["decoding"], "temperature": t["temperature"],
            "text": t["text"], "stop_reason": t["stop_reason"], "judge": lab["judge"], "label": lab["label"],
            "genuine": lab["genuine"], "p_genuine": (lab.get("probs") or {}).get(GENUINE)})
    return [{"item_id": a["item_id"], "dataset": a["dataset"], "query": a["prompt"], "answer": a["response"],
             "answer_stop_reason": a["stop_reason"], "turns": turns.get(a["item_id"], [])}
            for a in sorted(read_jsonl(run / "assistant.jsonl", key="item_id"), key=lambda a: a["item_id"])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a judged probe run with probes/propensity.json")
    p.add_argument("out", type=Path, help="the bundle folder (created)")
    a = p.parse_args(argv)
    rows = evidence_rows(a.run)
    a.out.mkdir(parents=True, exist_ok=True)
    with (a.out / "evidence.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    for src in ("manifest.json", "labels_summary.md", "probes/propensity.json"):
        if not (a.run / src).is_file():
            continue
        if src.endswith(".json"):
            data = relative_paths(json.loads((a.run / src).read_text(encoding="utf-8")))
            (a.out / Path(src).name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(a.run / src, a.out / Path(src).name)
    print(f"{len(rows)} items, {sum(len(r['turns']) for r in rows)} turns -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
