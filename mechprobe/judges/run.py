"""The judge stage: label every generated user turn of a probe run, resumably.

``judge_run(RUN)`` reads ``RUN/user_turns.jsonl`` and ``RUN/assistant.jsonl``, asks a judge for one
:class:`~mechprobe.records.LabelRecord` per user turn and appends it to ``RUN/labels.jsonl`` as soon as
it is known, so a killed run loses at most the rows in flight and a re-run only labels what is
missing. Two judges share one interface (:class:`Judge`):

* ``offline`` (:mod:`mechprobe.judges.offline`): deterministic rules, no network; the default.
* ``openai:MODEL`` (:mod:`mechprobe.judges.llm`): an LLM behind any OpenAI-compatible endpoint.
* ``local:MODEL`` (:mod:`mechprobe.judges.local`): the same prompt, in-process, verdict by constrained choice.

Why ``judge_error`` rows are dropped and retried on the next run: an error is a fact about the
endpoint at one moment (rate limit, outage), not about the user turn, and counting it as any label
would bias the follow-up rate. Errors are kept in the file until then so the summary can report them.

Why one labels file holds one judge: mixing two judges' rows in one file would make every rate a
blend of two instruments. A second judge writes a second file (``--labels labels_llm.jsonl``).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mechprobe.errors import UsageError, UserError
from mechprobe.io import (
    JsonlStore,
    check_writable_dir,
    dumps_row,
    read_json,
    read_jsonl,
    versions,
    write_json,
    write_text_atomic,
    writer_lock,
)
from mechprobe.judges.base import Judge, JudgeInput, JudgeMismatch, inputs_from_run, run_model_name
from mechprobe.judges.factory import labelled_by, make_judge, resolve_judge_spec
from mechprobe.judges.registry import AUTO, OFFLINE_JUDGE
from mechprobe.records import truncated_item_ids, truncation_note
from mechprobe.stats import wilson
from mechprobe.taxonomy import GENUINE, JUDGE_ERROR, LABELS, TAXONOMY_VERSION

LABELS_FILE = "labels.jsonl"








# --------------------------------------------------------------------------- inputs








# --------------------------------------------------------------------------- judges












# --------------------------------------------------------------------------- summary




@dataclass
class GroupStat:
    """Follow-up rate of one (decoding, temperature) group; errors are excluded from ``n``."""

    decoding: str
    temperature: float
    n: int
    n_errors: int
    n_genuine: int
    rate: float
    ci_low: float
    ci_high: float
    label_counts: dict[str, int]


@dataclass
class JudgeSummary:
    """What one ``judge_run`` produced; ``table()`` is the markdown the CLI prints."""

    run_dir: str
    judge: str
    labels_path: str
    n_records: int
    n_labelled: int
    n_errors: int
    n_new: int
    n_skipped: int
    n_unlabelled: int
    label_counts: dict[str, int]
    groups: list[GroupStat] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    n_answers: int = 0  # assistant answers of the run
    n_truncated: int = 0  # of them, answers that hit the token cap
    n_truncated_turns: int = 0  # user turns after a truncated answer (left out of the rates unless included)
    include_truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        lines = [f"judge `{self.judge}`: {self.n_labelled} labelled, {self.n_errors} judge errors, "
                 f"{self.n_unlabelled} not labelled, of {self.n_records} user turns "
                 f"({self.n_new} judged now, {self.n_skipped} already labelled)", "",
                 truncation_note(self.n_truncated, self.n_answers, self.include_truncated)
                 + ("" if self.include_truncated else f" ({self.n_truncated_turns} user turns after them left out "
                                                     "of the rates)"), "",
                 "| decoding | T | n | follow-up rate | 95% CI (Wilson) | judge errors |",
                 "|---|---|---|---|---|---|"]
        for g in self.groups:
            rate = f"{g.rate:.1%}" if g.n else "—"
            ci = f"[{g.ci_low:.1%}, {g.ci_high:.1%}]" if g.n else "—"
            lines.append(f"| {g.decoding} | {g.temperature:g} | {g.n} | {rate} | {ci} | {g.n_errors} |")
        heads = [f"{g.decoding} T={g.temperature:g}" for g in self.groups]
        lines += ["", "| label | " + " | ".join(heads + ["all"]) + " |",
                  "|---|" + "---|" * (len(heads) + 1)]
        total = sum(self.label_counts.values())
        for lab in LABELS:
            cells = [f"{g.label_counts.get(lab, 0)}" for g in self.groups]
            c = self.label_counts.get(lab, 0)
            cells.append(f"{c} ({c / total:.1%})" if total else "0")
            lines.append(f"| {lab} | " + " | ".join(cells) + " |")
        if self.errors:
            lines += ["", "judge errors by reason: "
                      + "; ".join(f"{r} ×{c}" for r, c in sorted(self.errors.items(), key=lambda kv: -kv[1]))]
        return "\n".join(lines)


def _error_kind(err: str | None) -> str:
    return (err or "unknown").split(":", 1)[0][:60]


def summarize_labels(inputs: Sequence[JudgeInput], label_rows: Iterable[dict[str, Any]], *, run_dir: str = "",
                     judge: str = "", labels_path: str = "", n_new: int = 0, n_skipped: int = 0,
                     seconds: float = 0.0, truncated: set[str] | None = None, n_answers: int | None = None,
                     include_truncated: bool = False) -> JudgeSummary:
    """Follow-up rate with Wilson 95% CI per (decoding, temperature) and the label distribution.

    ``truncated``: item ids whose assistant answer hit the token cap
    (:func:`mechprobe.records.truncated_item_ids`); their user turns are left out of every count unless
    ``include_truncated``. ``n_answers``: the run's number of assistant answers (default: items of ``inputs``).
    """
    by_id = {r["record_id"]: r for r in label_rows}
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    unlabelled = 0
    truncated = set(truncated or ())
    after_cut = [inp for inp in inputs if inp.item_id in truncated]
    if not include_truncated:
        inputs = [inp for inp in inputs if inp.item_id not in truncated]
    for inp in inputs:
        row = by_id.get(inp.record_id)
        if row is None:
            unlabelled += 1
            continue
        groups.setdefault((inp.decoding, inp.temperature), []).append(row)
    stats = []
    all_counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for (dec, temp), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rows if r["label"] != JUDGE_ERROR]
        errs = [r for r in rows if r["label"] == JUDGE_ERROR]
        errors.update(_error_kind(r.get("error")) for r in errs)
        counts = Counter(r["label"] for r in ok)
        all_counts.update(counts)
        k = counts.get(GENUINE, 0)
        lo, hi = wilson(k, len(ok))
        stats.append(GroupStat(decoding=dec, temperature=temp, n=len(ok), n_errors=len(errs), n_genuine=k,
                               rate=k / len(ok) if ok else float("nan"), ci_low=lo, ci_high=hi,
                               label_counts=dict(counts)))
    return JudgeSummary(run_dir=str(run_dir), judge=judge, labels_path=str(labels_path), n_records=len(inputs),
                        n_labelled=sum(all_counts.values()), n_errors=sum(errors.values()), n_new=n_new,
                        n_skipped=n_skipped, n_unlabelled=unlabelled, label_counts=dict(all_counts),
                        groups=stats, errors=dict(errors), seconds=round(seconds, 2),
                        n_answers=len({i.item_id for i in [*inputs, *after_cut]}) if n_answers is None else n_answers,
                        n_truncated=len(truncated), n_truncated_turns=len(after_cut),
                        include_truncated=include_truncated)


# --------------------------------------------------------------------------- the stage


def _drop_error_rows(path: Path) -> int:
    """Rewrite ``path`` without ``judge_error`` rows (atomically), so they are retried; return how many."""
    rows = read_jsonl(path)
    keep = [r for r in rows if r.get("label") != JUDGE_ERROR]
    if len(keep) == len(rows):
        return 0
    write_text_atomic(path, "".join(dumps_row(r) + "\n" for r in keep))
    return len(rows) - len(keep)




def _stem(labels_file: str) -> str:
    name = Path(labels_file).name
    return name[: -len(".jsonl")] if name.endswith(".jsonl") else name


def _check_counts(limit: int | None, opts: dict[str, Any]) -> None:
    """Refuse negative or zero counts up front: ``limit=-1`` would silently judge all rows but one."""
    bad = []
    if limit is not None and limit < 0:
        bad.append(f"limit must be >= 0, got {limit}")
    for name, lo in (("concurrency", 1), ("max_retries", 0)):
        if opts.get(name) is not None and opts[name] < lo:
            bad.append(f"{name} must be >= {lo}, got {opts[name]}")
    if opts.get("timeout") is not None and not opts["timeout"] > 0:
        bad.append(f"timeout must be > 0 seconds, got {opts['timeout']}")
    if bad:
        raise UserError("invalid judge options: " + "; ".join(bad))


def _check_labels_file(run_dir: str | Path, labels_file: str) -> None:
    """The labels file (and its summary and manifest beside it) must live inside the run directory: a
    ``--labels ../x.jsonl`` would write outside it, where no later stage looks."""
    run = Path(run_dir).resolve()
    target = (run / labels_file).resolve()
    if Path(labels_file).is_absolute() or target.parent != run and run not in target.parents:
        raise UsageError(f"labels={labels_file} points outside the run directory {run_dir}: pass a file name "
                         f"inside it (e.g. labels_other.jsonl)")


def judge_run(run_dir: str | Path, judge: str | Judge | None = OFFLINE_JUDGE, *, labels_file: str = LABELS_FILE,
              retry_errors: bool = True, limit: int | None = None, progress: bool = True,
              include_truncated: bool = False, **opts: Any) -> JudgeSummary:
    """Label the user turns of ``run_dir`` (see :func:`_judge_run`) holding the labels file's writer lock:
    a second judge process on the same file is refused instead of appending duplicate rows.

    Each verdict is appended to ``run_dir/labels_file`` as soon as it is known; rows already labelled are
    skipped, so a killed run resumes. Also writes ``<stem>_summary.md`` and ``<stem>_manifest.json`` beside
    the labels (judge config without API key, cumulative judging time).

    Args:
        run_dir: a probe run directory (``user_turns.jsonl`` + ``assistant.jsonl``).
        judge: a :func:`make_judge` spec (default ``"offline"``; None = ``openai:$MECHPROBE_JUDGE_MODEL``
            when set, else ``offline``) or a ready :class:`~mechprobe.judges.base.Judge`.
        labels_file: file name inside ``run_dir`` (default ``"labels.jsonl"``); it holds one judge's rows only.
        retry_errors: drop earlier ``judge_error`` rows first and judge them again (default True).
        limit: judge at most this many *new* rows (>= 0); None (default) = all.
        progress: show a tqdm progress bar (default True).
        include_truncated: count user turns whose assistant answer hit the token cap in the summary's
            rates (default False: they are labelled but left out of the rates).
        **opts: options for :func:`make_judge` when ``judge`` is a spec (``concurrency``, ``timeout``,
            ``base_url``, ...).

    Returns:
        A :class:`JudgeSummary`: counts (labelled, errors, new, skipped), per (decoding, temperature) group
        the follow-up rate with a Wilson 95% CI, the label distribution; ``.table()`` renders markdown.

    Raises:
        JudgeMismatch: ``labels_file`` already holds another judge's rows.
        MissingInput: ``run_dir`` has no ``user_turns.jsonl``.
        UsageError / UserError: a labels file outside ``run_dir`` or invalid counts (``limit < 0``, ...).

    Example:
        >>> from mechprobe import judge_run
        >>> summary = judge_run("runs/smol-gsm8k", "offline-lexical", progress=False)   # doctest: +SKIP
        >>> print(summary.table())                                                     # doctest: +SKIP
        >>> judge_run("runs/smol-gsm8k", "openai:gpt-4o-mini", labels_file="labels_llm.jsonl")  # doctest: +SKIP
    """
    _check_counts(limit, opts)
    if Path(run_dir).exists() or Path(run_dir).is_symlink():  # a missing run gets the stage's own message
        check_writable_dir(run_dir, "RUN")
    _check_labels_file(run_dir, labels_file)
    kw = dict(labels_file=labels_file, retry_errors=retry_errors, limit=limit, progress=progress,
              include_truncated=include_truncated, **opts)
    if not Path(run_dir).is_dir():
        return _judge_run(run_dir, judge, **kw)  # raises the stage's own "no such run" error
    with writer_lock(Path(run_dir) / labels_file):
        return _judge_run(run_dir, judge, **kw)


def _judge_run(run_dir: str | Path, judge: str | Judge | None = OFFLINE_JUDGE, *, labels_file: str = LABELS_FILE,
               retry_errors: bool = True, limit: int | None = None, progress: bool = True,
               include_truncated: bool = False, **opts: Any) -> JudgeSummary:
    """Label the user turns of ``run_dir`` into ``run_dir/labels_file`` and summarise.

    ``judge`` is a spec for :func:`make_judge` (``"offline"``, ``"openai:MODEL"``; ``"auto"`` or None: the
    default-judge rule for this run, :func:`~mechprobe.judges.factory.resolve_judge_spec`) or a ready :class:`Judge`. Rows already labelled are skipped; ``judge_error`` rows are
    dropped first and retried unless ``retry_errors=False``. ``limit`` caps how many *new* rows are
    judged (for a quick look). Writes ``<stem>_summary.md`` and ``<stem>_manifest.json`` next to the
    labels (never the API key).
    """
    t0 = time.time()
    run_dir = Path(run_dir)
    inputs = inputs_from_run(run_dir)
    if judge is None or judge == AUTO:  # the default-judge rule, given the run's model and the judge that labelled it
        judge = resolve_judge_spec(judge, run_model_name(run_dir), labelled_by(run_dir, labels_file))
    j = make_judge(judge, **opts) if isinstance(judge, str) else judge
    path = run_dir / labels_file
    existing = read_jsonl(path)
    other = sorted({r.get("judge", "?") for r in existing} - {j.name})
    if other:
        raise JudgeMismatch(
            f"{path} holds labels from {other}, not from {j.name!r}; one labels file holds one judge. "
            f"Write this judge elsewhere (labels=labels_{re.split(r'[:@+-]', j.name)[0]}.jsonl) "
            f"or delete {path} to relabel")
    if retry_errors and path.exists():
        _drop_error_rows(path)
    store = JsonlStore(path, key="record_id")
    todo = [inp for inp in inputs if not store.has(inp.record_id)]
    n_skipped = len(inputs) - len(todo)
    if limit is not None:
        todo = todo[:limit]
    n_new = 0
    if todo:
        bar = tqdm(total=len(todo), desc=f"judge {j.name}", unit="turn", disable=not progress)
        try:
            for rec in j.label_many(todo):
                store.append(rec.to_dict())
                n_new += 1
                bar.update(1)
        finally:
            bar.close()
    answers = read_jsonl(run_dir / "assistant.jsonl", key="item_id")
    summary = summarize_labels(inputs, read_jsonl(path, key="record_id"), run_dir=str(run_dir), judge=j.name,
                               labels_path=str(path), n_new=n_new, n_skipped=n_skipped, seconds=time.time() - t0,
                               truncated=truncated_item_ids(answers), n_answers=len(answers),
                               include_truncated=include_truncated)
    stem = _stem(labels_file)
    write_text_atomic(run_dir / f"{stem}_summary.md", summary.table() + "\n")
    # Cumulative judging time over commands that judged rows (a resumed or reused run adds, not overwrites):
    # the propensity probe's cost comparison reads seconds per judged turn from it.
    man_path = run_dir / f"{stem}_manifest.json"
    old_man = read_json(man_path) if man_path.exists() else {}
    timing = dict(old_man.get("timing", {})) if old_man.get("judge") == j.name else {}
    if n_new:
        timing = {"seconds": round(timing.get("seconds", 0.0) + time.time() - t0, 3),
                  "rows": int(timing.get("rows", 0)) + n_new}
    manifest = {"stage": "judge", "judge": j.name, "labels_file": labels_file, "taxonomy": TAXONOMY_VERSION,
                "summary": {k: v for k, v in summary.to_dict().items() if k != "groups"},
                "judge_config": getattr(j, "public_config", lambda: {})(), "versions": versions(), "timing": timing}
    write_json(man_path, manifest)
    return summary


# --------------------------------------------------------------------------- CLI
