"""The judge table: each judge's binary agreement with the blind labellers' consensus, per subject model, dataset,
reading and split, from committed labels and committed verdicts only.

Why here (below the judges): ``mechprobe findings`` recomputes every quoted number from committed files and may
not run a judge; the verdicts are committed per turn (``reports/judge/verdicts.jsonl`` and the judges' files
beside the labelled sets, read by :mod:`mechprobe.audit.blind_sets`), so the table is a pure function of files.

Each cell: the turns of that model (and dataset) in that split where the two labellers agree under the reading
(:func:`~mechprobe.audit.blind_sets.consensus`) and the judge has a verdict; Cohen's kappa (genuine vs not) with
a 95% bootstrap interval that resamples items (:func:`~mechprobe.audit.agreement.kappa_with_ci`), the confusion
(judge x labellers), and the positive rate the judge implies beside the labellers'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.taxonomy import GENUINE

from .agreement import kappa_with_ci
from .blind_sets import BlindSets, JudgeVerdict, consensus, split_of_item
from .readings import READINGS

__all__ = ["VERDICTS_FILE", "ROUNDS_FILE", "read_verdicts", "read_all_verdicts", "hidden_verdicts_file", "hidden_judge_name", "judge_table", "cell_key", "model_short", "round_group",
           "since_group", "groups_of_rounds",
           "round_groups"]

VERDICTS_FILE = "reports/judge/verdicts.jsonl"
ROUNDS_FILE = "reports/judge/test_rounds.json"  # per fit of the text-fit weights: the test items it scored first
_NOT = "not_genuine"


def model_short(model: str) -> str:
    """``qwen2.5-coder-1.5b-instruct`` -> ``qwen1.5b``, ``smollm2-135m-instruct`` -> ``smollm135m`` (key parts)."""
    size = next((p for p in model.split("-") if p[:1].isdigit() and p[-1:] in "bm"), model)
    return ("qwen" if model.startswith("qwen") else model.split("-")[0].rstrip("0123456789.")) + size


def cell_key(judge: str, model: str, dataset: str, reading: str, split: str) -> str:
    """The findings key of one cell's kappa: ``judge_table.<judge>.<model>.<dataset>.<reading>.<split>``."""
    j = judge.replace(":", "_").replace(".", "_")
    return f"judge_table.{j}.{model_short(model)}.{dataset}.{reading}.{split}"


def round_group(r: dict[str, Any]) -> str:
    """The table's split name for a fit's round: ``test_<version>`` (the test items that fit scored first)."""
    return f"test_{r['weights']}"


def since_group(r: dict[str, Any]) -> str:
    """The table's split name for every test item first scored at or after a fit's round: ``since_<version>``."""
    return f"since_{r['weights']}"


def groups_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, set[str]]:
    """The table's extra splits from the fits' rounds (oldest first): each round's once-scored items
    (:func:`round_group`) and, for each hidden-state fit that later rounds follow, every test item of its round and
    of the later ones (:func:`since_group`).

    Why the second: a later round's items were drawn after that fit was committed, and no fit gives verdicts on its
    own pool, so they are items it never saw, labelled after its verdicts existed; pooled they read its agreement
    on two or three times the positives one round holds (11-24 per model), where one round reads kappa to about a
    tenth. Only hidden-state fits get one: they are the research default's lineage, and every group multiplies the
    table's cells.

    Example:
        >>> rs = [{"weights": "hidden:r@v1", "fresh_items": ["a"]}, {"weights": "hidden:r@v2", "fresh_items": ["b"]}]
        >>> sorted((k, sorted(v)) for k, v in groups_of_rounds(rs).items())
        [('since_hidden:r@v1', ['a', 'b']), ('test_hidden:r@v1', ['a']), ('test_hidden:r@v2', ['b'])]
    """
    out = {round_group(r): set(r["fresh_items"]) for r in rounds}
    for i, r in enumerate(rounds[:-1]):
        if str(r["weights"]).startswith("hidden:"):
            out[since_group(r)] = set().union(*(set(x["fresh_items"]) for x in rounds[i:]))
    return out


