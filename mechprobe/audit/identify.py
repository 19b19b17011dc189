"""Answer identification: can a reader tell, from the user turn alone, which answer it followed?

Why: the codebook asks a labeller whether a turn is "grounded in the response", a judgement that moves with
the reader. Identification needs no codebook. The reader sees a generated user turn and two answers to the
*same* query, the one the turn followed and a distractor, in a seeded random order, and picks one (or "can't
tell"). A turn that reacts to its answer (a step, a number, a claim) picks it out; a turn that only restates
the query, asks something new or continues as the assistant leaves the reader at chance (50%).

Why the distractor answers the same query: an answer to another item would be picked out by topic alone,
which any on-topic turn passes. So the distractor is, in this order of preference:

1. another sample of the same model for the same item and query (a different assistant record of the item in
   the run's assistant files), chosen with a seed;
2. else the real answer with its key numbers changed (:func:`perturb_numbers`: the text is kept, each number
   the answer does not copy from the query is replaced, one value by one other value throughout).

A turn whose answer has neither (no other sample, no number to change) is left out and counted.

Files: ``<run>/audit/identify.json`` records the pairs (row key, which position holds the real answer, the
distractor's kind and text, the seed), ``identify.html`` is the page (the sheet template in its ``identify``
mode: it holds the turn and the two answers, never which one is real). A labeller's export is imported with
the same ``mechprobe audit RUN --labels`` and stored as ``audit/identify_labels/<name>.json``;
:func:`identification_report` scores it per stratum beside the genuine rate.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from scipy.stats import binomtest
from statsmodels.stats.proportion import proportion_confint

from mechprobe.errors import UsageError
from mechprobe.io import read_json, read_jsonl, shell_arg, write_json
from mechprobe.records import AssistantRecord

from .estimate import judge_only_rate
from .labels import LABELLER_KINDS, LABELLER_NAME_PATTERN
from .sample import AuditSample, audit_dir
from .sheet import render_page
from .table import TurnTable

__all__ = ["IDENTIFY_FORMAT", "PAIRS_FORMAT", "CHOICES", "CANT_TELL", "Distractor", "IdentifyPair",
           "perturb_numbers", "choose_distractor", "same_query_answers", "identify_pairs", "write_identify_sheet",
           "render_identify_html", "store_identify",
           "load_pairs", "is_identify_file", "read_identify_file", "import_identify", "identification_report",
           "identification_markdown", "score_choices"]

IDENTIFY_FORMAT = "mechprobe-audit-identify-v1"
PAIRS_FORMAT = "mechprobe-audit-identify-pairs-v1"
PAIRS_FILE = "identify.json"
LABELS_DIR = "identify_labels"
CANT_TELL = "cant_tell"
CHOICES = ("A", "B", CANT_TELL)
CHANCE = 0.5
OTHER_SAMPLE, PERTURBED = "other_sample", "perturbed"
_LONG = 15  # digits past which only a number's leading digits change (see _new_digits)

# A number as written: 1234, 1,234, 3.5, 1,234.50; not part of a word (x1, v2) nor the tail of a decimal.
_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")
# List markers and step numbers are structure, not content: changing them would mark the distractor by itself.
_LIST_MARKER = re.compile(r"[ \t]*(?:[-*#][ \t]*)?")
_STEP_WORD = re.compile(r"\b(?:step|part|case|option|method)\s*\Z", re.IGNORECASE)


@dataclass(frozen=True)
class Distractor:
    """The other answer of a pair: its text and how it was made (``other_sample`` or ``perturbed``)."""

    text: str
    kind: str


@dataclass(frozen=True)
class IdentifyPair:
    """One identification row: the opaque row key, the turn's record id, the two answers and which is real."""

    row: str
    record_id: str
    real: str  # "A" or "B"
    kind: str  # the distractor's kind
    a: str
    b: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _parts(s: str) -> tuple[str, int]:
    """``(digits, decimal places)`` of a written number: ``"1,234.50"`` -> ``("123450", 2)``."""
    plain = s.replace(",", "")
    places = len(plain.split(".")[1]) if "." in plain else 0
    return plain.replace(".", ""), places


