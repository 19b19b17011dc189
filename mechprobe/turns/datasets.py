"""Dataset loaders: local files by path (tests, offline runs) or Hugging Face ``datasets`` (hub users).

Every loader returns :class:`~mechprobe.records.Item` records with stable ids
``<name>-<row index>`` (``gsm8k-0007``: the 0-based position of the row among the non-blank rows of
the file, malformed rows included). Ids therefore do not move when ``--limit`` grows or a broken
line is repaired, and a run resumed later keys the same rows the same way. The dataset's own ids
(IFEval ``key``, MT-Bench ``question_id``, MATH ``unique_id``, Topical-Chat conversation id) are kept
in ``meta``. The bundled ``builtin`` prompts carry their own ``item_id``.

Malformed rows (bad JSON, a missing or empty field) are reported as :class:`SkippedRow` with file and
line, logged as a warning and skipped: one bad line in a 10k-row file should not cost the other rows,
and the count goes into the run manifest.

Where local files are looked for (first hit wins):

1. ``path`` if given: a file, or a folder holding ``<file>`` or ``<folder>/<file>`` (see :data:`SPECS`);
2. ``$MECHPROBE_DATA_DIR`` (a folder laid out like ``shared/data``: ``gsm8k/test.jsonl`` ...);
3. a ``shared/data`` folder in the current directory or any of its parents, then in the package's
   checkout or any of its parents. With the checkout beside a ``shared`` folder (``<parent>/<checkout>`` and
   ``<parent>/shared/data``), ``../shared/data`` is found from the repo root without configuration.

Hub copies (``source="hf"``, or ``"auto"`` when no local file exists and ``datasets`` imports) use
the standard ids in :data:`SPECS`. IFEval and MT-Bench only have a ``train`` split on the hub, which
holds the whole benchmark, so that split is used whatever ``split`` says. MT-Bench comes from
``HuggingFaceH4/mt_bench_prompts`` (the widely used copy of FastChat's ``question.jsonl``; it renames
``turns`` to ``prompt`` and replaces ``question_id`` by a hash). Topical-Chat has no canonical hub
copy: it is read from its GitHub file only. Without network the hub library retries for ~25 s before
failing; ``HF_HUB_OFFLINE=1`` makes it fail at once.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import sha256_file
from mechprobe.records import Item

log = logging.getLogger(__name__)

DATA_DIR_ENV = "MECHPROBE_DATA_DIR"
SOURCES = ("auto", "local", "hf")


@dataclass
class SkippedRow:
    """A row that could not be turned into an :class:`Item`; ``line`` is 1-based in ``file``
    (for hub rows, ``file`` is ``hf:<id>`` and ``line`` the 1-based row number)."""

    file: str
    line: int
    reason: str


@dataclass
class DatasetLoad:
    """What :func:`load_dataset` returns: the items, the rows it skipped, and where they came from
    (a file path or ``hf:<hub id>``), so the run manifest can say exactly what was asked."""

    items: list[Item]
    skipped: list[SkippedRow] = field(default_factory=list)
    source: str = ""
    # What the rows are, independent of where they were read from: ``sha256:<hex>`` of a local file's
    # bytes, or ``hf:<id>[/<config>]@<split>``. Part of a run's identity, so two files that share a
    # dataset name can never be mixed into one run.
    fingerprint: str = ""


class HubLoadError(UserError, RuntimeError):
    """``datasets.load_dataset`` failed (no network, unknown split, auth)."""


class RowError(ValueError):
    """A row is malformed; the message is the reason stored in :class:`SkippedRow`."""


Mapper = Callable[[dict[str, Any], int], Item]


def _text(row: dict[str, Any], key: str) -> str:
    """A required non-empty string field, or a :class:`RowError` naming it."""
    if key not in row:
        raise RowError(f"missing field {key!r}")
    v = row[key]
    if not isinstance(v, str):
        raise RowError(f"field {key!r} is {type(v).__name__}, expected a string")
    if not v.strip():
        raise RowError(f"field {key!r} is empty")
    return v


def _iid(name: str, index: int) -> str:
    return f"{name}-{index:04d}"


# ---------------------------------------------------------------------------------------------------
# Row mappers, (row, index) -> Item. Shared by the local and the hub paths: the hub schemas are the
# files' schemas, except MT-Bench (``prompt`` for ``turns``) and IFEval (kwargs padded with None).


def gsm8k_gold(answer: str) -> str:
    """The gold of a GSM8K solution: the text after the last ``####``, commas removed."""
    if "####" not in answer:
        raise RowError("field 'answer' has no '#### <number>' final line")
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise RowError("field 'answer' has nothing after '####'")
    return gold


