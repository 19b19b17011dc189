"""The labelled-turns table: every judged user turn of a run, as one flat row per turn.

Why a table of its own: the audit must treat a probe run (``user_turns.jsonl`` + ``assistant.jsonl`` +
``labels.jsonl``) and a steering run (``steering*/alpha_*.jsonl``, turns and judge labels in one row) alike.
Sampling, the blind sheet and the report only need, per turn, what a labeller reads (query, answer, turn),
what the judge said, and the stratum fields (condition, decoding, dataset). Reading both layouts into one
row type here keeps every other module of :mod:`mechprobe.audit` independent of where a turn came from.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import MissingInput, UsageError
from mechprobe.io import read_jsonl, sha256_file
from mechprobe.records import AssistantRecord, LabelRecord, UserTurnRecord
from mechprobe.taxonomy import DEFINITIONS, GENUINE

__all__ = ["LabelledTurn", "TurnTable", "STRATA", "BASE_CONDITION", "load_run_table", "table_from_rows"]

# "condition+decoding" crosses the two: a run with steering directories holds the probe's own greedy and sampled
# turns under one condition ("probe"), and greedy-vs-sampled needs its own audited strata beside the steered ones.
STRATA: tuple[str, ...] = ("condition", "decoding", "dataset", "condition+decoding")
BASE_CONDITION = "probe"  # the condition name of a probe run's own (unsteered) turns
_ALPHA_FILE = re.compile(r"^alpha_(?P<alpha>[-0-9.eE+]+)_(?P<kind>.+)\.jsonl$")


@dataclass(frozen=True)
class LabelledTurn:
    """One judged user turn with everything the audit needs.

    ``turn`` is the raw user turn (special tokens kept: a turn that opens an assistant header must look like
    one to the labeller). ``judge_label`` is a taxonomy label (turns the judge failed on are not in a table).
    ``answer_stop_reason`` is the assistant record's ``stop_reason`` (``"max_tokens"``: the answer was cut at the
    token cap, which the sheet shows so a labeller does not take the cut for the model's choice).
    """

    record_id: str
    item_id: str
    query: str
    answer: str
    turn: str
    judge_label: str
    judge: str
    condition: str
    decoding: str
    dataset: str
    answer_stop_reason: str = ""

    @property
    def judge_genuine(self) -> bool:
        return self.judge_label == GENUINE

    def stratum(self, by: str) -> str:
        """The value of stratum field ``by`` (one of :data:`STRATA`)."""
        if by not in STRATA:
            raise UsageError(f"unknown stratum {by!r}; use one of {', '.join(STRATA)}")
        return " ".join(str(getattr(self, f)) for f in by.split("+"))


@dataclass
class TurnTable:
    """All judged turns of one run, plus where they came from.

    ``sources`` maps each file read (relative to the run) to its sha256, so a sample can record which judge
    labels it was drawn from; ``skipped`` counts turns left out (judge errors, turns without a label).
    """

    rows: list[LabelledTurn]
    sources: dict[str, str] = field(default_factory=dict)
    skipped: int = 0

    def __post_init__(self) -> None:
        self._by_id = {r.record_id: r for r in self.rows}
        if len(self._by_id) != len(self.rows):
            raise UsageError("the turn table has two rows with one record_id; fix the run's files (each turn once)")

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, record_id: str) -> LabelledTurn:
        return self._by_id[record_id]

    def has(self, record_id: str) -> bool:
        return record_id in self._by_id

    @property
    def judges(self) -> list[str]:
        """Every judge name in the table (one, in a run labelled by one judge)."""
        return sorted({r.judge for r in self.rows})

    @property
    def labels_sha256(self) -> str:
        """One hash over every source file: changes when any judge label (or turn) of the run changes."""
        h = hashlib.sha256()
        for name in sorted(self.sources):
            h.update(f"{name}\0{self.sources[name]}\n".encode())
        return h.hexdigest()

    def strata(self, by: str) -> dict[str, list[LabelledTurn]]:
        """Rows grouped by stratum value, keys sorted."""
        out: dict[str, list[LabelledTurn]] = {}
        for r in self.rows:
            out.setdefault(r.stratum(by), []).append(r)
        return dict(sorted(out.items()))


def _decoding(decoding: str, temperature: float) -> str:
    return "greedy" if decoding == "greedy" else f"T{temperature:g}"


def _valid(label: Any) -> bool:
    return isinstance(label, str) and label in DEFINITIONS


def _probe_rows(run: Path, by_item: dict[str, AssistantRecord], sources: dict[str, str]) -> tuple[list[LabelledTurn], int]:
    turns_p, labels_p = run / "user_turns.jsonl", run / "labels.jsonl"
    if not turns_p.exists() or not labels_p.exists():
        return [], 0
    sources["user_turns.jsonl"] = sha256_file(turns_p)
    sources["labels.jsonl"] = sha256_file(labels_p)
    labels = {r["record_id"]: LabelRecord.from_dict(r) for r in read_jsonl(labels_p, key="record_id")}
    rows, skipped = [], 0
    for d in read_jsonl(turns_p, key="record_id"):
        t = UserTurnRecord.from_dict(d)
        lab = labels.get(t.record_id)
        a = by_item.get(t.item_id)
        if lab is None or not _valid(lab.label) or a is None:
            skipped += 1
            continue
        cond = BASE_CONDITION if t.variant == "full" else f"{BASE_CONDITION}:{t.variant}"
        rows.append(LabelledTurn(t.record_id, t.item_id, a.prompt, a.response, t.raw_text, lab.label, lab.judge,
                                 cond, _decoding(t.decoding, t.temperature), t.dataset, a.stop_reason))
    return rows, skipped


def _steering_files(run: Path) -> list[Path]:
    """Held-out steering files: ``steering*/alpha_0_none.jsonl`` and ``steering*/L*/alpha_*.jsonl``.

    The train-selection sweep (``select/``) and the side files of re-judged rows (``*.labels.jsonl``) are
    not turns of the held-out comparison, so they are left out.
    """
    out: list[Path] = []
    for d in sorted(p for p in run.glob("steering*") if p.is_dir()):
        for p in sorted(d.glob("alpha_*.jsonl")) + sorted(d.glob("L*/alpha_*.jsonl")):
            if not p.name.endswith(".labels.jsonl") and _ALPHA_FILE.match(p.name):
                out.append(p)
    return out


def _steer_rows(run: Path, by_item: dict[str, AssistantRecord], sources: dict[str, str]) -> tuple[list[LabelledTurn], int]:
    files = _steering_files(run)
    several = len({p.relative_to(run).parts[0] for p in files}) > 1
    rows, skipped = [], 0
    for p in files:
        rel = p.relative_to(run).as_posix()
        sources[rel] = sha256_file(p)
        top = p.relative_to(run).parts[0]
        for d in read_jsonl(p, key="item_id"):
            a = by_item.get(d["item_id"])
            if a is None or not _valid(d.get("label")):
                skipped += 1
                continue
            alpha = float(d.get("alpha", 0.0))
            kind = d.get("kind", "none")
            cond = "none" if alpha == 0 or kind == "none" else f"{kind}|L{d.get('layer')}|a{alpha:g}"
            if several:
                cond = f"{top}/{cond}"
            rows.append(LabelledTurn(f"{rel}#{d['item_id']}", d["item_id"], a.prompt, a.response, d["raw_text"],
                                     d["label"], str(d.get("judge") or "unknown"), cond, "greedy", a.dataset,
                                     a.stop_reason))
    return rows, skipped


def load_run_table(run: str | Path) -> TurnTable:
    """Read every judged turn of a run directory into a :class:`TurnTable`.

    Args:
        run: a probe run (``assistant.jsonl``, ``user_turns.jsonl``, ``labels.jsonl``), optionally with steering
            directories (``steering*/``, as written by ``experiments/steer.py``). Probe turns get condition
            ``"probe"``; steered turns ``"<kind>|L<layer>|a<alpha>"`` and alpha-0 turns ``"none"``.
    Returns:
        the table; turns without a valid judge label (judge errors) are counted in ``skipped``, not rows,
        because the audit compares the judge's label with a person's and there is none to compare.
    Example:
        >>> table = load_run_table("runs/smol-gsm8k")  # doctest: +SKIP
        >>> table.strata("condition").keys()  # doctest: +SKIP
    """
    run = Path(run)
    a_p = run / "assistant.jsonl"
    if not a_p.exists():
        raise MissingInput(f"{a_p} not found: the audit needs a probe run (run `mechprobe probe` and a judge first)")
    by_item = {r["item_id"]: AssistantRecord.from_dict(r) for r in read_jsonl(a_p, key="item_id")}
    sources: dict[str, str] = {"assistant.jsonl": sha256_file(a_p)}
    # Items of a fixed split the run does not hold get their answers inside the steering directory
    # (``<steer dir>/split_answers/assistant.jsonl``); without them every steered turn of such items is skipped.
    for sp in sorted(run.glob("steering*/split_answers/assistant.jsonl")):
        sources[sp.relative_to(run).as_posix()] = sha256_file(sp)
        for r in read_jsonl(sp, key="item_id"):
            by_item.setdefault(r["item_id"], AssistantRecord.from_dict(r))
    probe, s1 = _probe_rows(run, by_item, sources)
    steer, s2 = _steer_rows(run, by_item, sources)
    if not probe and not steer:
        raise MissingInput(f"{run} has no judged turns (labels.jsonl or steering*/alpha_*.jsonl); run the judge "
                           f"(`mechprobe judge`) or experiments/steer.py first")
    return TurnTable(probe + steer, sources, s1 + s2)


def table_from_rows(rows: Iterable[dict[str, Any]], label_field: str = "judge_label",
                    judge: str = "unknown", sources: dict[str, str] | None = None) -> TurnTable:
    """A table from plain dict rows (a hand-made file, a test), for data that is not a run directory.

    Args:
        rows: dicts with ``record_id``, ``item_id``, ``query`` (or ``prompt``), ``answer`` (or ``response``),
            ``turn`` (or ``raw_text``), the judge's label under ``label_field``, and optionally ``condition``,
            ``decoding``, ``dataset``, ``judge``.
        label_field: which key holds the judge label (``"hybrid_label"`` in the steering fixtures).
    Returns:
        the table; rows whose label is not a taxonomy label are counted in ``skipped``.
    Example:
        >>> table_from_rows(read_jsonl("tests/fixtures/hand_labels_steer_q15.jsonl"), label_field="hybrid_label")  # doctest: +SKIP
    """
    out: list[LabelledTurn] = []
    skipped = 0
    for d in rows:
        lab = d.get(label_field)
        if not _valid(lab):
            skipped += 1
            continue
        out.append(LabelledTurn(str(d["record_id"]), str(d["item_id"]), d.get("query", d.get("prompt", "")),
                                d.get("answer", d.get("response", "")), d.get("turn", d.get("raw_text", "")),
                                lab, str(d.get("judge", judge)), str(d.get("condition", BASE_CONDITION)),
                                str(d.get("decoding", "greedy")), str(d.get("dataset", "unknown")),
                                str(d.get("answer_stop_reason", ""))))
    return TurnTable(out, dict(sources or {}), skipped)

