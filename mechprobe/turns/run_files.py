"""A probe run's files: their names, reading the records back, and the run's markdown summary."""

from __future__ import annotations

from pathlib import Path

from mechprobe.audit.rates import audit_truth, rate_columns
from mechprobe.audit.rates import cells as rate_cells
from mechprobe.audit.rates import headers as rate_headers
from mechprobe.errors import MissingInput
from mechprobe.io import read_jsonl
from mechprobe.records import AssistantRecord, UserTurnRecord, truncated_item_ids, truncation_note
from mechprobe.taxonomy import GENUINE, LABELS

__all__ = ["ASSISTANT", "SKIPPED", "USER_TURNS", "load_run", "summarize_run"]

ASSISTANT = "assistant.jsonl"
USER_TURNS = "user_turns.jsonl"
SKIPPED = "skipped_rows.jsonl"


def load_run(run_dir: str | Path) -> tuple[list[AssistantRecord], list[UserTurnRecord]]:
    """Read a probe run's records (for notebooks and later stages).

    Args:
        run_dir: a probe run directory.

    Returns:
        ``(assistants, user_turns)``: ``list[AssistantRecord]`` (one per item, ``assistant.jsonl`` order) and
        ``list[UserTurnRecord]`` (``user_turns.jsonl`` order, the row order of the activation cache).

    Raises:
        MissingInput: ``run_dir`` has no ``user_turns.jsonl``.

    Example:
        >>> from mechprobe import load_run
        >>> answers, turns = load_run("runs/smol-gsm8k")                  # doctest: +SKIP
        >>> turns[0].record_id                                           # doctest: +SKIP
        'gsm8k-0000|greedy|s0'
    """
    run_dir = Path(run_dir)
    if not (run_dir / USER_TURNS).exists():
        raise MissingInput(f"{run_dir} has no {USER_TURNS}: run `mechprobe probe {run_dir}`")
    a = [AssistantRecord.from_dict(r) for r in read_jsonl(run_dir / ASSISTANT, key="item_id")]
    u = [UserTurnRecord.from_dict(r) for r in read_jsonl(run_dir / USER_TURNS, key="record_id")]
    return a, u


def summarize_run(run_dir: str | Path, include_truncated: bool = False, labels_file: str = "labels.jsonl") -> str:
    """A short markdown summary: task accuracy, truncated answers, end-of-turn share per decoding and, once the
    run is judged, the follow-up rate per decoding (judge only, and corrected where the run has audit labels).

    User turns after a truncated answer (the answer hit ``max_assistant_tokens``) are left out of the
    follow-up rates unless ``include_truncated``; the line ``k of n answers truncated, excluded`` says so.
    """
    run_dir = Path(run_dir)
    a, u = load_run(run_dir)
    scored = [r.score for r in a if r.score is not None]
    cut = truncated_item_ids(a)
    lines = [f"items: {len(a)}; task accuracy: "
             + (f"{sum(scored) / len(scored):.1%} of {len(scored)} scored" if scored else "unscored")
             + f"; {truncation_note(len(cut), len(a), include_truncated)}", "",
             "| decoding | T | n | ends with end-of-turn | max tokens |", "|---|---|---|---|---|"]
    groups: dict[tuple[str, float], list[UserTurnRecord]] = {}
    for r in u:
        groups.setdefault((r.decoding, r.temperature), []).append(r)
    for (d, t), rs in sorted(groups.items(), key=lambda kv: kv[0][1]):
        eot = sum(r.stop_reason == "end_of_turn" for r in rs) / len(rs)
        mx = sum(r.stop_reason == "max_tokens" for r in rs) / len(rs)
        lines.append(f"| {d} | {t:g} | {len(rs)} | {eot:.1%} | {mx:.1%} |")
    labels_p = run_dir / labels_file
    if not labels_p.exists():
        return "\n".join(lines)
    labels = {r["record_id"]: r.get("label") for r in read_jsonl(labels_p, key="record_id")}
    audit = audit_truth(run_dir) if labels_file == "labels.jsonl" else None
    note = truncation_note(len(cut), len(a), include_truncated)
    head = ["decoding", "T", "judged turns", *rate_headers("follow-up", audit is not None)]
    lines += ["", f"Follow-up rate ({note}"
              + (f"; corrected by the audit {audit.sample_id}, labellers {', '.join(audit.labellers)}" if audit
                 else "; no audit labels: judge only") + ")", "",
              "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (d, t), rs in sorted(groups.items(), key=lambda kv: kv[0][1]):
        judged = {r.record_id: int(labels[r.record_id] == GENUINE) for r in rs
                  if labels.get(r.record_id) in LABELS and (include_truncated or r.item_id not in cut)}
        lines.append(f"| {d} | {t:g} | {len(judged)} | " + " | ".join(rate_cells(*rate_columns(judged, audit)))
                     + " |")
    return "\n".join(lines)
