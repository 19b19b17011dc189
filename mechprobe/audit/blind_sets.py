"""Every committed blind-labelled set of model turns, as one table: one record per (turn, labeller).

Why one loader: a judge is the linear probes' target, so its agreement with blind labels has to be measured per
subject model on turns it never saw; the committed labels sit in three layouts (the labelled set, a codebook-v2
relabel, the intervention study's sheets: train batches and each plan's held-out sheet). Each layout is one
entry of :data:`SOURCES`; a missing folder is skipped with a note, so a new source is one more entry and the
judge table (``mechprobe judges evaluate``) is recomputed by one command.

Readings: ``lenient`` is the label as given; ``strict`` exists only where the labels carry codebook v2's
``strict`` field (never inferred from a v1 label). The consensus of a turn under a reading
(:func:`consensus`) is the verdict both labellers give (genuine or not); a turn they split on has no consensus
and is left out of fitting and scoring (the count is reported). Where one turn was labelled under two codebooks,
the later codebook's labels are its labels.

Items and splits (:func:`split_of_item`): the item is the whitespace-normalised query's hash (the labelled set's
``item_key``); ``test`` is the labelled set's own test rule (so its test items, scored there once for the older
judges, stay test), and the rest is train or dev by a second hash. The split never looks at a label.

Turns authored by a language model as stimuli (the study's ``react`` and ``ignore`` rows) are user turns that no
subject model wrote; they are not loaded.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.splits import split_of
from mechprobe.taxonomy import DEFINITIONS, GENUINE

from .readings import LENIENT, STRICT, STRICT_YES, parse_strict

__all__ = ["BlindTurn", "BlindLabel", "JudgeVerdict", "Source", "SOURCES", "STIMULUS_ARMS", "SPLITS", "BlindSets", "load_blind_sets",
           "consensus", "query_item_key", "split_of_item", "genuine_of", "judge_spec"]

STIMULUS_ARMS = frozenset({"react", "ignore"})  # LM-authored user turns (stimuli), not subject-model turns
SPLITS = ("train", "dev", "test")
TEST_FRACTION = 0.4  # the labelled set's test rule (scripts/build_labelled_set.py), kept so its test stays test
DEV_FRACTION = 0.25  # of the non-test items


@dataclass(frozen=True)
class BlindTurn:
    """One subject-model turn as the labellers saw it (query, answer, turn as written)."""

    turn_id: str
    source: str
    model: str
    dataset: str
    item: str  # item_key of the query
    arm: str  # condition / decoding / study arm
    query: str
    answer: str
    turn: str


@dataclass(frozen=True)
class BlindLabel:
    """One labeller's label of one turn; ``strict`` is None where the codebook had no strict reading."""

    turn_id: str
    source: str
    codebook: str
    labeller: str
    label: str
    strict: str | None
    borderline: bool


@dataclass(frozen=True)
class JudgeVerdict:
    """A judge's binary verdict on one turn: ``reading`` None when one verdict stands for both readings (a judge
    with one decision), else the reading whose head gave it; ``where`` the committed file it comes from."""

    turn_id: str
    judge: str
    reading: str | None
    genuine: bool
    where: str


@dataclass(frozen=True)
class Source:
    """One committed labelled set: ``kind`` names its layout, ``path`` its folder (relative to the repo).

    ``fit``: whether a judge fit may read it. False marks a pre-registered test set: the pool protocol
    (:mod:`mechprobe.judges.hidden_cv`) never reads its turns nor any turn of its items, and the split protocols
    never see it because all its items are test-split."""

    name: str
    kind: str  # "labelled_set" | "relabel" | "sheets" | "fresh"
    path: str
    codebook: str
    model: str = ""  # for layouts whose files do not name the subject model
    fit: bool = True


