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

    Args:
        item_id: stable id (``<dataset>-<row index>``, or the builtin prompt's own id); every later
            record keys on it.
        dataset: dataset name (``gsm8k``, ``builtin``, ...).
        prompt: the user query the model answers.
        gold: reference answer for the task scorer; None (default) when there is none.
        messages: earlier conversation as ``{"role", "content"}`` dicts; empty (default) for single-turn data.
        reference_next_user: a real human's next user turn, where the dataset has one; None by default.
        meta: dataset-specific extras (the dataset's own ids, the scorer to use); empty by default.

    Example:
        >>> from mechprobe import Item
        >>> it = Item(item_id="demo-0", dataset="builtin", prompt="What is 12 * 7?", gold="84")
        >>> it.to_dict()["gold"], it.messages
        ('84', [])
        >>> Item.from_dict(it.to_dict()) == it
        True
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
    """The model's own assistant turn for one item, with its task score.

    One row of ``RUN/assistant.jsonl``: the answer the user turn will react to.

    Args:
        item_id: the :class:`Item` it answers.
        dataset: dataset name.
        prompt: the user query.
        response: the model's answer (decoded text, without the end-of-turn token).
        stop_reason: ``"end_of_turn"`` or ``"max_tokens"`` (the answer was cut at the token cap; headline
            rates leave such items out, see :func:`truncated_item_ids`).
        n_tokens: generated tokens of the answer.
        score: 1.0/0.0 for exact-match tasks, None (default) when unscored.
        extracted: what the scorer read out of the response; None by default.
        gold: the item's reference answer; None by default.
        messages: the item's earlier conversation; empty by default.
        reference_next_user: the dataset's human next turn, if any; None by default.

    Example:
        >>> from mechprobe import AssistantRecord
        >>> a = AssistantRecord(item_id="demo-0", dataset="builtin", prompt="What is 12 * 7?",
        ...                     response="12 * 7 = 84.", stop_reason="end_of_turn", n_tokens=9, score=1.0)
        >>> AssistantRecord.from_dict(a.to_dict()) == a
        True
    """

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

    Args:
        record_id: stable id, ``<item_id>|greedy|s0`` or ``<item_id>|T1|s2`` (plus ``|<variant>`` for
            perturbation variants); resume, labels and activation rows key on it.
        item_id: the source :class:`Item`.
        dataset: dataset name.
        decoding: ``"greedy"`` or ``"sample"``.
        temperature: sampling temperature (0.0 for greedy).
        sample_index: index of the sample at this temperature (0 for greedy).
        seed: the row's RNG seed (None for greedy).
        raw_text: the generated user turn with special tokens.
        text: the cleaned user turn.
        stop_reason: ``"end_of_turn"``, ``"eos"`` or ``"max_tokens"``.
        prompt_ids: token ids of the probe prompt (conversation + user-role header).
        boundary_index: index in ``prompt_ids`` of the last header token (always ``len(prompt_ids) - 1``).
        assistant_span: ``(start, end)`` token span of the assistant response in ``prompt_ids``.
        generated_ids: the generated token ids; empty by default.
        variant: ``"full"`` (default) or the name of a perturbation variant of the study.

    Example:
        >>> from mechprobe import UserTurnRecord
        >>> u = UserTurnRecord(record_id="demo-0|greedy|s0", item_id="demo-0", dataset="builtin",
        ...                    decoding="greedy", temperature=0.0, sample_index=0, seed=None,
        ...                    raw_text="Why 84?<|im_end|>", text="Why 84?", stop_reason="end_of_turn",
        ...                    prompt_ids=[1, 2, 3, 4, 5], boundary_index=4, assistant_span=(2, 3))
        >>> u.to_dict()["assistant_span"]     # a list in JSON, a tuple again after from_dict
        [2, 3]
        >>> UserTurnRecord.from_dict(u.to_dict()) == u
        True
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
    """A judge's verdict on one user turn. ``label`` is a taxonomy label or ``judge_error``.

    Args:
        record_id: the :class:`UserTurnRecord` judged.
        label: one of :data:`mechprobe.taxonomy.LABELS`, or ``"judge_error"``.
        genuine: True for ``genuine_followup``, False for the other labels, None for ``judge_error``
            (such rows count as no label at all).
        rationale: the judge's reason (a rule id for the offline judge).
        judge: the judge's name, e.g. ``"offline-v3+lexical"`` or ``"openai:gpt-4o-mini@prompt-v2-codebook"``.
        error: why the judge failed (with ``judge_error``); None by default.
        probs: per-label probabilities from judges that score every label (``local:``, ``hybrid:``);
            None (default) for judges that only name one label.

    Example:
        >>> from mechprobe import LabelRecord
        >>> r = LabelRecord(record_id="demo-0|greedy|s0", label="genuine_followup", genuine=True,
        ...                 rationale="asks about the 84 in the answer", judge="hand")
        >>> r.to_dict()["genuine"], LabelRecord.from_dict(r.to_dict()) == r
        (True, True)
    """

    record_id: str
    label: str
    genuine: bool | None
    rationale: str
    judge: str  # e.g. "offline-v2" or "openai:gpt-4o-mini@prompt-v2-codebook"
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
    return f"{k} of {n} answers truncated, " + ("included (include_truncated=True)" if included else "excluded")