def _dec(digits: str | int, places: int) -> Decimal:
    """The exact value (a Decimal compares 3.5 with 3.50 as equal and never overflows, unlike a float)."""
    return Decimal(f"{digits}E-{places}")


def _normal(s: str) -> Decimal:
    return _dec(*_parts(s))


def _group(whole: str) -> str:
    """Thousands separators on a string of digits (no int conversion: a number may have any length)."""
    head = len(whole) % 3 or 3
    return ",".join([whole[:head], *(whole[i:i + 3] for i in range(head, len(whole), 3))])


def _write(digits: str, places: int, commas: bool) -> str:
    digits = digits.rjust(places + 1, "0")
    whole, frac = (digits[:-places], digits[-places:]) if places else (digits, "")
    head = _group(whole) if commas else whole
    return f"{head}.{frac}" if places else head
def _is_structure(text: str, start: int, written: str) -> bool:
    """A list marker (``1.`` / ``2)`` at a line start) or a step number (``Step 3``)."""
    line = text[text.rfind("\n", 0, start) + 1:start]
    if _LIST_MARKER.fullmatch(line) and "." not in written and re.match(r"[.)](?:\s|\Z)", text[start + len(written):]):
        return True
    return bool(_STEP_WORD.search(line))


def _new_value(n: int, places: int, taken: set[Decimal], rng: random.Random) -> int:
    """Another value of about the same size (10-35% away, at least 1), not negative and not in ``taken``."""
    for attempt in range(400):
        if n > 1:
            step = max(1, round(n * rng.uniform(0.1, 0.35))) + attempt // 20
            cand = n + step * rng.choice((-1, 1))
        else:
            cand = n + rng.randint(1, 9) + attempt
        if cand >= 0 and cand != n and _dec(cand, places) not in taken:
            return cand
    cand = n + 1  # a text dense with nearby numbers (code, tables, lists of years): the next free value above
    while _dec(cand, places) in taken:
        cand += 1
    return cand


def _new_digits(digits: str, places: int, taken: set[Decimal], rng: random.Random) -> str:
    """The digits of another value for one number (see :func:`_new_value`).

    A number longer than ``_LONG`` digits (a small model repeating one digit) changes in its leading
    ``_LONG`` digits only, with the digit count kept: Python refuses integer conversion past 4300 digits, and
    a changed head is what a reader would see.
    """
    if len(digits) <= _LONG:
        return str(_new_value(int(digits), places, taken, rng))
    head, tail = digits[:_LONG], digits[_LONG:]
    for attempt in range(400):
        cand = str(_new_value(int(head), 0, set(), rng) + attempt).rjust(_LONG, "0")
        if len(cand) == _LONG and cand != head and _dec(cand + tail, places) not in taken:
            return cand + tail
    return str(int(head) - 1).rjust(_LONG, "0") + tail  # a head of nines: one less keeps the digit count


