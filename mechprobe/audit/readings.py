"""Two readings of ``genuine_followup`` from one labelling pass: lenient (the label) and strict.

Why two: the lenient reading counts any user-voiced turn that points at the answer, including templated
acknowledgements ("I see, I can now calculate ..."), garbled text with an answer's number in it and requests
for "the final answer". The strict reading (codebook v2, section "Strict and lenient readings") asks in addition
that the turn be coherent, in the user's voice, and refer to something specific only the answer contains. A
rate that moves a lot between the two says how much of a "follow-up" effect rests on such turns.

How it is coded: a labeller gives the lenient label and, on a ``genuine_followup`` row, a ``strict`` value:
``yes`` (genuine under both readings) or the label the turn gets under the strict reading (``no`` alone means
``generic_followup``). Rows labelled otherwise are the same under both readings (the strict reading only
narrows genuine). Label files without the field stay readable: there the strict reading is "genuine and not
ticked borderline" (the labeller was unsure, so the narrower reading does not count it).
"""

from __future__ import annotations

from typing import Any, Protocol

from mechprobe.errors import UsageError
from mechprobe.taxonomy import DEFINITIONS, GENUINE, LABELS

__all__ = ["READINGS", "LENIENT", "STRICT", "STRICT_YES", "STRICT_NO_DEFAULT", "STRICT_LABELS", "STRICT_CHOICES",
           "parse_strict", "label_under", "genuine_under"]

LENIENT, STRICT = "lenient", "strict"
READINGS: tuple[str, ...] = (LENIENT, STRICT)
STRICT_YES = "yes"
STRICT_NO_DEFAULT = "generic_followup"  # what a bare "no" means: the codebook's label for most such turns
# The labels the codebook's table assigns to turns that are genuine only under the lenient reading; the sheet
# offers these beside "yes" (a CSV may still name any other non-genuine label, which parse_strict accepts).
STRICT_LABELS: tuple[str, ...] = ("generic_followup", "empty_or_degenerate", "assistant_continuation")
STRICT_CHOICES: tuple[str, ...] = (STRICT_YES, *STRICT_LABELS)
_YES = {"1", "true", "yes", "y", "x"}
_NO = {"0", "false", "no", "n"}


class _Row(Protocol):
    label: str
    borderline: bool
    strict: str | None


def parse_strict(value: Any, label: str, where: str) -> str | None:
    """Normalise a labeller's ``strict`` entry for a row labelled ``label``.

    Args:
        value: what the file holds: missing/empty, a yes/no word or bool, or a taxonomy label.
        label: the row's (lenient) label.
        where: file and line, for the error message.
    Returns:
        None when not given; ``"yes"`` when genuine under the strict reading too; otherwise the label the turn
        gets under the strict reading.
    Example:
        >>> parse_strict("no", "genuine_followup", "a.csv:3")
        'generic_followup'
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    v = ("yes" if value else "no") if isinstance(value, bool) else str(value).strip().lower()
    if v in _YES:
        if label != GENUINE:
            raise UsageError(f"{where}: strict 'yes' on a row labelled {label!r}; the strict reading only narrows "
                             f"genuine_followup, so leave strict empty on other rows")
        return STRICT_YES
    if v in _NO:
        return STRICT_NO_DEFAULT if label == GENUINE else None
    if v in DEFINITIONS and v != GENUINE:
        if label != GENUINE and v != label:
            raise UsageError(f"{where}: strict {v!r} on a row labelled {label!r}; the strict reading changes only "
                             f"genuine_followup rows, so leave strict empty here")
        return v if label == GENUINE else None
    raise UsageError(f"{where}: strict {value!r} is not yes, no or a label; write yes, or the label the turn gets "
                     f"under the strict reading (one of {', '.join(x for x in LABELS if x != GENUINE)})")


def label_under(row: _Row, reading: str) -> str:
    """The row's label under ``reading`` (``lenient``: the label as given; ``strict``: see the module doc)."""
    if reading == LENIENT or row.label != GENUINE:
        return row.label
    if reading != STRICT:
        raise ValueError(f"unknown reading {reading!r}; use one of {READINGS}")
    if row.strict is None:
        return STRICT_NO_DEFAULT if row.borderline else GENUINE
    return GENUINE if row.strict == STRICT_YES else row.strict


def genuine_under(row: _Row, reading: str) -> bool:
    """Whether the row counts as a genuine follow-up under ``reading``."""
    return label_under(row, reading) == GENUINE