SOURCES: tuple[Source, ...] = (
    Source("labelled_turns", "labelled_set", "reports/labelled_turns", "v1"),
    Source("relabel_v2_mt_bench_1.5b", "relabel", "reports/relabel_v2/qwen2.5-coder-1.5b-instruct-mt_bench", "v2"),
    Source("relabel_v2_gsm8k_1.5b", "relabel", "reports/relabel_v2/qwen2.5-coder-1.5b-instruct-gsm8k", "v2"),
    Source("fit_labels_gsm8k_1.5b_dev_pool", "relabel",
           "reports/judge_fit_labels/qwen2.5-coder-1.5b-instruct-gsm8k-dev-pool", "v2"),
    Source("interventions_v2_train", "sheets", "reports/interventions/interventions-0.5b-v2/train", "v2",
           "qwen2.5-coder-0.5b-instruct"),
    Source("interventions_v2c_heldout", "sheets", "reports/interventions/interventions-0.5b-v2c/heldout", "v2",
           "qwen2.5-coder-0.5b-instruct"),
    Source("interventions_v3b_heldout", "sheets", "reports/interventions/interventions-0.5b-v3b/heldout", "v2",
           "qwen2.5-coder-0.5b-instruct"),
    Source("judge_fresh_test_v1", "fresh", "reports/judge_sets/fresh_test_v1", "v2"),
    Source("judge_fresh_test_v2", "fresh", "reports/judge_sets/fresh_test_v2", "v2"),
    Source("judge_fresh_test_v3", "fresh", "reports/judge_sets/fresh_test_v3", "v2"),
    Source("judge_fresh_test_v4", "fresh", "reports/judge_sets/fresh_test_v4", "v2"),
    # part 2 of the fresh test v4 (studies/judge/fresh_test_v4_parts.json): its MATH500 items, one sheet of their own
    Source("judge_fresh_test_v4_math500", "fresh", "reports/judge_sets/fresh_test_v4_math500", "v2"),
    # studies/judge/fresh_test_v5.json: greedy + 3 samples per item, Topical-Chat and hh_rlhf; tests hidden-v5
    Source("judge_fresh_test_v5", "fresh", "reports/judge_sets/fresh_test_v5", "v2"),
    # studies/judge/fresh_test_v6.json: hh_rlhf, greedy + 3 samples per item; tests hidden-v6
    Source("judge_fresh_test_v6", "fresh", "reports/judge_sets/fresh_test_v6", "v2"),
    # studies/judge/fresh_test_v7.json: hh_rlhf, greedy + 3 samples per item; tests hidden-v7
    Source("judge_fresh_test_v7", "fresh", "reports/judge_sets/fresh_test_v7", "v2", fit=False),
)


def query_item_key(query: str) -> str:
    """The item of a turn: the hash of its whitespace-normalised query (the labelled set's ``item_key``)."""
    return hashlib.sha256(" ".join(query.split()).encode()).hexdigest()[:16]


def split_of_item(item: str) -> str:
    """``train``, ``dev`` or ``test`` for an item key: deterministic, label-blind, the same for every model.

    Example:
        >>> split_of_item(query_item_key("What is 12 * 7?")) in SPLITS
        True
    """
    if split_of("labelled-turns|" + item, TEST_FRACTION) == "heldout":
        return "test"
    return "dev" if split_of("judge-dev|" + item, DEV_FRACTION) == "heldout" else "train"


def _turn_id(model: str, query: str, answer: str, turn: str) -> str:
    """Content key (the labelled set's): the same turn from two sources is one row."""
    h = hashlib.sha256(json.dumps([model, query, answer, turn], ensure_ascii=False).encode()).hexdigest()
    return "t" + h[:12]


def judge_spec(spec: str) -> str:
    """One name per judge in the table: ``hybrid2:M`` is the accepted alias of ``hybrid-voice:M`` (the same judge)."""
    return "hybrid-voice:" + spec.split(":", 1)[1] if spec.startswith("hybrid2:") else spec


def _flag(v: Any) -> bool:
    return str(v).strip().lower() in {"1", "true", "yes", "y", "x"}


def _label(v: Any, where: str) -> str:
    lab = str(v or "").strip()
    if lab not in DEFINITIONS:
        raise UsageError(f"{where}: label {lab!r} is not one of the eight taxonomy labels; fix the labels file")
    return lab


def _csv(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(encoding="utf-8", newline="") as fh:
            return list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"{path}: not a readable UTF-8 CSV ({type(e).__name__}); restore it from git") from None


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: not readable JSON ({type(e).__name__}); restore it from git") from None


def _labelled_set(src: Source, d: Path) -> tuple[list[BlindTurn], list[BlindLabel], list[JudgeVerdict]]:
    turns = []
    for line in (d / "turns.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            turns.append(BlindTurn(r["turn_id"], src.name, r["model"], r["dataset"], query_item_key(r["query"]),
                                   r["condition"], r["query"], r["answer"], r["turn"]))
    labels = []
    for f in sorted((d / "labels").glob("labeller-*.json")):
        for r in _json(f)["rows"]:
            where = f"{f}: row {r.get('row')}"
            labels.append(BlindLabel(r["row"], src.name, src.codebook, f.stem, _label(r.get("label"), where),
                                     None, bool(r.get("borderline"))))
    verdicts = []
    if (d / "judges.jsonl").is_file():  # committed judge verdicts on the labelled set's test turns
        for line in (d / "judges.jsonl").read_text(encoding="utf-8").splitlines():
            r = json.loads(line) if line.strip() else None
            if r:
                verdicts.append(JudgeVerdict(r["turn_id"], judge_spec(r["spec"]), None, r["label"] == GENUINE,
                                        f"{src.path}/judges.jsonl"))
    return turns, labels, verdicts


