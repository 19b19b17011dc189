"""One codebook: the package's labeling_guide.md, embedded verbatim in the sheet and naming the taxonomy."""

from __future__ import annotations

import html
import re
from pathlib import Path

from mechprobe.audit import codebook_path, codebook_text, render_sheet_html
from mechprobe.audit.sample import AuditSample
from mechprobe.taxonomy import LABELS, definitions_markdown

REPO = Path(__file__).resolve().parents[2]


def test_codebook_is_the_package_file_and_docs_point_to_it():
    assert codebook_path() == REPO / "mechprobe" / "audit" / "labeling_guide.md"
    assert codebook_text() == codebook_path().read_text(encoding="utf-8")
    pointer = (REPO / "docs" / "labeling_guide.md").read_text()
    assert "mechprobe/audit/labeling_guide.md" in pointer and len(pointer) < 1000


def test_codebook_has_taxonomy_definitions_verbatim_and_examples():
    text = codebook_text()
    assert definitions_markdown() in text
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    assert len(sections) >= 8
    for s in sections:
        examples = [b for b in re.split(r"^- ", s, flags=re.M)[1:] if "→ `" in b]
        assert len(examples) >= 3, s.splitlines()[0]
    used = set(re.findall(r"→ `([a-z_]+)`", text))
    assert used == set(LABELS)  # every example uses a real label, and every label is exemplified


def test_sheet_embeds_exactly_the_codebook():
    s = AuditSample(seed=0, n=0, by="condition", record_ids=(), per_stratum={}, judges=(), labels_sha256="x")
    page = render_sheet_html(s, [])
    m = re.search(r'<pre id="codebook">(.*?)</pre>', page, flags=re.S)
    assert m and html.unescape(m.group(1)) == codebook_text()
