"""The labelling codebook: one markdown file shipped with the package, read by the sheet and by judges.

Why one file: the sheet a person labels with, the docs and any LLM judge prompt must show the *same*
definitions and worked examples, or an audit would compare a judge and a person who followed different rules.
The canonical text is ``mechprobe/audit/labeling_guide.md`` (package data); ``docs/labeling_guide.md`` only
points at it.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

__all__ = ["codebook_text", "codebook_core", "codebook_path", "codebook_version", "CODEBOOK_FILE", "CORE_SECTIONS",
           "CODEBOOK_VERSION", "LEGACY_CODEBOOK_VERSION"]

CODEBOOK_FILE = "labeling_guide.md"
LEGACY_CODEBOOK_VERSION = "v1"  # samples and reports written before the codebook carried a version
_VERSION_LINE = re.compile(r"^Codebook version: \*\*(v\d+)\*\*", re.M)


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


CORE_SECTIONS: tuple[str, ...] = ("How to read a turn", "The eight labels", "Decision order")


def codebook_core() -> str:
    """The codebook's rules without its worked examples: the :data:`CORE_SECTIONS`, verbatim and in order.

    Why: an LLM judge on a CPU pays for every prompt token of every turn. The whole codebook is ~4,800 tokens
    (about 100 s per conversation for the local judge on the 2-core CPU); its rules alone are about a third of
    that. The local judge gets these sections; judges that run elsewhere (``openai:``) get the whole text.
    Both are cut from the one file, so the sheet and every prompt still share their words.

    Returns:
        the ``## How to read a turn``, ``## The eight labels`` and ``## Decision order`` sections, headings
        included, joined by blank lines.
    Example:
        >>> core = codebook_core()
        >>> core.startswith("## How to read a turn") and "## Decision order" in core
        True
    """
    text = codebook_text()
    out = []
    for name in CORE_SECTIONS:
        start = text.find(f"\n## {name}\n")
        if start < 0:
            raise ValueError(f"the codebook has no section '## {name}'; keep CORE_SECTIONS in step with {CODEBOOK_FILE}")
        end = text.find("\n## ", start + 1)
        out.append(text[start + 1: end if end >= 0 else len(text)].rstrip())
    return "\n\n".join(out)


def codebook_version(text: str | None = None) -> str:
    """The codebook's version, read from its ``Codebook version: **vN**`` line (the file is the one source).

    Why recorded: a labeller's verdicts mean what the codebook they read said; each audit sample and report
    records the version so labels collected under different codebooks are never pooled unnoticed.
    Example:
        >>> codebook_version()
        'v2'
    """
    m = _VERSION_LINE.search(codebook_text() if text is None else text)
    if not m:
        raise ValueError(f"{CODEBOOK_FILE} has no 'Codebook version: **vN**' line; add one under its title")
    return m.group(1)


CODEBOOK_VERSION = codebook_version()
