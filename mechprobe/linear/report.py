"""Markdown of the turn-level probes (``probes/metrics.md``): the results, or the label counts when too few to fit."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mechprobe.linear.turn import confusion_table, transfer_table


def turn_metrics_md(run_name: str, model: str, dataset: str, judge: str, timings: Mapping[str, Any],
                    analysis_s: float, table: str, best: int, mc: dict[str, Any], tm: dict[str, Any] | None
                    ) -> list[str]:
    """The lines of metrics.md: header, per-layer table and controls, multi-class confusion, transfer."""
    md = [f"# Linear probes: {run_name}", "", f"model {model}, dataset {dataset}, judge {judge}, "
          f"position boundary; stage seconds {json.dumps(timings)}, analysis {analysis_s} s.", "", table, "",
          f"## Multi-class probe at layer {best}", "", confusion_table(mc)]
    if tm:
        md += ["", f"## Transfer at layer {best} (rows: trained on; diagonal: grouped CV)", "", transfer_table(tm)]
    return md


def no_fit_md(run_name: str, title: str, counts: Mapping[str, int], reason: str) -> str:
    """metrics.md of a run too small to fit: what it holds and why no probe was fitted."""
    lines = [f"# Linear probes: {run_name}", "", title, "", f"**No probe metrics**: {reason}", "",
             "| label counts | n |", "|---|---|", *(f"| {k} | {v} |" for k, v in counts.items())]
    return "\n".join(lines) + "\n"
