"""Agreement between two label sources: Cohen's kappa, per-label precision/recall, confusion matrix.

A source is a labels file (``RUN/labels.jsonl``), a run directory (its ``labels.jsonl``), the
model-written label fixture (``tests/fixtures/hand_labels.jsonl``: rows with record_id, prompt, response,
raw_text, label, rationale, split) or a judge spec (``offline``, ``offline-lexical``,
``openai:MODEL``) that is run on the *other* source's self-contained rows. Rows are joined on
``record_id``; ``judge_error`` rows are excluded and counted, never treated as a label.

Why kappa and not accuracy alone: the label distribution is very skewed (few genuine follow-ups), so
a judge that always says "not genuine" has high accuracy and kappa 0. The first source is read as
the reference for precision/recall (put the model-written labels first).

    mechprobe agreement tests/fixtures/hand_labels.jsonl offline --split test --out report.md
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mechprobe.errors import MissingInput, UsageError
from mechprobe.io import JsonlStore, read_jsonl
from mechprobe.judges.base import inputs_from_rows
from mechprobe.judges.factory import make_judge
from mechprobe.judges.registry import JudgeSpec
from mechprobe.stats import cohen_kappa
from mechprobe.taxonomy import GENUINE, JUDGE_ERROR, LABELS

SHORT = {"genuine_followup": "genuine", "generic_followup": "generic", "new_query": "new",
         "prompt_restatement": "restate", "assistant_continuation": "assist", "meta_planning": "meta",
         "identity_leakage": "identity", "empty_or_degenerate": "empty"}


# --------------------------------------------------------------------------- metrics


def confusion_matrix(a: Sequence[str], b: Sequence[str], labels: Sequence[str]) -> list[list[int]]:
    """``m[i][j]`` = rows that ``a`` labels ``labels[i]`` and ``b`` labels ``labels[j]``."""
    idx = {lab: i for i, lab in enumerate(labels)}
    m = [[0] * len(labels) for _ in labels]
    for x, y in zip(a, b):
        m[idx[x]][idx[y]] += 1
    return m


@dataclass
class LabelScore:
    label: str
    support_a: int
    support_b: int
    precision: float
    recall: float
    f1: float


def per_label_scores(a: Sequence[str], b: Sequence[str], labels: Sequence[str]) -> list[LabelScore]:
    """Precision/recall of ``b`` against reference ``a``, per label (NaN where undefined)."""
    out = []
    for lab in labels:
        tp = sum(x == lab and y == lab for x, y in zip(a, b))
        sa, sb = sum(x == lab for x in a), sum(y == lab for y in b)
        p = tp / sb if sb else float("nan")
        r = tp / sa if sa else float("nan")
        f = 2 * p * r / (p + r) if sa and sb and (p + r) > 0 else (0.0 if sa and sb else float("nan"))
        out.append(LabelScore(lab, sa, sb, p, r, f))
    return out


# --------------------------------------------------------------------------- sources


@dataclass
class LabelSource:
    """Labels by record_id from one source; ``rows`` keeps the raw rows (for running a judge on them)."""

    name: str
    labels: dict[str, str]
    n_errors: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    # The user turn each record_id names (from the row's raw_text, else the run's user_turns.jsonl); empty when
    # the source cannot tell. Two sources are joined only where these agree (see :func:`check_same_turns`).
    texts: dict[str, str] = field(default_factory=dict)


def is_judge_spec(spec: str) -> bool:
    """Whether ``spec`` names a judge to run (``offline``, ``openai:MODEL``...) rather than a file of labels.

    Public because the agreement command decides with it whether its second source is labelled on the spot.
    """
    try:
        JudgeSpec.parse(spec)
    except UsageError:
        return False
    return True


def load_labels(path: str | Path, split: str | None = None, name: str | None = None) -> LabelSource:
    """Read a labels.jsonl, a run directory or the model-written label fixture; optionally one split only."""
    p = Path(path)
    if p.is_dir():
        p = p / "labels.jsonl"
    if not p.exists():
        raise MissingInput(f"{p} does not exist: pass a labels.jsonl, a run directory with one "
                                "(run `mechprobe judge RUN` first) or the model-written label fixture")
    rows = read_jsonl(p, key="record_id")  # two verdicts for one record: refused, not one picked
    if split is not None and any("split" in r for r in rows):
        # Sources without a split field (judge labels) are restricted by the join on record_id instead.
        have = sorted({str(r.get("split")) for r in rows})
        rows = [r for r in rows if r.get("split") == split]
        if not rows:
            raise UsageError(f"{p} has no rows in split {split!r} (splits present: {have})")
    labels: dict[str, str] = {}
    n_err = 0
    for i, r in enumerate(rows):
        if "record_id" not in r or "label" not in r:
            raise UsageError(f"{p} row {i} lacks record_id/label: not a labels file or model-written label fixture")
        lab = r["label"]
        if lab == JUDGE_ERROR:
            n_err += 1
            continue
        if lab not in LABELS:
            raise UsageError(f"{p} row {i} ({r['record_id']}): label {lab!r} is not in the taxonomy "
                             f"({', '.join(LABELS)})")
        labels[str(r["record_id"])] = lab
    default_name = str(p) if p.name == "labels.jsonl" else p.name
    return LabelSource(name or default_name, labels, n_err, rows, _turn_texts(p, rows))


def _turn_texts(labels_path: Path, rows: list[dict[str, Any]]) -> dict[str, str]:
    """record_id -> the user turn's raw text: from the rows themselves (the fixture), else from the
    ``user_turns.jsonl`` beside the labels file (a run directory)."""
    texts = {str(r["record_id"]): str(r["raw_text"]) for r in rows if "record_id" in r and "raw_text" in r}
    turns = labels_path.parent / "user_turns.jsonl"
    if not texts and turns.exists():
        texts = {str(r["record_id"]): str(r.get("raw_text", r.get("text", "")))
                 for r in read_jsonl(turns, key="record_id") if "record_id" in r}
    return texts


def check_same_turns(a: LabelSource, b: LabelSource) -> None:
    """Refuse to compare labels of different user turns that happen to share a record_id.

    A record_id (``item|decoding|sample``) repeats across runs, so joining two runs of other models, datasets or
    seeds would report a kappa over unrelated turns. Where both sources know the turn text, every joined pair
    must match; when either cannot tell (a bare labels file), nothing is checked.
    """
    if not a.texts or not b.texts:
        return
    shared = sorted(set(a.labels) & set(b.labels))
    diff = [i for i in shared if i in a.texts and i in b.texts and a.texts[i] != b.texts[i]]
    if diff:
        raise UsageError(f"{a.name} and {b.name} label different user turns under the same record_id ({len(diff)} of "
                         f"{len(shared)} joined, e.g. {diff[0]!r}): they are labels of different runs, so agreement "
                         f"between them means nothing. Compare two label files of the same run")


def judge_source(spec: str, rows: list[dict[str, Any]], *, save: str | Path | None = None, **opts: Any) -> LabelSource:
    """Run judge ``spec`` on self-contained rows (the fixture) and return its labels."""

    judge = make_judge(spec, **opts)
    inputs = inputs_from_rows(rows)
    store = JsonlStore(save, key="record_id") if save else None
    labels: dict[str, str] = {}
    n_err = 0
    for rec in tqdm(judge.label_many(inputs), total=len(inputs), desc=f"judge {judge.name}", unit="turn"):
        if store is not None and not store.has(rec.record_id):
            store.append(rec.to_dict())
        if rec.label == JUDGE_ERROR:
            n_err += 1
        else:
            labels[rec.record_id] = rec.label
    return LabelSource(judge.name, labels, n_err, [])


# --------------------------------------------------------------------------- comparison


@dataclass
class Agreement:
    name_a: str
    name_b: str
    n: int
    n_only_a: int
    n_only_b: int
    n_errors_a: int
    n_errors_b: int
    accuracy: float
    kappa_multi: float
    kappa_binary: float
    binary_accuracy: float
    genuine_rate_a: float
    genuine_rate_b: float
    per_label: list[LabelScore]
    labels: list[str]
    matrix: list[list[int]]
    split: str | None = None


def compare(a: LabelSource, b: LabelSource, split: str | None = None) -> Agreement:
    """Agreement of ``b`` with reference ``a`` on the record_ids both labelled (the same turns: see
    :func:`check_same_turns`)."""
    check_same_turns(a, b)
    ids = sorted(set(a.labels) & set(b.labels))
    ya = [a.labels[i] for i in ids]
    yb = [b.labels[i] for i in ids]
    ga = ["genuine" if y == GENUINE else "other" for y in ya]
    gb = ["genuine" if y == GENUINE else "other" for y in yb]
    n = len(ids)
    nan = float("nan")
    return Agreement(
        name_a=a.name, name_b=b.name, n=n, n_only_a=len(set(a.labels) - set(b.labels)),
        n_only_b=len(set(b.labels) - set(a.labels)), n_errors_a=a.n_errors, n_errors_b=b.n_errors,
        accuracy=sum(x == y for x, y in zip(ya, yb)) / n if n else nan,
        kappa_multi=cohen_kappa(ya, yb, LABELS), kappa_binary=cohen_kappa(ga, gb, ["genuine", "other"]),
        binary_accuracy=sum(x == y for x, y in zip(ga, gb)) / n if n else nan,
        genuine_rate_a=ga.count("genuine") / n if n else nan, genuine_rate_b=gb.count("genuine") / n if n else nan,
        per_label=per_label_scores(ya, yb, LABELS), labels=list(LABELS),
        matrix=confusion_matrix(ya, yb, LABELS), split=split)


def _f(x: float, pct: bool = False) -> str:
    if x != x:  # NaN
        return "—"
    return f"{x:.1%}" if pct else f"{x:.3f}"


def report_markdown(ag: Agreement, title: str | None = None) -> str:
    """The agreement report: summary metrics, per-label precision/recall, confusion matrix."""
    lines = [f"# {title or 'Label agreement'}", "",
             f"Reference (A): `{ag.name_a}`; compared (B): `{ag.name_b}`; split: {ag.split or 'all rows'}.",
             f"{ag.n} user turns labelled by both; {ag.n_only_a} only by A, {ag.n_only_b} only by B; "
             f"judge errors excluded: A {ag.n_errors_a}, B {ag.n_errors_b}.", "",
             "| metric | value |", "|---|---|",
             f"| Cohen's κ, binary (genuine vs not) | {_f(ag.kappa_binary)} |",
             f"| Cohen's κ, 8 labels | {_f(ag.kappa_multi)} |",
             f"| accuracy, binary | {_f(ag.binary_accuracy, True)} |",
             f"| accuracy, 8 labels | {_f(ag.accuracy, True)} |",
             f"| genuine rate A / B | {_f(ag.genuine_rate_a, True)} / {_f(ag.genuine_rate_b, True)} |", "",
             "κ is undefined (—) when both sources use a single class on these rows.", "",
             "## Per label (B against reference A)", "",
             "| label | n in A | n in B | precision | recall | F1 |", "|---|---|---|---|---|---|"]
    for s in ag.per_label:
        lines.append(f"| {s.label} | {s.support_a} | {s.support_b} | {_f(s.precision, True)} | "
                     f"{_f(s.recall, True)} | {_f(s.f1)} |")
    lines += ["", "## Confusion matrix (rows: A, columns: B)", "",
              "| A \\ B | " + " | ".join(SHORT[lab] for lab in ag.labels) + " |",
              "|---|" + "---|" * len(ag.labels)]
    for lab, row in zip(ag.labels, ag.matrix):
        lines.append(f"| {SHORT[lab]} | " + " | ".join(str(v) for v in row) + " |")
    lines += ["", "Columns: " + ", ".join(f"{SHORT[lab]} = `{lab}`" for lab in ag.labels) + "."]
    if ag.n < 30:
        lines += ["", f"Only {ag.n} rows: κ and per-label rates are very uncertain."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI
