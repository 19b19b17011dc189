"""The labelling codebook: one markdown file shipped with the package, read by the sheet and by judges.

Why one file: the sheet a person labels with, the docs and any LLM judge prompt must show the *same*
definitions and worked examples, or an audit would compare a judge and a person who followed different rules.
The canonical text is ``mechprobe/audit/labeling_guide.md`` (package data); ``docs/labeling_guide.md`` only
points at it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["codebook_text", "codebook_path", "CODEBOOK_FILE"]

CODEBOOK_FILE = "labeling_guide.md"


def codebook_path() -> Path:
    """Where the codebook lives in the installed package (a real file: the package is never zipped)."""
    return Path(str(resources.files(__package__).joinpath(CODEBOOK_FILE)))


def codebook_text() -> str:
    """The codebook's markdown, verbatim.

    Returns:
        the full text of ``labeling_guide.md``: definitions (word for word those of
        :mod:`mechprobe.taxonomy`), decision order and worked examples per boundary.
    Example:
        >>> prompt = "Label the user turn.\\n\\n" + codebook_text()
    """
    return resources.files(__package__).joinpath(CODEBOOK_FILE).read_text(encoding="utf-8")