def perturb_numbers(answer: str, query: str = "", key: str = "") -> str | None:
    """The answer with its key numbers changed and every other character kept.

    Key numbers are the numbers the answer does not copy from the query (its own results); when it copies
    all of them, every number is key. List markers and step numbers are never changed. Each distinct value
    maps to one new value throughout (so the text stays as consistent as the original), with the same number
    of decimal places and the same thousands separators, never onto a value the answer or query already holds,
    never negative. Deterministic in ``(answer, query, key)``.

    Args:
        answer: the real answer.
        query: the user query (numbers it contains are kept where the answer has others).
        key: the seed key (the item id), so the same answer gets the same distractor in every condition.
    Returns:
        the changed answer, or None when the answer has no number to change.
    Example:
        >>> perturb_numbers("12 * 7 = 84, so she pays $84.", "She buys 12 pens at $7 each.", "gsm8k-3")
        '12 * 7 = 107, so she pays $107.'
    """
    found = [m for m in _NUMBER.finditer(answer) if not _is_structure(answer, m.start(), m.group())]
    if not found:
        return None
    in_query = {_normal(m.group()) for m in _NUMBER.finditer(query)}
    change = [m for m in found if _normal(m.group()) not in in_query] or found
    taken = in_query | {_normal(m.group()) for m in _NUMBER.finditer(answer)}
    digest = hashlib.sha256(answer.encode()).hexdigest()[:16]
    new_for: dict[Decimal, str] = {}
    out, last = [], 0
    for m in change:
        v = _normal(m.group())
        if v not in new_for:
            digits, places = _parts(m.group())
            cand = _new_digits(digits, places, taken, random.Random(f"perturb|{key}|{digest}|{m.group()}"))
            taken.add(_dec(cand, places))
            new_for[v] = _write(cand, places, "," in m.group())
        out += [answer[last:m.start()], new_for[v]]
        last = m.end()
    out.append(answer[last:])
    return "".join(out)


def choose_distractor(real: str, same_item: Iterable[str], key: str, query: str = "") -> Distractor | None:
    """The distractor for one answer: another sample of the same item if there is one, else its numbers changed.

    Args:
        real: the answer the turn followed.
        same_item: other answers of the model to the *same* item and query (never another item's: that would
            measure topic, not reaction); answers equal to ``real`` are ignored.
        key: the seed key (the item id): the same item gets the same distractor in every condition.
        query: the user query, for :func:`perturb_numbers`.
    Returns:
        the distractor, or None when there is neither another sample nor a number to change.
    Example:
        >>> choose_distractor("12 * 7 = 84.", [], "gsm8k-3", "12 pens at $7").kind
        'perturbed'
    """
    others = sorted({a for a in same_item if a.strip() and a.strip() != real.strip()})
    if others:
        return Distractor(random.Random(f"distractor|{key}").choice(others), OTHER_SAMPLE)
    changed = perturb_numbers(real, query, key)
    if changed is None or changed == real:
        return None
    return Distractor(changed, PERTURBED)


def same_query_answers(run: str | Path) -> dict[str, list[AssistantRecord]]:
    """Every assistant record of the run per item: ``assistant.jsonl`` and ``steering*/split_answers/``.

    Perturbation variants (``variants/``) are left out: they are edited conversations, not samples of the model.
    """
    run = Path(run)
    out: dict[str, list[AssistantRecord]] = {}
    for p in [run / "assistant.jsonl", *sorted(run.glob("steering*/split_answers/assistant.jsonl"))]:
        for d in read_jsonl(p):
            r = AssistantRecord.from_dict(d)
            out.setdefault(r.item_id, []).append(r)
    return out


def _row_key(sample: AuditSample, record_id: str) -> str:
    """An opaque key of its own: the sheet's key would let a reader match the two pages row by row."""
    return "i" + hashlib.sha256(f"identify\0{sample.sample_id}\0{record_id}".encode()).hexdigest()[:10]


def identify_pairs(sample: AuditSample, table: TurnTable, answers: dict[str, list[AssistantRecord]],
                   seed: int | None = None) -> tuple[list[IdentifyPair], list[str]]:
    """One pair per sampled turn, in a seeded shuffled order, and the record ids left out (no distractor).

    Args:
        sample: the audit sample (the same turns as the codebook sheet, so each stratum is scored).
        table: the run's table (turn, query, real answer).
        answers: :func:`same_query_answers` of the run; only records of the turn's item with its query count.
        seed: default the sample's; the order within a pair is drawn per turn, the row order per sample.
    Returns:
        ``(pairs, left_out)``.
    """
    seed = sample.seed if seed is None else seed
    pairs, left_out = [], []
    for rid in sample.record_ids:
        t = table.get(rid)
        same = [r.response for r in answers.get(t.item_id, []) if r.prompt == t.query]
        d = choose_distractor(t.answer, same, t.item_id, t.query)
        if d is None:
            left_out.append(rid)
            continue
        real = "A" if random.Random(f"identify-order|{sample.sample_id}|{seed}|{rid}").random() < 0.5 else "B"
        a, b = (t.answer, d.text) if real == "A" else (d.text, t.answer)
        pairs.append(IdentifyPair(_row_key(sample, rid), rid, real, d.kind, a, b))
    pairs.sort(key=lambda p: p.row)
    random.Random(f"identify-rows|{sample.sample_id}|{seed}").shuffle(pairs)
    return pairs, left_out


