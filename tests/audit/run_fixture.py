"""A tiny real run directory for the audit tests, written with the package's record classes.

Real turns only: the steering part is the first items of ``tests/fixtures/hand_labels_steer_q15.jsonl``
(1.5B model, conditions none / diff_means / random, the run's hybrid judge label as the judge), the probe
part the first items of ``hand_labels_q15_c.jsonl`` with labeller D's labels standing in for a judge.
Labellers E and F of the steering fixture (and C of the probe fixture) are the "audit" labels.
"""

from __future__ import annotations

import json
from pathlib import Path

from mechprobe.records import AssistantRecord, LabelRecord, UserTurnRecord

FIX = Path(__file__).resolve().parents[1] / "fixtures"
STEER_DIR = "L14_boundary+generated_resid"
CONDITION_NAMES = {"none": "none", "diff_means": "diff_means|L14|a0.8", "random": "random|L14|a0.8"}


def _read(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIX / name).read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_run(root: Path, n_steer_items: int = 16, n_probe_items: int = 4) -> dict[str, dict[str, str]]:
    """Write the run into ``root``; returns ``{labeller: {record_id: label}}`` of the fixture's labellers."""
    steer = _read("hand_labels_steer_q15.jsonl")
    items: list[str] = []
    for r in steer:
        if r["item_id"] not in items:
            items.append(r["item_id"])
    keep = set(items[:n_steer_items])
    steer = [r for r in steer if r["item_id"] in keep]
    probe = _read("hand_labels_q15_c.jsonl")
    d_labels = {r["record_id"]: r["label"] for r in _read("hand_labels_q15_d.jsonl")}
    p_items: list[str] = []
    for r in probe:
        if r["item_id"] not in p_items:
            p_items.append(r["item_id"])
    probe = [r for r in probe if r["item_id"] in set(p_items[:n_probe_items])]

    assistants: dict[str, AssistantRecord] = {}
    for r in steer + probe:
        assistants.setdefault(r["item_id"], AssistantRecord(
            item_id=r["item_id"], dataset="gsm8k", prompt=r["prompt"], response=r["response"],
            stop_reason="max_tokens", n_tokens=192))
    _write(root / "assistant.jsonl", [a.to_dict() for a in assistants.values()])

    turns, labels = [], []
    truth: dict[str, dict[str, str]] = {"E": {}, "F": {}, "C": {}}
    for r in probe:
        t = UserTurnRecord(record_id=r["record_id"], item_id=r["item_id"], dataset="gsm8k", decoding=r["decoding"],
                           temperature=r["temperature"], sample_index=0, seed=None, raw_text=r["raw_text"],
                           text=r["raw_text"], stop_reason=r["stop_reason"], prompt_ids=[1, 2, 3], boundary_index=2,
                           assistant_span=(0, 1))
        turns.append(t.to_dict())
        labels.append(LabelRecord(record_id=r["record_id"], label=d_labels[r["record_id"]], genuine=None,
                                  rationale="", judge="hand-D").to_dict())
        truth["C"][r["record_id"]] = r["label"]
    _write(root / "user_turns.jsonl", turns)
    _write(root / "labels.jsonl", labels)

    by_cond: dict[str, list[dict]] = {}
    for r in steer:
        kind = r["condition"]
        row = {"item_id": r["item_id"], "kind": kind, "alpha": 0.0 if kind == "none" else 0.8,
               "layer": -1 if kind == "none" else 14, "positions": "boundary+generated", "raw_text": r["raw_text"],
               "text": r["raw_text"], "stop_reason": "end_of_turn", "nll": 1.0, "token_ids": None,
               "nll_base_text": None, "label": r["hybrid_label"], "judge": "hybrid:test"}
        by_cond.setdefault(kind, []).append(row)
    _write(root / "steering" / "alpha_0_none.jsonl", by_cond["none"])
    for kind in ("diff_means", "random"):
        _write(root / "steering" / STEER_DIR / f"alpha_0.8_{kind}.jsonl", by_cond[kind])
    for r in steer:
        rel = ("steering/alpha_0_none.jsonl" if r["condition"] == "none"
               else f"steering/{STEER_DIR}/alpha_0.8_{r['condition']}.jsonl")
        truth["E"][f"{rel}#{r['item_id']}"] = r["label_e"]
        truth["F"][f"{rel}#{r['item_id']}"] = r["label_f"]
    return truth