def round_groups(path: str | Path) -> dict[str, set[str]]:
    """The table's extra splits (:func:`groups_of_rounds`) from the committed rounds file; empty when there is
    none."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        return groups_of_rounds(json.loads(path.read_text(encoding="utf-8"))["rounds"])
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{path}: not a rounds file (rounds: weights, fresh_items); rerun the judges evaluate "
                         "command with fit=True or restore it from git") from None


FIRST_HIDDEN_VERSION = "hidden-v1"


def hidden_judge_name(reader: str, version: str = FIRST_HIDDEN_VERSION) -> str:
    """The table's name of the hidden-state judge fit with ``reader`` at weights ``version``: ``hidden:READER`` for
    the first fit (the name its committed cells carry), ``hidden:READER@VERSION`` for every later one, so a refit
    with the same reader is a judge of its own beside the earlier one."""
    return f"hidden:{reader}" if version == FIRST_HIDDEN_VERSION else f"hidden:{reader}@{version}"


def hidden_verdicts_file(reader: str, version: str = FIRST_HIDDEN_VERSION) -> str:
    """Where the hidden-state judge's verdicts for ``reader`` (weights ``version``) are committed (beside
    ``VERDICTS_FILE``): written only when its reader runs (``judges evaluate --hidden MODEL``), read by every
    later table without it. One file per version: a refit never overwrites the verdicts an earlier fit's
    committed cells were computed from."""
    tail = "" if version == FIRST_HIDDEN_VERSION else f"@{version}"
    return str(Path(VERDICTS_FILE).with_name(f"verdicts_hidden_{reader}{tail}.jsonl"))


def read_all_verdicts(root: str | Path) -> list[JudgeVerdict]:
    """Every committed verdict under ``root``: ``VERDICTS_FILE`` and each hidden-state judge's file."""
    root = Path(root)
    out = read_verdicts(root / VERDICTS_FILE)
    for f in sorted((root / VERDICTS_FILE).parent.glob("verdicts_hidden_*.jsonl")):
        out += read_verdicts(f)
    return out


def read_verdicts(path: str | Path) -> list[JudgeVerdict]:
    """The verdicts file ``mechprobe judges evaluate`` writes (one JSON object per turn, judge and reading)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out.append(JudgeVerdict(str(r["turn_id"]), str(r["judge"]), r.get("reading"), bool(r["genuine"]), str(path)))
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{path}:{i}: not a verdict row (turn_id, judge, reading, genuine); rerun "
                             "mechprobe judges evaluate") from None
    return out


def _verdict_map(verdicts: Iterable[JudgeVerdict]) -> dict[tuple[str, str | None], dict[str, bool]]:
    """(judge, reading) -> turn -> verdict; where two files give one judge's verdict on a turn, the first stands."""
    out: dict[tuple[str, str | None], dict[str, bool]] = {}
    for v in verdicts:
        out.setdefault((v.judge, v.reading), {}).setdefault(v.turn_id, v.genuine)
    return out


def judge_table(blind: BlindSets, verdicts: Sequence[JudgeVerdict], splits: Sequence[str] = ("test",),
                readings: Sequence[str] = READINGS, n_boot: int = 500, seed: int = 0,
                groups: dict[str, set[str]] | None = None) -> list[dict[str, Any]]:
    """One row per (judge, model, dataset or ``all``, reading, split) with at least one scored turn.

    A judge's verdict under a reading is the one it gave for that reading, else its single verdict (reading None).
    ``groups``: extra "splits" by item, e.g. ``{"test_fresh": items}`` for the test items first scored by the
    current weights (a refit judge re-reads the older test items; only the fresh ones are scored once).
    """
    groups = groups or {}
    vmap = _verdict_map(verdicts)
    judges = sorted({j for j, _ in vmap})
    truth = {r: {t: consensus(blind.labels_of(t), r) for t in blind.turns} for r in readings}
    rows = []
    for judge in judges:
        for reading in readings:
            got = vmap.get((judge, reading)) or vmap.get((judge, None)) or {}
            cells: dict[tuple[str, str, str], list[str]] = {}
            for tid, t in blind.turns.items():
                if truth[reading][tid] is None or tid not in got:
                    continue
                sps = [split_of_item(t.item)] + [g for g, items in groups.items() if t.item in items]
                for sp in (x for x in sps if x in splits or x in groups):
                    for ds in ("all", t.dataset):
                        cells.setdefault((t.model, ds, sp), []).append(tid)
            for (model, ds, sp), tids in sorted(cells.items()):
                y = [truth[reading][t] for t in tids]
                p = [got[t] for t in tids]
                items = [blind.turns[t].item for t in tids]
                k = kappa_with_ci([GENUINE if x else _NOT for x in y], [GENUINE if x else _NOT for x in p], items,
                                  binary=True, n_boot=n_boot, seed=seed)
                tp = sum(a and b for a, b in zip(y, p))
                fp = sum(b and not a for a, b in zip(y, p))
                fn = sum(a and not b for a, b in zip(y, p))
                rows.append({"judge": judge, "model": model, "dataset": ds, "reading": reading, "split": sp,
                             "n": len(tids), "items": len(set(items)), "kappa": _num(k.kappa), "lo": _num(k.lo),
                             "hi": _num(k.hi), "agree": k.agree, "tp": tp, "fp": fp, "fn": fn,
                             "tn": len(tids) - tp - fp - fn, "labellers_genuine": sum(y), "judge_genuine": sum(p),
                             "finding": cell_key(judge, model, ds, reading, sp)})
    return rows


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