def write_identify_sheet(run: str | Path, sample: AuditSample, table: TurnTable) -> tuple[Path, dict[str, Any]]:
    """Write ``identify.json`` (kept when it already records this sample) and ``identify.html``.

    Why kept: labels are collected over days and must keep meaning the same pairs even if the run's assistant
    files grow another sample later. A new sample (``--redraw``) gets new pairs.
    Returns:
        ``(html_path, the recorded pairs file as a dict)``.
    """
    d = audit_dir(run)
    p = d / PAIRS_FILE
    rec = read_json(p) if p.exists() else None
    if not rec or rec.get("sample_id") != sample.sample_id:
        pairs, left_out = identify_pairs(sample, table, same_query_answers(run))
        rec = {"format": PAIRS_FORMAT, "sample_id": sample.sample_id, "seed": sample.seed,
               "pairs": [q.to_dict() for q in pairs], "left_out": left_out}
        write_json(p, rec)
    pairs = [IdentifyPair(**q) for q in rec["pairs"]]
    html_p = d / "identify.html"
    html_p.write_text(render_identify_html(sample, pairs, table), encoding="utf-8")
    return html_p, rec


_CHOICE_BUTTONS = (
    {"name": "A", "title": "answer A", "definition": "the turn follows answer A: it points to something only A has"},
    {"name": "B", "title": "answer B", "definition": "the turn follows answer B: it points to something only B has"},
    {"name": CANT_TELL, "title": "can't tell",
     "definition": "nothing in the turn points to one answer (it fits both, or neither)"},
)


def render_identify_html(sample: AuditSample, pairs: list[IdentifyPair], table: TurnTable) -> str:
    """The identification page: per row the turn and the two answers, never which one is real nor the condition.

    Why no query: with it a reader could check the answers' numbers against the query (a changed number
    stands out without looking at the turn); the turn alone must point to its answer.
    """
    data = {"mode": "identify", "format": IDENTIFY_FORMAT, "sample_id": sample.sample_id,
            "labels": list(_CHOICE_BUTTONS),
            "rows": [{"row": q.row, "turn": table.get(q.record_id).turn, "a": q.a, "b": q.b} for q in pairs]}
    return render_page(f"mechprobe answer identification {sample.sample_id}", data)


def load_pairs(run: str | Path, sample: AuditSample) -> list[IdentifyPair] | None:
    """The recorded pairs of the run's current sample, or None when there are none."""
    p = audit_dir(run) / PAIRS_FILE
    if not p.exists():
        return None
    rec = read_json(p)
    if rec.get("sample_id") != sample.sample_id:
        return None
    return [IdentifyPair(**q) for q in rec["pairs"]]


def is_identify_file(path: str | Path) -> bool:
    """Whether ``path`` is an export of the identification page (as opposed to codebook labels)."""
    path = Path(path)
    if path.suffix.lower() != ".json" or not path.exists():
        return False
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(d, dict) and d.get("format") == IDENTIFY_FORMAT