def _gsm8k(r: dict[str, Any], i: int) -> Item:
    answer = _text(r, "answer")
    return Item(item_id=_iid("gsm8k", i), dataset="gsm8k", prompt=_text(r, "question"),
                gold=gsm8k_gold(answer), meta={"solution": answer})


def _math500(r: dict[str, Any], i: int) -> Item:
    if r.get("answer") is None or not str(r["answer"]).strip():
        raise RowError("missing field 'answer'")
    return Item(item_id=_iid("math500", i), dataset="math500", prompt=_text(r, "problem"), gold=str(r["answer"]),
                meta={k: r[k] for k in ("subject", "level", "unique_id") if k in r})


def _ifeval(r: dict[str, Any], i: int) -> Item:
    ids, kwargs = r.get("instruction_id_list"), r.get("kwargs")
    if not isinstance(ids, list) or not ids:
        raise RowError("missing field 'instruction_id_list'")
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise RowError("field 'kwargs' must be a list with one dict per instruction")
    # The hub copy pads every kwargs dict with all argument names set to None; drop them so local and
    # hub rows give the same item (the checkers treat an absent and a None argument alike).
    kw = [{k: v for k, v in (d or {}).items() if v is not None} for d in kwargs]
    return Item(item_id=_iid("ifeval", i), dataset="ifeval", prompt=_text(r, "prompt"),
                meta={"key": r.get("key"), "instruction_id_list": list(ids), "kwargs": kw})


def _mt_bench(r: dict[str, Any], i: int) -> Item:
    turns = r.get("turns", r.get("prompt"))
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise RowError("missing field 'turns' (a list of user turns)")
    if not turns[0].strip():
        raise RowError("first turn is empty")
    second = turns[1] if len(turns) > 1 and turns[1].strip() else None
    meta: dict[str, Any] = {"question_id": r.get("question_id"), "category": r.get("category"), "turn_2": second}
    if r.get("reference"):
        meta["reference"] = list(r["reference"])
    # The benchmark's second turn is a follow-up written for this exact first turn: the closest thing
    # MT-Bench has to a reference next user turn.
    return Item(item_id=_iid("mt_bench", i), dataset="mt_bench", prompt=turns[0], reference_next_user=second,
                meta=meta)


_HH_MARK = re.compile(r"\n\n(Human|Assistant):[ ]?")


def parse_hh(transcript: str) -> list[tuple[str, str]]:
    """Split an HH-RLHF transcript (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) into (role, text) turns.

    Roles are ``user``/``assistant``. A few transcripts have two turns of one role in a row; they are
    merged (joined by a blank line), so the result always alternates and "the human turn after the
    first assistant turn" is well defined.
    """
    parts = _HH_MARK.split(transcript)
    if parts[0].strip():
        raise RowError("transcript does not start with '\\n\\nHuman:'")
    turns: list[tuple[str, str]] = []
    for role_name, text in zip(parts[1::2], parts[2::2]):
        role = "user" if role_name == "Human" else "assistant"
        text = text.strip()
        if turns and turns[-1][0] == role:
            turns[-1] = (role, f"{turns[-1][1]}\n\n{text}".strip())
        else:
            turns.append((role, text))
    return turns


def _hh(r: dict[str, Any], i: int) -> Item:
    turns = parse_hh(_text(r, "chosen"))
    if not turns or turns[0][0] != "user" or not turns[0][1]:
        raise RowError("field 'chosen' has no first Human turn")
    first_assistant = turns[1][1] if len(turns) > 1 else None
    nxt = turns[2][1] if len(turns) > 2 and turns[2][1] else None
    return Item(item_id=_iid("hh_rlhf", i), dataset="hh_rlhf", prompt=turns[0][1], reference_next_user=nxt,
                meta={"original_assistant": first_assistant, "n_turns": len(turns)})


