"""Findings: every number the README and the findings docs quote, recomputed from committed files, and checked.

:mod:`.compute` recomputes (or, where the judge's verdicts per turn are not committed, reads) each audited rate,
difference and kappa under a stable key; :mod:`.check` extracts the numbers quoted between
``<!-- findings:begin -->`` and ``<!-- findings:end -->`` in a markdown file, each bound to its key by a marker
``<!-- =KEY -->``, and lists those that are not their key's value; :mod:`.evidence` writes the per-finding
evidence bundles (``reports/evidence/<finding>/``). The command is
``mechprobe findings [--check FILE...]`` (:mod:`mechprobe.cli.findings`).

Layer: just above :mod:`mechprobe.audit` (it reads audit folders with the audit's own functions), below ``lm``.
"""

from __future__ import annotations

from .check import BEGIN, END, MARKER, Quoted, check_file, check_text, quoted_numbers, read_markdown
from .compute import AUDITS, Findings, compute_findings, findings_json, findings_markdown
from .evidence import build_evidence
from .values import Value

__all__ = ["AUDITS", "BEGIN", "END", "MARKER", "Findings", "Quoted", "Value", "build_evidence", "check_file", "check_text",
           "compute_findings", "findings_json", "findings_markdown", "quoted_numbers", "read_markdown"]