def read_identify_file(path: str | Path, sample: AuditSample, pairs: list[IdentifyPair], kind: str | None = None
                       ) -> dict[str, Any]:
    """Read and check one labeller's identification export; returns the normalised dict to store."""
    path = Path(path)
    d = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(d, dict):
        raise UsageError(f"{path}: the file is a JSON {type(d).__name__}, not an identification export; export "
                         f"it again from identify.html")
    lab = d.get("labeller") or {}
    if not isinstance(lab, dict):
        raise UsageError(f"{path}: 'labeller' is {type(lab).__name__}, not an object with 'name' and 'kind'; "
                         f"export the file again from identify.html")
    who = str(lab.get("name") or "").strip() or path.stem
    if not LABELLER_NAME_PATTERN.match(who):
        raise UsageError(f"{path}: labeller name {who!r} must be letters, digits, '_', '.', '-' (at most 64); "
                         f"type a plain name in identify.html and export again")
    file_kind = str(lab.get("kind") or "").strip()
    if kind and file_kind and kind != file_kind:
        raise UsageError(f"{path}: the file says labeller kind {file_kind!r} but labeller_kind= is {kind!r}; "
                         f"drop labeller_kind= or fix the kind in the page")
    k = kind or file_kind
    if k not in LABELLER_KINDS:
        raise UsageError(f"{path}: labeller kind {k or 'missing'!r}; pass labeller_kind=person or model")
    if d.get("sample_id") != sample.sample_id:
        raise UsageError(f"{path}: answers for sample {d.get('sample_id')}, but the run's sample is "
                         f"{sample.sample_id}; answer the run's current identify.html (the sample was redrawn since)")
    keys = {q.row for q in pairs}
    rows, seen = [], set()
    given = d.get("rows", [])
    if not isinstance(given, list):
        raise UsageError(f"{path}: 'rows' is {type(given).__name__}, not a list; export the file again from "
                         f"identify.html")
    for i, r in enumerate(given):
        if not isinstance(r, dict):
            raise UsageError(f"{path}: row {i} is {type(r).__name__ if r is not None else 'null'}, not an object; "
                             f"export the file again from identify.html")
        choice = r.get("choice")
        if choice in (None, ""):
            continue
        row = str(r.get("row") or "")
        if choice not in CHOICES:
            raise UsageError(f"{path} row {row!r}: choice {choice!r} is not one of {', '.join(CHOICES)}; "
                             f"export again from identify.html")
        if row not in keys:
            raise UsageError(f"{path}: row {row!r} is not a pair of the run's identify.html; answer the run's own "
                             f"page and do not edit the file")
        if row in seen:
            raise UsageError(f"{path}: row {row!r} is answered twice; keep one answer per row")
        seen.add(row)
        rows.append({"row": row, "choice": choice, "note": str(r.get("note") or "")})
    if not rows:
        raise UsageError(f"{path}: no pair is answered; answer at least one row in identify.html and export again")
    return {"format": IDENTIFY_FORMAT, "sample_id": sample.sample_id, "labeller": {"name": who, "kind": k},
            "rows": sorted(rows, key=lambda r: r["row"])}


def import_identify(run: str | Path, paths: Sequence[str | Path], sample: AuditSample, kind: str | None = None
                    ) -> list[tuple[Path, dict[str, Any]]]:
    """Check every identification export (nothing is stored yet); store them with :func:`store_identify`.

    Why two steps: the command checks these files and the codebook labels first, then stores both, so one
    bad file leaves nothing half-imported.
    """
    pairs = load_pairs(run, sample)
    if pairs is None:
        raise UsageError(f"{audit_dir(run) / PAIRS_FILE} does not record the run's sample; write the pages first "
                         f"(`mechprobe audit {shell_arg(run)} n={sample.n} by={sample.by} seed={sample.seed}`)")
    loaded = [read_identify_file(p, sample, pairs, kind) for p in paths]
    names = [d["labeller"]["name"] for d in loaded]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"two identification files name the same labeller {dup[0]!r}; give each a distinct name")
    out = []
    for d in loaded:
        dest = audit_dir(run) / LABELS_DIR / f"{d['labeller']['name']}.json"
        if dest.exists() and read_json(dest) != d:
            raise UsageError(f"{dest} already holds different answers by {d['labeller']['name']!r}; use another "
                             f"labeller name, or delete {dest} to replace them")
        out.append((dest, d))
    return out


