"""The SFT data: real conversations up to an assistant turn, each with the human turn that followed it
(HH-RLHF, Topical-Chat), split into train and held-out conversations that never share one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.splits import split_of
from mechprobe.turns.datasets import load_dataset

__all__ = ["SOURCES", "Conversation", "PostTrainError", "assert_disjoint", "conversations_from_items",
           "load_conversations", "split_conversations"]

SOURCES = ("hh_rlhf", "topical_chat")


class PostTrainError(UserError, ValueError):
    """A post-training input is unusable (template cannot host the example, no data, bad config)."""


@dataclass(frozen=True)
class Conversation:
    """A real conversation up to an assistant turn, and the human turn that followed it.

    ``conv_id`` is ``<source>:<the dataset's own id>`` (Topical-Chat conversation id; the HH-RLHF row id):
    the unit of the train/held-out split, so no conversation contributes to both sides.
    """

    conv_id: str
    source: str
    messages: list[dict[str, str]]  # ends with the assistant turn
    next_user: str


def conversations_from_items(items: Sequence[Any], source: str) -> list[Conversation]:
    """Items of the HH-RLHF / Topical-Chat loaders -> conversations (rows without a next human turn dropped).

    The loaders keep the first user turn in ``prompt``, the original reply in ``meta`` and the human's next
    turn in ``reference_next_user``; earlier turns, if any, in ``messages``.
    """
    out: list[Conversation] = []
    for it in items:
        reply = it.meta.get("original_assistant") or it.meta.get("original_reply")
        nxt = (it.reference_next_user or "").strip()
        if not reply or not str(reply).strip() or not nxt:
            continue
        own = it.meta.get("conversation_id") or it.item_id
        msgs = [*(it.messages or []), {"role": "user", "content": it.prompt.strip()},
                {"role": "assistant", "content": str(reply).strip()}]
        out.append(Conversation(conv_id=f"{source}:{own}", source=source, messages=msgs, next_user=nxt))
    return out


def load_conversations(sources: Sequence[str] = SOURCES, data_path: str | Path | None = None,
                       limit: int | None = None) -> list[Conversation]:
    """Conversations from the local conversation datasets (``../shared/data`` or ``$MECHPROBE_DATA_DIR``)."""

    bad = [s for s in sources if s not in SOURCES]
    if bad:
        raise UsageError(f"unknown training source(s) {bad}: choose from {', '.join(SOURCES)}")
    out: list[Conversation] = []
    for s in sources:
        try:
            res = load_dataset(s, path=data_path, limit=limit, source="local")
        except FileNotFoundError as e:
            raise MissingInput(str(e)) from e
        out.extend(conversations_from_items(res.items, s))
    if not out:
        raise PostTrainError(f"no conversation with an assistant turn and a next human turn in {list(sources)}")
    return out




def split_conversations(convs: Sequence[Conversation], held_out_fraction: float = 0.1
                        ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out); raises if an id lands on both sides (duplicate ids across rows)."""
    if not 0.0 <= held_out_fraction < 1.0:
        raise UsageError(f"held-out fraction must be in [0, 1), got {held_out_fraction}")
    train = [c for c in convs if split_of(c.conv_id, held_out_fraction) == "train"]
    held = [c for c in convs if split_of(c.conv_id, held_out_fraction) == "heldout"]
    assert_disjoint(train, held)
    return train, held


def assert_disjoint(train: Sequence[Conversation], held: Sequence[Conversation]) -> None:
    both = {c.conv_id for c in train} & {c.conv_id for c in held}
    if both:
        raise PostTrainError(f"{len(both)} conversation id(s) in both train and held-out, e.g. {sorted(both)[:3]}")