def _relabel(src: Source, d: Path) -> tuple[list[BlindTurn], list[BlindLabel], list[JudgeVerdict]]:
    key = _json(d / "key.json")
    model, dataset, rows = key["model"], key["dataset"], key["rows"]
    turns, labels = [], []
    ids: dict[str, str] = {}
    for r in _csv(d / "sheet.csv"):
        tid = rows.get(r["row"]) or _turn_id(model, r["query"], r["answer"], r["user_turn"])
        ids[r["row"]] = tid
        turns.append(BlindTurn(tid, src.name, model, dataset, query_item_key(r["query"]), "", r["query"], r["answer"],
                               r["user_turn"]))
    for f in sorted((d / "labels").glob("labeller-*.csv")):
        labels += _csv_labels(src, f, ids)
    return turns, labels, []


def _csv_labels(src: Source, f: Path, ids: dict[str, str]) -> list[BlindLabel]:
    out = []
    for i, r in enumerate(_csv(f), 2):
        if r.get("row") not in ids or not (r.get("label") or "").strip():
            continue
        where = f"{f}:{i}"
        lab = _label(r["label"], where)
        out.append(BlindLabel(ids[r["row"]], src.name, src.codebook, f.stem, lab,
                              parse_strict(r.get("strict"), lab, where), _flag(r.get("borderline"))))
    return out


def _sheets(src: Source, d: Path) -> tuple[list[BlindTurn], list[BlindLabel], list[JudgeVerdict]]:
    """The study's layout: ``sheets/<batch>.csv`` + ``.key.json`` with ``labels/<batch>/*.csv`` (train), or
    ``sheet.csv`` + ``sheet.key.json`` with ``labels/*.csv`` (held out)."""
    pairs = [(s, s.with_suffix(".key.json"), d / "labels" / s.stem) for s in sorted((d / "sheets").glob("*.csv"))]
    if (d / "sheet.csv").is_file():
        pairs.append((d / "sheet.csv", d / "sheet.key.json", d / "labels"))
    turns, labels, verdicts = [], [], []
    for sheet, keyf, labdir in pairs:
        key = _json(keyf)["rows"]
        ids: dict[str, str] = {}
        for r in _csv(sheet):
            meta = key.get(r["row"], {})
            arm = str(meta.get("arm") or meta.get("decoding") or "")
            if arm in STIMULUS_ARMS:
                continue
            dataset = str(meta.get("item_id", "")).split("-")[0]
            tid = _turn_id(src.model, r["query"], r["answer"], r["user_turn"])
            ids[r["row"]] = tid
            turns.append(BlindTurn(tid, src.name, src.model, dataset, query_item_key(r["query"]), arm, r["query"],
                                   r["answer"], r["user_turn"]))
        if labdir.is_dir():
            for f in sorted(labdir.glob("*.csv")):
                labels += _csv_labels(src, f, ids)
        verdicts += _row_verdicts(src, sheet.parent, ids, d)  # the study's judges, keyed by sheet row
    return turns, labels, verdicts


def _fresh(src: Source, d: Path) -> tuple[list[BlindTurn], list[BlindLabel], list[JudgeVerdict]]:
    """A judge test set over several subject models in one blind sheet: ``sheet.csv`` (row, query, answer,
    user_turn), ``key.json`` (row -> turn id, model, dataset, decoding) and ``labels/*.csv``."""
    key = _json(d / "key.json")["rows"]
    turns, ids = [], {}
    for r in _csv(d / "sheet.csv"):
        meta = key.get(r["row"])
        if meta is None:
            continue
        ids[r["row"]] = meta["turn_id"]
        turns.append(BlindTurn(meta["turn_id"], src.name, meta["model"], meta["dataset"], query_item_key(r["query"]),
                               str(meta.get("decoding", "")), r["query"], r["answer"], r["user_turn"]))
    labels = []
    if (d / "labels").is_dir():
        for f in sorted((d / "labels").glob("*.csv")):
            labels += _csv_labels(src, f, ids)
    return turns, labels, _row_verdicts(src, d, ids)


def _row_verdicts(src: Source, d: Path, ids: dict[str, str], root: Path | None = None) -> list[JudgeVerdict]:
    """The committed verdicts beside a sheet in ``d`` (``verdicts_<kind>_<model>.jsonl``, one line per sheet row);
    ``root`` is the source's folder (default ``d``), for the file's name in the verdict."""
    root = root or d
    out = []
    for f in sorted(d.glob("verdicts_*.jsonl")):
        spec = f.stem.removeprefix("verdicts_").replace("_", ":", 1)
        for line in f.read_text(encoding="utf-8").splitlines():
            r = json.loads(line) if line.strip() else None
            if r and r.get("record_id") in ids:
                out.append(JudgeVerdict(ids[r["record_id"]], judge_spec(spec), None, bool(r["genuine"]),
                                        f"{src.path}/{f.relative_to(root).as_posix()}"))
    return out


