"""Dataset loaders: local files by path (tests, offline runs) or Hugging Face ``datasets`` (hub users).

Every loader returns :class:`Item` records with stable ids (``<dataset>-<row index>``), so a run
extended with a larger ``--limit`` or reloaded from the hub keys the same rows the same way.
Malformed rows are reported with file and line, counted, and skipped: one bad line in a 10k-row
file should not cost the other rows (the count goes into the run manifest).

Where local files are looked for: ``path`` if given; else ``$MECHPROBE_DATA_DIR``; else a
``shared/data`` folder in the current directory, the package checkout, or any of their parents
(the layout of this project's machines: the repo beside ``shared/``).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .records import Item

log = logging.getLogger(__name__)


@dataclass
class SkippedRow:
    file: str
    line: int
    reason: str


@dataclass
class DatasetLoad:
    items: list[Item]
    skipped: list[SkippedRow] = field(default_factory=list)
    source: str = ""


# name -> (folder, file, hub id, hub config, hub split)
LOCAL: dict[str, tuple[str, str]] = {
    "gsm8k": ("gsm8k", "test.jsonl"),
    "math500": ("math500", "test.jsonl"),
    "ifeval": ("ifeval", "input_data.jsonl"),
    "mt_bench": ("mt_bench", "question.jsonl"),
    "hh_rlhf": ("hh_rlhf_harmless_test", "test.jsonl.gz"),
    "topical_chat": ("topical_chat", "test_freq.json"),
}
HUB: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "gsm8k": ("openai/gsm8k", "main", {}),
    "math500": ("HuggingFaceH4/MATH-500", None, {}),
    "ifeval": ("google/IFEval", None, {"split": "train"}),
    "mt_bench": ("HuggingFaceH4/mt_bench_prompts", None, {"split": "train"}),
    "hh_rlhf": ("Anthropic/hh-rlhf", None, {"data_dir": "harmless-base"}),
}
NAMES = ("builtin", *LOCAL)


def find_data_dir() -> Path | None:
    """The local data folder (see module docstring), or None."""
    env = os.environ.get("MECHPROBE_DATA_DIR")
    if env:
        return Path(env).expanduser()
    starts = [Path.cwd(), Path(__file__).resolve().parent]
    for start in starts:
        for base in [start, *start.parents]:
            d = base / "shared" / "data"
            if d.is_dir():
                return d
    return None


def _gold_gsm8k(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


# Row mappers: (row, index) -> Item. Shared by the local and hub paths (the hub schemas match the files).
def _gsm8k(r: dict, i: int) -> Item:
    return Item(item_id=f"gsm8k-{i:04d}", dataset="gsm8k", prompt=r["question"], gold=_gold_gsm8k(r["answer"]),
                meta={"solution": r["answer"]})


def _math500(r: dict, i: int) -> Item:
    return Item(item_id=f"math500-{i:04d}", dataset="math500", prompt=r["problem"], gold=str(r["answer"]),
                meta={k: r[k] for k in ("subject", "level", "unique_id") if k in r})


def _ifeval(r: dict, i: int) -> Item:
    return Item(item_id=f"ifeval-{r['key']}", dataset="ifeval", prompt=r["prompt"],
                meta={"instruction_id_list": list(r["instruction_id_list"]), "kwargs": list(r["kwargs"])})


def _mt_bench(r: dict, i: int) -> Item:
    turns = r.get("turns") or r.get("prompt")
    if not isinstance(turns, list) or not turns:
        raise KeyError("turns")
    qid = r.get("question_id", i)
    second = turns[1] if len(turns) > 1 else None
    return Item(item_id=f"mt_bench-{qid}", dataset="mt_bench", prompt=turns[0], reference_next_user=second,
                meta={"category": r.get("category"), "turn_2": second})


def parse_hh(transcript: str) -> list[tuple[str, str]]:
    """Split an HH-RLHF transcript into (role, text) turns."""
    out: list[tuple[str, str]] = []
    for chunk in transcript.split("\n\nHuman:")[1:]:
        human, *rest = chunk.split("\n\nAssistant:")
        out.append(("user", human.strip()))
        for a in rest:
            out.append(("assistant", a.strip()))
    return out


def _hh(r: dict, i: int) -> Item:
    turns = parse_hh(r["chosen"])
    if not turns or turns[0][0] != "user" or not turns[0][1]:
        raise ValueError("no human turn")
    nxt = turns[2][1] if len(turns) > 2 and turns[2][0] == "user" else None
    first_assistant = turns[1][1] if len(turns) > 1 else None
    return Item(item_id=f"hh_rlhf-{i:04d}", dataset="hh_rlhf", prompt=turns[0][1], reference_next_user=nxt,
                meta={"original_assistant": first_assistant})


def _topical(conv_id: str, conv: dict, i: int) -> Item:
    msgs = conv["content"]
    if len(msgs) < 2:
        raise ValueError("conversation shorter than two messages")
    return Item(item_id=f"topical_chat-{i:04d}", dataset="topical_chat", prompt=msgs[0]["message"],
                reference_next_user=msgs[2]["message"] if len(msgs) > 2 else None,
                meta={"conversation_id": conv_id, "original_reply": msgs[1]["message"]})


MAPPERS: dict[str, Callable[[dict, int], Item]] = {
    "gsm8k": _gsm8k, "math500": _math500, "ifeval": _ifeval, "mt_bench": _mt_bench, "hh_rlhf": _hh,
}


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line), None
            except json.JSONDecodeError as e:
                yield n, None, f"invalid JSON ({e.msg})"


def _load_local(name: str, path: Path, limit: int | None) -> DatasetLoad:
    items: list[Item] = []
    skipped: list[SkippedRow] = []

    def skip(line: int, reason: str) -> None:
        skipped.append(SkippedRow(str(path), line, reason))
        log.warning("%s:%d: skipped malformed row (%s)", path, line, reason)

    if name == "topical_chat":
        data = json.loads(path.read_text())
        for i, (cid, conv) in enumerate(data.items()):
            try:
                items.append(_topical(cid, conv, i))
            except (KeyError, ValueError, TypeError, IndexError) as e:
                skip(i + 1, f"conversation {cid}: {e!r}")
            if limit and len(items) >= limit:
                break
        return DatasetLoad(items, skipped, str(path))
    mapper = MAPPERS[name] if name != "builtin" else _builtin
    index = 0
    for line, row, err in _jsonl_rows(path):
        if err is not None:
            skip(line, err)
            index += 1
            continue
        try:
            items.append(mapper(row, index))
        except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
            skip(line, f"missing or bad field {e!r}")
        index += 1
        if limit and len(items) >= limit:
            break
    return DatasetLoad(items, skipped, str(path))


def _builtin(r: dict, i: int) -> Item:
    return Item(item_id=r["item_id"], dataset="builtin", prompt=r["prompt"], gold=r.get("gold"),
                meta=r.get("meta", {}))


def _load_hub(name: str, limit: int | None, split: str) -> DatasetLoad:
    if name not in HUB:
        raise ValueError(f"{name} has no canonical Hugging Face copy; pass its local file with --data-path")
    import datasets as hf  # noqa: PLC0415 - optional dependency, users with a hub only

    hub_id, config, kw = HUB[name]
    kw = dict(kw)
    kw.setdefault("split", split)
    ds = hf.load_dataset(hub_id, config, **kw) if config else hf.load_dataset(hub_id, **kw)
    items: list[Item] = []
    skipped: list[SkippedRow] = []
    for i, row in enumerate(ds):
        try:
            items.append(MAPPERS[name](dict(row), i))
        except (KeyError, ValueError, TypeError, IndexError) as e:
            skipped.append(SkippedRow(f"hf:{hub_id}", i + 1, f"missing or bad field {e!r}"))
        if limit and len(items) >= limit:
            break
    return DatasetLoad(items, skipped, f"hf:{hub_id}")


def load_dataset(name: str, *, path: str | Path | None = None, split: str = "test", limit: int | None = None,
                 source: str = "auto") -> DatasetLoad:
    """Load ``name`` (see :data:`NAMES`) from ``path``, the local data folder, or the HF hub.

    ``source``: ``"local"``, ``"hf"`` or ``"auto"`` (local when found, else the hub if ``datasets``
    is installed).
    """
    if name not in NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(NAMES)}")
    if name == "builtin":
        p = Path(path) if path else Path(str(resources.files("mechprobe") / "data" / "builtin_prompts.jsonl"))
        return _load_local("builtin", p, limit)
    if source == "hf":
        return _load_hub(name, limit, split)
    folder, fname = LOCAL[name]
    if path is not None:
        p = Path(path)
        if p.is_dir():
            p = p / fname if (p / fname).exists() else p / folder / fname
    else:
        base = find_data_dir()
        p = base / folder / fname if base is not None else Path("<not found>")
    if p.exists():
        return _load_local(name, p, limit)
    if source == "auto":
        try:
            import datasets  # noqa: F401, PLC0415
        except ImportError:
            datasets = None  # type: ignore[assignment]
        if datasets is not None and name in HUB:
            return _load_hub(name, limit, split)
    raise FileNotFoundError(
        f"dataset {name!r}: no local file at {p}. Pass --data-path FILE_OR_DIR, set MECHPROBE_DATA_DIR to a "
        f"folder holding {folder}/{fname}, or `pip install datasets` to read it from the Hugging Face hub."
    )