def _topical(r: dict[str, Any], i: int) -> Item:
    msgs = r.get("content")
    if not isinstance(msgs, list):
        raise RowError("missing field 'content'")
    # Group consecutive messages of one agent into one turn, so turn 0 and turn 2 are one speaker
    # (our "user") and turn 1 the other (the original "assistant" reply).
    turns: list[tuple[str, str]] = []
    for m in msgs:
        agent, text = _text(m, "agent"), _text(m, "message").strip()
        if turns and turns[-1][0] == agent:
            turns[-1] = (agent, f"{turns[-1][1]}\n{text}")
        else:
            turns.append((agent, text))
    if len(turns) < 2:
        raise RowError("conversation has fewer than two turns")
    return Item(item_id=_iid("topical_chat", i), dataset="topical_chat", prompt=turns[0][1],
                reference_next_user=turns[2][1] if len(turns) > 2 else None,
                meta={"conversation_id": r.get("conversation_id"), "user_agent": turns[0][0],
                      "original_reply": turns[1][1]})


def _builtin(r: dict[str, Any], i: int) -> Item:
    meta = r.get("meta") or {}
    if not isinstance(meta, dict):
        raise RowError("field 'meta' must be an object")
    gold = r.get("gold")
    return Item(item_id=_text(r, "item_id"), dataset="builtin", prompt=_text(r, "prompt"),
                gold=None if gold is None else str(gold), meta=meta)


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset lives locally and on the hub, and how its rows become items."""

    folder: str
    filename: str
    mapper: Mapper
    hub_id: str | None = None
    hub_config: str | None = None
    hub_kwargs: tuple[tuple[str, str], ...] = ()
    hub_only_split: str | None = None  # the hub copy's single split, used whatever ``split`` says


SPECS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("gsm8k", "test.jsonl", _gsm8k, "openai/gsm8k", "main"),
    "math500": DatasetSpec("math500", "test.jsonl", _math500, "HuggingFaceH4/MATH-500"),
    "ifeval": DatasetSpec("ifeval", "input_data.jsonl", _ifeval, "google/IFEval", hub_only_split="train"),
    "mt_bench": DatasetSpec("mt_bench", "question.jsonl", _mt_bench, "HuggingFaceH4/mt_bench_prompts",
                            hub_only_split="train"),
    "hh_rlhf": DatasetSpec("hh_rlhf_harmless_test", "test.jsonl.gz", _hh, "Anthropic/hh-rlhf",
                           hub_kwargs=(("data_dir", "harmless-base"),)),
    "topical_chat": DatasetSpec("topical_chat", "test_freq.json", _topical),
}
NAMES = ("builtin", *SPECS)
BUILTIN_FILE = "builtin_prompts.jsonl"


# ---------------------------------------------------------------------------------------------------
# Finding files


def data_dir_candidates() -> list[Path]:
    """Every folder :func:`find_data_dir` considers, in order (also listed in the not-found error)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return [Path(env).expanduser()]
    out: list[Path] = []
    for start in (Path.cwd().resolve(), Path(__file__).resolve().parents[2]):
        for base in (start, *start.parents):
            d = base / "shared" / "data"
            if d not in out:
                out.append(d)
    return out


def find_data_dir() -> Path | None:
    """The local data folder: ``$MECHPROBE_DATA_DIR`` if set (even if missing, so a typo is reported
    rather than silently replaced), else the first existing ``shared/data`` upwards from the current
    directory, then from the package checkout. None when there is none."""
    if os.environ.get(DATA_DIR_ENV):
        return data_dir_candidates()[0]
    return next((d for d in data_dir_candidates() if d.is_dir()), None)


def _local_file(spec: DatasetSpec, path: str | Path | None) -> Path | None:
    if path is not None:
        p = Path(path).expanduser()
        if p.is_dir():
            for cand in (p / spec.filename, p / spec.folder / spec.filename):
                if cand.is_file():
                    return cand
            return None
        return p if p.is_file() else None
    base = find_data_dir()
    if base is None:
        return None
    p = base / spec.folder / spec.filename
    return p if p.is_file() else None


def _not_found(name: str, spec: DatasetSpec, path: str | Path | None, hub_failure: str | None = None
               ) -> FileNotFoundError:
    if path is not None:
        where = f"nothing at {path} (expected the file, or a folder holding {spec.filename} or " \
                f"{spec.folder}/{spec.filename})"
    elif os.environ.get(DATA_DIR_ENV):
        where = f"no {spec.folder}/{spec.filename} in ${DATA_DIR_ENV}={os.environ[DATA_DIR_ENV]}"
    else:
        looked = ", ".join(str(d) for d in data_dir_candidates()[:4])
        where = f"no shared/data/{spec.folder}/{spec.filename} found (looked in {looked}, ...)"
    if spec.hub_id is None:
        hub = f" ({name} has no Hugging Face hub copy)"
    elif hub_failure:
        hub = f"; reading it from the Hugging Face hub failed: {hub_failure}"
    else:
        hub = ", or install `datasets` (pip install 'mechprobe[hub]') to read it from the Hugging Face hub"
    return FileNotFoundError(
        f"dataset {name!r}: {where}. Pass data_path=FILE_OR_DIR (path= to load_dataset) or set {DATA_DIR_ENV} to a "
        f"folder laid out like shared/data{hub}. Offline with no data files: use dataset=builtin."
    )