_LOADERS = {"labelled_set": _labelled_set, "relabel": _relabel, "sheets": _sheets, "fresh": _fresh}


@dataclass
class BlindSets:
    """Turns by id, every label, the judges' committed verdicts, and notes (sources skipped, turns seen twice)."""

    turns: dict[str, BlindTurn]
    labels: list[BlindLabel]
    notes: list[str]
    verdicts: list[JudgeVerdict] = field(default_factory=list)
    _by_turn: dict[str, list[BlindLabel]] | None = field(default=None, repr=False)

    def labels_of(self, turn_id: str) -> list[BlindLabel]:
        """The turn's labels under its latest codebook (a v2 relabel supersedes v1 labels of the same turn)."""
        if self._by_turn is None:
            self._by_turn = {}
            for lab in self.labels:
                self._by_turn.setdefault(lab.turn_id, []).append(lab)
        mine = self._by_turn.get(turn_id, [])
        if not mine:
            return []
        latest = max(lab.codebook for lab in mine)
        return [lab for lab in mine if lab.codebook == latest]

    def counts(self) -> list[dict[str, Any]]:
        """Inventory rows: per (model, source) turns, labellers' labels, and consensus per reading."""
        by: dict[tuple[str, str], dict[str, Any]] = {}
        for t in self.turns.values():
            row = by.setdefault((t.model, t.source), {"model": t.model, "source": t.source, "turns": 0, "labels": 0,
                                                       **{f"{r}_{k}": 0 for r in (LENIENT, STRICT)
                                                          for k in ("consensus", "genuine", "split")}})
            row["turns"] += 1
            labs = self.labels_of(t.turn_id)
            row["labels"] += len(labs)
            for reading in (LENIENT, STRICT):
                c = consensus(labs, reading)
                if c is None:
                    row[f"{reading}_split"] += bool(labs) and all(genuine_of(lab, reading) is not None
                                                                  for lab in labs)
                else:
                    row[f"{reading}_consensus"] += 1
                    row[f"{reading}_genuine"] += int(c)
        return [by[k] for k in sorted(by)]


def genuine_of(lab: BlindLabel, reading: str) -> bool | None:
    """One label's binary verdict under ``reading``; None for ``strict`` on a label without the strict field."""
    if reading == LENIENT:
        return lab.label == GENUINE
    if reading != STRICT:
        raise ValueError(f"unknown reading {reading!r}")
    if lab.label != GENUINE:
        return False if lab.codebook >= "v2" else None
    return None if lab.strict is None else lab.strict == STRICT_YES


def consensus(labels: Iterable[BlindLabel], reading: str) -> bool | None:
    """Both labellers' shared verdict under ``reading``; None when fewer than two labelled it, they split, or the
    reading is not in their labels.

    Example:
        >>> a = BlindLabel("t", "s", "v2", "labeller-a", "genuine_followup", "yes", False)
        >>> consensus([a, BlindLabel("t", "s", "v2", "labeller-b", "new_query", None, False)], "lenient") is None
        True
    """
    verdicts = [genuine_of(lab, reading) for lab in labels]
    if len(verdicts) < 2 or any(v is None for v in verdicts) or len(set(verdicts)) != 1:
        return None
    return bool(verdicts[0])


def load_blind_sets(root: str | Path = ".", sources: Iterable[Source] = SOURCES) -> BlindSets:
    """Read every source under ``root`` (a missing folder is a note, not an error).

    A turn that two sources hold (the same content key) is one turn; its labels are pooled and
    :meth:`BlindSets.labels_of` keeps the latest codebook's.
    """
    root = Path(root)
    turns: dict[str, BlindTurn] = {}
    labels: list[BlindLabel] = []
    verdicts: list[JudgeVerdict] = []
    notes = []
    for src in sources:
        d = root / src.path
        if not d.is_dir():
            notes.append(f"{src.name}: {src.path} not found; skipped")
            continue
        ts, ls, vs = _LOADERS[src.kind](src, d)
        verdicts += vs
        for t in ts:
            if t.turn_id in turns:
                notes.append(f"{src.name}: turn {t.turn_id} also in {turns[t.turn_id].source}; one turn")
                continue
            turns[t.turn_id] = t
        labels += ls
    return BlindSets(turns, labels, notes, verdicts)
