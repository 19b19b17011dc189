"""Typed records that flow between pipeline stages.

Every stage reads and writes these as JSON lines, so a record must round-trip through
``to_dict`` / ``from_dict`` without loss. Keys are stable strings (``item_id``, ``record_id``) because
resuming a crashed run, joining labels to activations and grouping cross-validation folds all key on
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def _from_dict(cls: type[T], d: dict[str, Any]) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**d)


@dataclass
class Item:
    """One dataset row, ready to be asked.

    ``messages`` holds any conversation *before* the probed user query (empty for single-turn
    datasets); ``prompt`` is the user query the model answers. ``gold`` is what the task scorer
    compares against (None when the dataset has no verifiable answer). ``reference_next_user`` is
    a real human's next turn, for conversation datasets (HH-RLHF, Topical-Chat).
    """

    item_id: str
    dataset: str
    prompt: str
    gold: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    reference_next_user: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Item:
        return _from_dict(cls, d)


@dataclass
class AssistantRecord:
    """The model's own assistant turn for one item, with its task score."""

    item_id: str
    dataset: str
    prompt: str
    response: str
    stop_reason: str  # "end_of_turn" | "max_tokens"
    n_tokens: int
    score: float | None = None  # 1.0/0.0 for exact-match tasks, None when unscored
    extracted: str | None = None  # what the scorer read out of the response
    gold: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    reference_next_user: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AssistantRecord:
        return _from_dict(cls, d)


@dataclass
class UserTurnRecord:
    """One generated user turn.

    ``prompt_ids`` is the full probe prompt (conversation + the template's user-role header);
    ``boundary_index`` is the index in ``prompt_ids`` of the last header token, where activations
    are read and steering is applied. ``assistant_span`` is the [start, end) token span of the
    assistant response inside ``prompt_ids``. ``raw_text`` keeps special tokens so a model that
    opens an assistant header or a reasoning channel is visible to the judge; ``text`` is the
    cleaned user turn.
    """

    record_id: str
    item_id: str
    dataset: str
    decoding: str  # "greedy" | "sample"
    temperature: float
    sample_index: int
    seed: int | None
    raw_text: str
    text: str
    stop_reason: str  # "end_of_turn" | "max_tokens"
    prompt_ids: list[int]
    boundary_index: int
    assistant_span: tuple[int, int]
    generated_ids: list[int] = field(default_factory=list)
    variant: str = "full"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["assistant_span"] = list(self.assistant_span)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UserTurnRecord:
        d = dict(d)
        d["assistant_span"] = tuple(d["assistant_span"])
        return _from_dict(cls, d)


def make_record_id(item_id: str, decoding: str, temperature: float, sample_index: int,
                   variant: str = "full") -> str:
    """Stable id of one user turn: the same command regenerates the same ids, so resume can skip them."""
    t = "greedy" if decoding == "greedy" else f"T{temperature:g}"
    base = f"{item_id}|{t}|s{sample_index}"
    return base if variant == "full" else f"{base}|{variant}"


@dataclass
class LabelRecord:
    """A judge's verdict on one user turn. ``label`` is a taxonomy label or ``judge_error``."""

    record_id: str
    label: str
    genuine: bool | None
    rationale: str
    judge: str  # e.g. "offline-v2" or "openai:gpt-4o-mini@prompt-v1"
    error: str | None = None
    # Per-label probabilities from judges that score every label (``local:``); what a calibration
    # plot or a soft-label probe wants. None for judges that only name one label.
    probs: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabelRecord:
        return _from_dict(cls, d)


TRUNCATED = "max_tokens"  # the stop reason of an assistant answer that hit its token cap


def truncated_item_ids(assistants: Iterable[AssistantRecord | dict[str, Any]]) -> set[str]:
    """Item ids whose assistant answer hit the token cap (``stop_reason == "max_tokens"``).

    Why it matters: the user turn after a cut-off answer reacts to a reply that stops mid-sentence, so it
    is not a turn about a finished exchange; headline follow-up rates leave such items out by default.
    """
    out = set()
    for a in assistants:
        d = a.to_dict() if isinstance(a, AssistantRecord) else a
        if d.get("stop_reason") == TRUNCATED:
            out.add(str(d["item_id"]))
    return out


def truncation_note(k: int, n: int, included: bool) -> str:
    """``"2 of 40 answers truncated, excluded"`` (or ``included``), the line every summary prints."""
    return f"{k} of {n} answers truncated, " + ("included (--include-truncated)" if included else "excluded")