# ---------------------------------------------------------------------------------------------------
# Reading rows: (line, row or None, error or None)


def _not_utf8(path: Path, e: UnicodeDecodeError) -> UsageError:
    """One line naming the file, the first undecodable line and the fix (data files are read as UTF-8)."""
    opener = gzip.open if path.suffix == ".gz" else open
    line = "?"
    with contextlib.suppress(OSError, EOFError), opener(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                line = str(n)
                break
    return UsageError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start} of that line or chunk); "
                      f"convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) and re-run")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = enumerate(f, start=1)
        while True:
            try:
                n, line = next(lines)
            except StopIteration:
                return
            except UnicodeDecodeError as e:
                raise _not_utf8(path, e) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, None, f"invalid JSON ({e.msg}, column {e.colno})"
                continue
            if not isinstance(row, dict):
                yield n, None, f"expected a JSON object, got {type(row).__name__}"
                continue
            yield n, row, None


def _json_object_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """Rows of a JSON file holding one object keyed by row id (Topical-Chat); line = where the key is.

    A file that is not valid JSON as a whole cannot be read row by row, so that is an error, not a skip.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON (line {e.lineno}: {e.msg}); re-download the file") from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected one JSON object keyed by conversation id, got {type(data).__name__}")
    pos = 0
    line = 1
    for key, value in data.items():
        at = text.find(json.dumps(key, ensure_ascii=False), pos)
        if at < 0:
            at = text.find(json.dumps(key), pos)
        if at >= 0:
            line += text.count("\n", pos, at)
            pos = at
        if not isinstance(value, dict):
            yield line, None, f"conversation {key}: expected an object, got {type(value).__name__}"
            continue
        yield line, {"conversation_id": key, **value}, None


def _collect(rows: Iterator[tuple[int, dict[str, Any] | None, str | None]], mapper: Mapper, where: str,
             limit: int | None) -> tuple[list[Item], list[SkippedRow]]:
    """Map rows to items; index = position among rows (malformed ones included, so ids are stable)."""
    items: list[Item] = []
    skipped: list[SkippedRow] = []
    seen: set[str] = set()

    def skip(line: int, reason: str) -> None:
        skipped.append(SkippedRow(where, line, reason))
        log.warning("%s:%d: skipped malformed row: %s", where, line, reason)

    if limit == 0:
        return items, skipped
    for index, (line, row, err) in enumerate(rows):
        if err is not None or row is None:
            skip(line, err or "empty row")
            continue
        try:
            item = mapper(row, index)
        except RowError as e:
            skip(line, str(e))
            continue
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            skip(line, f"bad row ({type(e).__name__}: {e})")
            continue
        if item.item_id in seen:
            skip(line, f"duplicate item_id {item.item_id!r}")
            continue
        seen.add(item.item_id)
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    return items, skipped


def _load_file(name: str, path: Path, limit: int | None) -> DatasetLoad:
    mapper = _builtin if name == "builtin" else SPECS[name].mapper
    rows = _json_object_rows(path) if path.suffix == ".json" else _jsonl_rows(path)
    items, skipped = _collect(rows, mapper, str(path), limit)

    return DatasetLoad(items, skipped, str(path), f"sha256:{sha256_file(path)}")


def _load_hub(name: str, split: str, limit: int | None) -> DatasetLoad:
    spec = SPECS[name]
    if spec.hub_id is None:
        raise UsageError(
            f"dataset {name!r} has no canonical Hugging Face hub copy; download test_freq.json from the "
            f"alexa/Topical-Chat GitHub repository (conversations/) and pass it with data_path=")
    try:
        import datasets as hf  # lazy: extra [hub]
    except ImportError as e:
        raise ImportError(f"reading {name!r} from the Hugging Face hub needs `datasets`: pip install "
                          f"'mechprobe[hub]' (or pass a local file with data_path=)") from e
    kwargs: dict[str, Any] = dict(spec.hub_kwargs)
    kwargs["split"] = spec.hub_only_split or split
    args = (spec.hub_id, spec.hub_config) if spec.hub_config else (spec.hub_id,)
    where = f"hf:{spec.hub_id}"
    try:
        ds = hf.load_dataset(*args, **kwargs)
    except Exception as e:  # network, auth, unknown split: all end the same way for the user
        raise HubLoadError(f"could not load {spec.hub_id} ({kwargs}): {type(e).__name__}: {e}") from e
    rows = ((i + 1, dict(r), None) for i, r in enumerate(ds))
    items, skipped = _collect(rows, spec.mapper, where, limit)
    config = f"/{spec.hub_config}" if spec.hub_config else ""
    return DatasetLoad(items, skipped, where, f"{where}{config}@{kwargs['split']}")


def _datasets_importable() -> bool:
    try:
        import datasets  # noqa: F401  # lazy: extra [hub]
    except ImportError:
        return False
    return True


def load_dataset(name: str, *, path: str | Path | None = None, split: str = "test", limit: int | None = None,
                 source: str = "auto") -> DatasetLoad:
    """Load dataset ``name`` (one of :data:`NAMES`) as items.

    ``path``: a local file or folder (see the module docstring for the search when None). For
    ``builtin`` it may name another prompt file of the same row format. ``split``: the hub split
    (local files are the test sets; IFEval and MT-Bench have a single split). ``limit``: at most this
    many items, the first ones of the file. ``source``: ``"local"`` (files only), ``"hf"`` (hub only)
    or ``"auto"`` (a local file when there is one, else the hub when ``datasets`` is installed).

    Args:
        name: ``"builtin"`` (the bundled prompts), ``"gsm8k"``, ``"math500"``, ``"ifeval"``, ``"mt_bench"``,
            ``"hh_rlhf"`` or ``"topical_chat"``.
        path: local file or folder; None (default) = search ``$MECHPROBE_DATA_DIR`` and ``shared/data``.
        split: hub split (default ``"test"``).
        limit: at most this many items (>= 0), the first of the file; None (default) = all.
        source: ``"auto"`` (default), ``"local"`` or ``"hf"``.

    Returns:
        A :class:`DatasetLoad`: ``items`` (``list[Item]``), ``skipped`` (malformed rows with file and line),
        ``source`` (file path or ``hf:<id>``) and ``fingerprint`` (``sha256:<hex>`` of the file, or the hub
        id and split), which the run manifest records.

    Raises:
        UsageError: unknown name or source, negative limit.
        MissingInput / HubLoadError: no local file and no usable hub copy.

    Example:
        >>> from mechprobe import load_dataset
        >>> data = load_dataset("builtin", limit=2)
        >>> [it.item_id for it in data.items], data.items[0].gold, data.skipped
        (['builtin-math-00', 'builtin-math-01'], '159', [])
        >>> data.fingerprint.startswith("sha256:")
        True
        >>> load_dataset("gsm8k", path="shared/data", limit=50)           # doctest: +SKIP
    """
    if name not in NAMES:
        raise UsageError(f"unknown dataset {name!r}; choose one of: {', '.join(NAMES)}")
    if source not in SOURCES:
        raise UsageError(f"unknown source {source!r}; choose one of: {', '.join(SOURCES)}")
    if limit is not None and limit < 0:
        raise UsageError(f"limit must be >= 0 (or None for all rows), got {limit}")
    if name == "builtin":
        if path is None:
            return _load_file(name, Path(str(resources.files("mechprobe") / "data" / BUILTIN_FILE)), limit)
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / BUILTIN_FILE
        if not p.is_file():
            raise MissingInput(f"builtin prompts: no file at {p}; omit data_path= for the bundled set")
        return _load_file(name, p, limit)

    spec = SPECS[name]
    if source == "hf":
        try:
            return _load_hub(name, split, limit)
        except HubLoadError as e:
            raise HubLoadError(f"{e}. Offline, pass a local file with data_path= instead.") from e.__cause__
    local = _local_file(spec, path)
    if local is not None:
        return _load_file(name, local, limit)
    if source == "local" or path is not None or spec.hub_id is None or not _datasets_importable():
        raise _not_found(name, spec, path)
    try:
        return _load_hub(name, split, limit)
    except HubLoadError as e:
        raise _not_found(name, spec, path, str(e)) from e