def store_identify(checked: list[tuple[Path, dict[str, Any]]]) -> list[Path]:
    """Write what :func:`import_identify` checked; an identical stored file is left as it is."""
    for dest, d in checked:
        if not dest.exists():
            write_json(dest, d)
    return [dest for dest, _ in checked]


def _clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    lo, hi = proportion_confint(k, n, alpha=alpha, method="beta")
    return float(lo), float(hi)


def score_choices(choices: Sequence[str], real: Sequence[str], alpha: float = 0.05) -> dict[str, Any]:
    """Share of pairs identified correctly, with a Clopper-Pearson interval and a one-sided test against chance.

    Args:
        choices: the reader's answers (``A``, ``B`` or ``cant_tell``), one per answered pair.
        real: where the real answer was (``A`` or ``B``), aligned with ``choices``.
        alpha: 1 - confidence level.
    Returns:
        ``{"n", "correct", "wrong", "cant_tell", "share", "lo", "hi", "p_above_chance", "chance"}``; "can't tell"
        counts as not identified (in ``n``, not in ``correct``); ``share`` is NaN-free: None when ``n == 0``.
    Example:
        >>> score_choices(["A", "B", "cant_tell", "A"], ["A", "B", "A", "B"])["correct"]
        2
    """
    if len(choices) != len(real):
        raise ValueError("score_choices needs one real position per choice")
    n = len(choices)
    correct = sum(c == r for c, r in zip(choices, real))
    cant = sum(c == CANT_TELL for c in choices)
    out: dict[str, Any] = {"n": n, "correct": correct, "wrong": n - correct - cant, "cant_tell": cant,
                           "chance": CHANCE, "share": None, "lo": None, "hi": None, "p_above_chance": None}
    if n:
        lo, hi = _clopper_pearson(correct, n, alpha)
        out.update(share=correct / n, lo=lo, hi=hi,
                   p_above_chance=float(binomtest(correct, n, CHANCE, alternative="greater").pvalue))
    return out


def _load_stored(run: str | Path, sample: AuditSample) -> list[dict[str, Any]]:
    d = audit_dir(run) / LABELS_DIR
    got = [read_json(p) for p in sorted(d.glob("*.json"))] if d.is_dir() else []
    return [x for x in got if x.get("sample_id") == sample.sample_id]


def identification_report(run: str | Path, table: TurnTable, sample: AuditSample, alpha: float = 0.05,
                          n_boot: int = 2000, seed: int = 0) -> dict[str, Any] | None:
    """The identification section of the audit report, or None when nobody answered the identification page.

    Per labeller and stratum (and over all strata): the share of pairs identified correctly against chance
    (50%), "can't tell" counted as not identified and reported; beside it the stratum's judge-only genuine
    rate. Also per judge verdict (turns the judge calls genuine vs not), the check that matters: a judge's
    genuine turns should be identifiable well above chance, its other turns near chance. ``n_boot`` and ``seed``
    are those of the rates table, whose judge-only rate (and interval) the genuine column repeats.
    """
    pairs = load_pairs(run, sample)
    stored = _load_stored(run, sample)
    if pairs is None or not stored:
        return None
    by_row = {q.row: q for q in pairs}
    strata = table.strata(sample.by)
    # The same estimate as the rates table (item-clustered where an item holds several turns; n_boot and seed as
    # there), so one stratum never shows two intervals in one report.
    genuine = {s: judge_only_rate([int(t.judge_genuine) for t in turns], alpha, [t.item_id for t in turns], n_boot,
                                  seed).to_dict() for s, turns in strata.items()}
    kinds = {k: sum(q.kind == k for q in pairs) for k in (OTHER_SAMPLE, PERTURBED)}
    rec = read_json(audit_dir(run) / PAIRS_FILE)
    out: dict[str, Any] = {
        "chance": CHANCE, "alpha": alpha, "interval": "clopper-pearson",
        "pairs": {"n": len(pairs), "left_out": len(rec.get("left_out", [])), "distractors": kinds,
                  "seed": rec.get("seed")},
        "labellers": [], "by_stratum": [], "by_judge_verdict": [],
    }
    for lab in stored:
        name = lab["labeller"]["name"]
        answered = [(by_row[r["row"]], r["choice"]) for r in lab["rows"] if r["row"] in by_row]
        out["labellers"].append({"name": name, "kind": lab["labeller"]["kind"], "n_answered": len(answered)})
        for s in [*strata, "all"]:
            sub = [(q, c) for q, c in answered if s == "all" or table.get(q.record_id).stratum(sample.by) == s]
            out["by_stratum"].append({"labeller": name, "stratum": s,
                                      **score_choices([c for _, c in sub], [q.real for q, _ in sub], alpha),
                                      "genuine_judge_only": genuine.get(s) if s != "all" else judge_only_rate(
                                          [int(t.judge_genuine) for t in table.rows], alpha,
                                          [t.item_id for t in table.rows], n_boot, seed).to_dict()})
        for verdict in (True, False):
            sub = [(q, c) for q, c in answered if table.get(q.record_id).judge_genuine == verdict]
            out["by_judge_verdict"].append({"labeller": name, "judge": "genuine" if verdict else "not genuine",
                                            **score_choices([c for _, c in sub], [q.real for q, _ in sub], alpha)})
    return out


