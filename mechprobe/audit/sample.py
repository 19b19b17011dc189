"""Draw, record and reuse the audit sample: which judged turns people (or a second model) relabel.

Why stratified and recorded: a follow-up rate is reported per condition (or decoding, or dataset), and the
correction of each rate needs audited turns *of that stratum*, so the ``n`` turns are spread evenly over the
strata rather than drawn from the pool (where a rare condition could get none). Why recorded in the run
(``<run>/audit/sample.json``): labels are collected over days, and a sheet must keep meaning the same turns;
re-running the command with the same arguments reuses the sample, other arguments refuse unless ``redraw``.

Why coordinated over items: within every stratum the turns are taken in one seeded random order of
*items*, shared by all strata. The choice still ignores every label (so each stratum's audited turns are
a simple random sample of it, which the correction assumes), and two conditions of a steering run are
audited on the same items as far as possible, which the paired steered-vs-unsteered correction needs.

Why at most one turn per item and stratum (by default): turns of one item (k samples at T1, perturbed variants)
share a query and an answer, so a second audited turn of an item carries less information than a turn of a new
item. Spreading the audit over items makes the audited turns close to independent; ``turns_per_item`` allows
more (taken round-robin: every item's first turn before any item's second), and the report's intervals are
item-clustered whenever an item holds several turns. With the same number of turns per item in a stratum
(a probe run's k samples) every turn still has the same chance to be audited.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.io import read_json, shell_arg

from .codebook import CODEBOOK_VERSION, LEGACY_CODEBOOK_VERSION
from .store import write_json_atomic
from .table import STRATA, LabelledTurn, TurnTable

__all__ = ["AuditSample", "draw_sample", "load_or_draw", "load_sample", "audit_dir", "SAMPLE_FILE"]

SAMPLE_FILE = "sample.json"
SAMPLE_FORMAT = "mechprobe-audit-sample-v1"


@dataclass(frozen=True)
class AuditSample:
    """One recorded audit sample.

    ``record_ids`` are in draw order (stratum by stratum); ``per_stratum`` how many turns each stratum
    gave; ``labels_sha256`` the hash of the judge-label files at draw time (:attr:`TurnTable.labels_sha256`).
    ``sample_id`` is derived from all of it, so a labels file names the sample it belongs to.
    ``turns_per_item``: the most turns of one item drawn per stratum (0: no limit; None: a sample recorded before
    the limit existed, which took whole items). ``codebook_version``: the codebook the sheet showed (``v1`` for a
    sample recorded before versions).
    """

    seed: int
    n: int
    by: str
    record_ids: tuple[str, ...]
    per_stratum: dict[str, int]
    judges: tuple[str, ...]
    labels_sha256: str
    sources: dict[str, str] = field(default_factory=dict)
    sample_id: str = ""
    turns_per_item: int | None = None
    codebook_version: str = ""

    def __post_init__(self) -> None:
        if not self.sample_id:
            object.__setattr__(self, "sample_id", _sample_id(self.seed, self.n, self.by, self.record_ids,
                                                             self.labels_sha256))

    def row_key(self, record_id: str) -> str:
        """The opaque key a sheet shows for a turn: its record id would reveal the condition."""
        return "r" + hashlib.sha256(f"{self.sample_id}\0{record_id}".encode()).hexdigest()[:10]

    def keys(self) -> dict[str, str]:
        """``row key -> record id`` for every sampled turn."""
        return {self.row_key(r): r for r in self.record_ids}

    def args(self) -> dict[str, Any]:
        return {"seed": self.seed, "n": self.n, "by": self.by}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["record_ids"] = list(self.record_ids)
        d["judges"] = list(self.judges)
        d["format"] = SAMPLE_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditSample:
        d = {k: v for k, v in d.items() if k != "format"}
        d["record_ids"] = tuple(d["record_ids"])
        d["judges"] = tuple(d["judges"])
        d.setdefault("codebook_version", LEGACY_CODEBOOK_VERSION)  # samples recorded before codebook versions
        return cls(**d)


def _sample_id(seed: int, n: int, by: str, ids: tuple[str, ...], labels_sha: str) -> str:
    blob = json.dumps([seed, n, by, list(ids), labels_sha])
    return "s" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def _quotas(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Split ``n`` evenly over strata (sorted order breaks remainders); a stratum smaller than its share gives
    all its turns and the rest goes to the others, so the total is ``min(n, sum(sizes))``."""
    quota = dict.fromkeys(sizes, 0)
    left = min(n, sum(sizes.values()))
    while left > 0:
        open_ = [s for s in sizes if quota[s] < sizes[s]]
        share, extra = divmod(left, len(open_))
        for i, s in enumerate(open_):
            give = min(share + (1 if i < extra else 0), sizes[s] - quota[s])
            quota[s] += give
            left -= give
    return quota


def _spread(rows: list[LabelledTurn], rank: dict[str, int], tiebreak: dict[str, float],
            turns_per_item: int) -> list[LabelledTurn]:
    """A stratum's turns in draw order: items in the shared order, one turn of each item per pass (at most
    ``turns_per_item`` passes; 0 = until every turn is placed)."""
    by_item: dict[str, list[LabelledTurn]] = {}
    for r in sorted(rows, key=lambda r: (rank[r.item_id], tiebreak[r.record_id])):
        by_item.setdefault(r.item_id, []).append(r)
    items = list(by_item)  # already in the shared item order
    passes = max(len(v) for v in by_item.values()) if by_item else 0
    if turns_per_item > 0:
        passes = min(passes, turns_per_item)
    return [by_item[it][k] for k in range(passes) for it in items if k < len(by_item[it])]


