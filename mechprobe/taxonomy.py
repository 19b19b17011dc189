"""The user-turn failure taxonomy: the one place its labels and definitions live.

Why one module: the LLM judge's prompt, the offline judge, the agreement reports and the docs must
all read the *same* definitions, or a label would quietly mean different things at different stages
(and the probes and steering vectors downstream are only as good as these labels). Change a
definition here and bump :data:`TAXONOMY_VERSION`, which is part of every judge's cache key.
"""

from __future__ import annotations

from dataclasses import dataclass

TAXONOMY_VERSION = "taxonomy-v1"

GENUINE = "genuine_followup"
JUDGE_ERROR = "judge_error"  # not a label: a judge that failed on this turn; never counted as any label


@dataclass(frozen=True)
class Label:
    name: str
    definition: str


TAXONOMY: tuple[Label, ...] = (
    Label(GENUINE,
          "in the user's voice, reacts specifically to the assistant's response: asks about a step, claim "
          "or number in it; challenges or corrects it; asks for clarification, elaboration or the next "
          "step of the same task; or acknowledges it and builds on it. Grounded in the response itself."),
    Label("generic_followup",
          "user-voiced reaction with no specific grounding (\"Thanks!\", \"Can you explain more?\")."),
    Label("new_query",
          "a new self-contained request (a different problem, a new task), even on the same topic or "
          "reusing names from the question, that does not react to the answer."),
    Label("prompt_restatement", "repeats or paraphrases the original user query."),
    Label("assistant_continuation",
          "writes as the assistant: continues or redoes the answer, solves the problem, emits reasoning "
          "or analysis channels, opens an assistant header."),
    Label("meta_planning", "talks about how to approach or format the task (\"We need to ...\")."),
    Label("identity_leakage", "speaks as the AI/model (\"As an AI language model ...\")."),
    Label("empty_or_degenerate", "empty, only special tokens, repetition loops, gibberish."),
)

LABELS: tuple[str, ...] = tuple(lab.name for lab in TAXONOMY)
DEFINITIONS: dict[str, str] = {lab.name: lab.definition for lab in TAXONOMY}


def is_genuine(label: str) -> bool | None:
    """``genuine`` as stored in a :class:`~mechprobe.records.LabelRecord`: None for judge errors."""
    if label == JUDGE_ERROR:
        return None
    check_label(label)
    return label == GENUINE


def check_label(label: str) -> str:
    """Return ``label`` if it is a taxonomy label, else raise naming the valid ones."""
    if label not in DEFINITIONS:
        raise ValueError(f"unknown label {label!r}; valid labels: {', '.join(LABELS)}")
    return label


def definitions_markdown(heading: str | None = None) -> str:
    """The taxonomy as a markdown bullet list (the judge prompt and docs/judging.md embed this text)."""
    lines = [heading, ""] if heading else []
    lines += [f"- `{lab.name}` — {lab.definition}" for lab in TAXONOMY]
    return "\n".join(lines)