def _share(r: dict[str, Any]) -> str:
    if r["share"] is None:
        return "n/a"
    return f"{r['share']:.1%} [{r['lo']:.1%}, {r['hi']:.1%}] ({r['correct']}/{r['n']})"


def _md(s: str) -> str:
    """A markdown table cell: condition names such as ``diff_means|L14|a0.8`` contain pipes."""
    return s.replace("|", "\\|")


def _cell(d: dict[str, Any] | None) -> str:
    if not d or d.get("point") is None or d["point"] != d["point"]:
        return "n/a"
    return f"{d['point']:.1%} [{d['lo']:.1%}, {d['hi']:.1%}]"


def identification_markdown(rep: dict[str, Any]) -> list[str]:
    """Markdown lines of the identification section of ``rep`` (nothing when it has none).

    The genuine rates beside each stratum are the judge-only rate and, where the report has it, the corrected one.
    """
    sec = rep.get("identification")
    if not sec:
        return []
    pct = round(100 * (1 - sec["alpha"]))
    p = sec["pairs"]
    lines = ["", f"## Answer identification (chance {sec['chance']:.0%}; {pct}% Clopper-Pearson CIs)", "",
             f"Pairs: {p['n']} (distractor another sample of the item: {p['distractors'].get(OTHER_SAMPLE, 0)}, "
             f"the real answer with its numbers changed: {p['distractors'].get(PERTURBED, 0)}); "
             f"{p['left_out']} turns left out (no distractor). \"Can't tell\" counts as not identified.", "",
             "| labeller | stratum | identified | can't tell | genuine: judge only | genuine: corrected |",
             "|---|---|---|---|---|---|"]
    rates = rep.get("rates") or {}
    for r in sec["by_stratum"]:
        corrected = (rates.get(r["stratum"]) or {}).get("corrected")
        lines.append(f"| {r['labeller']} | {_md(r['stratum'])} | {_share(r)} | "
                     f"{r['cant_tell']} | {_cell(r.get('genuine_judge_only'))} | {_cell(corrected)} |")
    lines += ["", "| labeller | judge verdict | identified | can't tell | p (above chance) |", "|---|---|---|---|---|"]
    for r in sec["by_judge_verdict"]:
        pv = "n/a" if r["p_above_chance"] is None else f"{r['p_above_chance']:.3g}"
        lines.append(f"| {r['labeller']} | {r['judge']} | {_share(r)} | {r['cant_tell']} | {pv} |")
    return lines