def draw_sample(table: TurnTable, n: int, by: str = "condition", seed: int = 0,
                turns_per_item: int = 1) -> AuditSample:
    """Draw a seeded, stratified random sample of ``n`` turns of ``table``, spread over items.

    Args:
        table: the run's judged turns (:func:`~mechprobe.audit.table.load_run_table`).
        n: total number of turns; spread evenly over the strata (fewer if the table is smaller).
        by: the stratum field, one of ``condition``, ``decoding``, ``dataset``.
        seed: the random seed; the same table, ``n``, ``by``, seed and ``turns_per_item`` give the same sample.
        turns_per_item: at most this many turns of one item per stratum (default 1; 0 = no limit). A stratum
            with fewer items than its share gives one turn per item and its remainder goes to the other strata.
    Returns:
        the sample (not yet written; see :func:`load_or_draw`).
    Example:
        >>> s = draw_sample(table, 80, by="condition", seed=0)  # doctest: +SKIP
        >>> s.per_stratum  # doctest: +SKIP
        {'diff_means|L14|a0.8': 40, 'none': 40}
    """
    if by not in STRATA:
        raise UsageError(f"by={by!r} is not a stratum; use one of {', '.join(STRATA)}")
    if n < 1:
        raise UsageError(f"n={n}: the audit needs at least one turn; pass n=80 or so")
    if turns_per_item < 0:
        raise UsageError(f"turns_per_item={turns_per_item}: pass 1 (the default), a larger limit, or 0 for no limit")
    rng = random.Random(seed)
    items = sorted({r.item_id for r in table.rows})
    rng.shuffle(items)
    rank = {it: i for i, it in enumerate(items)}
    tiebreak = {r.record_id: rng.random() for r in sorted(table.rows, key=lambda r: r.record_id)}
    groups = table.strata(by)
    order = {s: _spread(rows, rank, tiebreak, turns_per_item) for s, rows in groups.items()}
    quota = _quotas({s: len(o) for s, o in order.items()}, n)
    ids: list[str] = []
    for s, o in order.items():
        ids += [r.record_id for r in o[:quota[s]]]
    return AuditSample(seed=seed, n=n, by=by, record_ids=tuple(ids), per_stratum=quota,
                       judges=tuple(table.judges), labels_sha256=table.labels_sha256, sources=dict(table.sources),
                       turns_per_item=turns_per_item, codebook_version=CODEBOOK_VERSION)


def audit_dir(run: str | Path) -> Path:
    return Path(run) / "audit"


def load_sample(run: str | Path) -> AuditSample:
    """The run's recorded sample, or :class:`UsageError` saying how to draw one."""
    p = audit_dir(run) / SAMPLE_FILE
    if not p.exists():
        raise UsageError(f"{p} not found: draw the audit sample first (`mechprobe audit {shell_arg(run)} n=80 by=condition`)")
    return AuditSample.from_dict(read_json(p))


def load_or_draw(run: str | Path, table: TurnTable, n: int, by: str = "condition", seed: int = 0,
                 redraw: bool = False, turns_per_item: int = 1) -> tuple[AuditSample, bool]:
    """Reuse the run's sample when it was drawn with these arguments, else draw and record one.

    Args:
        run: the run directory; the sample goes to ``<run>/audit/sample.json``.
        table: the run's table (the sample must be drawn from it).
        n, by, seed, turns_per_item: see :func:`draw_sample`. A sample recorded before the per-item limit
            existed is reused whatever ``turns_per_item`` says (its labels name it; the report's intervals are
            item-clustered either way).
        redraw: replace a sample drawn with other arguments (labels already collected for the old sample
            will no longer import: they name its sample id).
    Returns:
        ``(sample, drawn)``; ``drawn`` is False when the recorded sample was reused.
    Example:
        >>> sample, drawn = load_or_draw(run, table, 80, "condition", 0)  # doctest: +SKIP
    """
    p = audit_dir(run) / SAMPLE_FILE
    if p.exists() and not redraw:
        old = AuditSample.from_dict(read_json(p))
        same_limit = old.turns_per_item is None or old.turns_per_item == turns_per_item
        if old.args() == {"seed": seed, "n": n, "by": by} and same_limit:
            missing = [r for r in old.record_ids if not table.has(r)]
            if missing:
                raise UsageError(f"{p} names {len(missing)} turns the run no longer has (first {missing[0]!r}); "
                                 f"pass redraw=True to draw a new sample from the run as it is now")
            return old, False
        raise UsageError(f"{p} was drawn with n={old.n} by={old.by} seed={old.seed} turns_per_item="
                         f"{old.turns_per_item}, not n={n} by={by} seed={seed} turns_per_item={turns_per_item}; "
                         f"repeat those arguments to reuse it, or pass redraw=True to replace it")
    sample = draw_sample(table, n, by, seed, turns_per_item)
    write_json_atomic(p, sample.to_dict())
    return sample, True
