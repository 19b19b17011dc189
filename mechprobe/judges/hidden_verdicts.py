"""The hidden-state judge's committed verdicts, one file per weights version: which turns each version scores and
the reader forwards that takes.

Why its own module: a refit archives the weights it replaces (``reports/judge/weights/hidden_<reader>_<version>.json``)
and those earlier fits must keep scoring the labelled sets added after them, or a pre-registered comparison of the
new fit against the old one (``studies/judge/hidden_v2_fit.json``: restore hidden-v1 if hidden-v2 is worse on the
fresh test) cannot be computed. Both fits read the same reader, so the reader's features are computed once, for the
turns some version still lacks, and every version's verdicts are written from them.

Which turns a version scores (:func:`turns_to_score`): a ``split`` fit every labelled turn (its train and dev cells
are labelled as such in the table); a ``pool`` fit only the turns outside its pool, which it was fit on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from mechprobe.audit.blind_sets import BlindSets
from mechprobe.audit.judge_table import hidden_judge_name, hidden_verdicts_file, read_verdicts
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.hidden import feature_kind, head_threshold, hidden_head_proba
from mechprobe.judges.hidden import load_weights as hidden_load_weights
from mechprobe.judges.hidden_cv import held_out_sources, pool_turns
from mechprobe.judges.hidden_fit import cached_hidden_features

__all__ = ["archived_hidden_weights", "turns_to_score", "verdict_rows", "write_hidden_verdicts"]


def archived_hidden_weights(archive: Path, reader: str, current: dict[str, Any]) -> list[dict[str, Any]]:
    """Every archived hidden-state fit of ``reader`` but ``current`` (``archive/hidden_<reader>_<version>.json``),
    oldest version first.

    Example:
        >>> archived_hidden_weights(Path("no-such-folder"), "qwen2.5-coder-0.5b-instruct", {"weights_sha256": ""})
        []
    """
    files = sorted(Path(archive).glob(f"hidden_{reader}_*.json")) if Path(archive).is_dir() else []
    ws = [hidden_load_weights(f) for f in files]
    return [w for w in ws if w["reader"] == reader and w["weights_sha256"] != current["weights_sha256"]]


def turns_to_score(hw: dict[str, Any], blind: BlindSets, tids: Iterable[str],
                   held_now: frozenset[str] | None = None) -> list[str]:
    """The turns weights ``hw`` give verdicts on: all of ``tids`` for a split fit, those outside its pool for a pool
    fit (a pool fit's verdicts on its own training turns would be in-sample, not a test).

    A pool fit's pool is every turn outside its own held-out sources and outside the sources held out now
    (``held_now``, default :func:`~mechprobe.judges.hidden_cv.held_out_sources`): a test set added after the fit,
    marked ``fit=False``, was never read by any fit, so an earlier fit scores it too.
    """
    tids = sorted(tids)
    if (hw.get("fit") or {}).get("protocol") == "pool":
        held = frozenset(hw["fit"]["held_out_sources"]) | (held_out_sources() if held_now is None else held_now)
        pool = set(pool_turns(blind, held))
        tids = [t for t in tids if t not in pool]
    return tids


def verdict_rows(hw: dict[str, Any], X: dict[str, np.ndarray], tids: list[str],
                 subjects: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One verdict row per turn and head of weights ``hw`` from the reader's features ``X`` (turn id -> row at
    ``hw['layer']``), in the verdicts file's format; ``subjects`` (turn id -> the model that wrote it) picks a
    head's per-subject threshold where the fit has one (:func:`~mechprobe.judges.hidden.head_threshold`).

    Example:
        >>> verdict_rows({"reader": "r", "version": "hidden-v1", "heads": {}}, {}, [])
        []
    """
    subjects = subjects or {}
    spec = hidden_judge_name(hw["reader"], hw["version"])
    rows: list[dict[str, Any]] = []
    if not tids:
        return rows
    for head in hw["heads"]:
        probs = hidden_head_proba(hw, head, np.stack([X[t] for t in tids]))
        rows += [{"turn_id": t, "judge": spec, "reading": head,
                  "genuine": bool(p >= head_threshold(hw, head, subjects.get(t, "")))} for t, p in zip(tids, probs)]
    return rows


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """A committed verdicts file as rows (read by the table's own reader: a malformed line is its one-line error)."""
    return [{"turn_id": v.turn_id, "judge": v.judge, "reading": v.reading, "genuine": v.genuine}
            for v in read_verdicts(path)]


def write_hidden_verdicts(lm: Any, current: dict[str, Any], archived: list[dict[str, Any]], blind: BlindSets,
                          inputs: dict[str, JudgeInput], root: Path, cache: Path, refit: bool = False) -> list[Path]:
    """Add to each version's verdicts file the turns it has no verdict on; a new fit's file is written anew.

    Committed rows are kept as they are (only ``refit``, a fit that just wrote ``current``, rewrites its file), so
    a cell once scored never moves. Why not recompute them: the reader's features differ in the last bits between
    CPUs (bf16 kernels), and a turn near a threshold can flip: recomputing ``hidden-v2``'s 1,498 committed verdicts
    on another CPU class flipped 2, and those committed verdicts were written before the labels they are scored
    against. Features are computed for the turns that need them only.

    Args:
        lm: the reader (its ``name`` is every version's reader).
        current: the package's weights for this reader.
        archived: earlier fits of the same reader (:func:`archived_hidden_weights`).
        blind: the labelled sets.
        inputs: turn id -> what a judge sees, for every labelled turn.
        root: the repository root (verdict files under ``reports/judge``).
        cache: the reader's feature cache folder (``runs/judge_eval``).
        refit: ``current`` was just fit: its file (of an earlier fit under the same version, if any) is replaced.

    Returns:
        the verdict files written, current first.
    """
    plan: list[tuple[dict[str, Any], Path, list[dict[str, Any]], list[str]]] = []
    subjects = {t: x.model for t, x in blind.turns.items()}
    for i, hw in enumerate([current, *archived]):
        path = root / hidden_verdicts_file(lm.name, hw["version"])
        keep = [] if (i == 0 and refit) else _read_rows(path)
        heads = set(hw["heads"])
        by_turn: dict[str, set[str]] = {}
        for r in keep:
            by_turn.setdefault(r["turn_id"], set()).add(r["reading"])
        have = {t for t, rd in by_turn.items() if heads <= rd}  # a turn missing a head is scored again
        keep = [r for r in keep if r["turn_id"] in have]
        plan.append((hw, path, keep, [t for t in turns_to_score(hw, blind, inputs) if t not in have]))
    for layer, kind in sorted({(int(hw["layer"]), feature_kind(hw)) for hw, _, _, todo in plan if todo}):
        same = [k for k, (hw, *_) in enumerate(plan) if (int(hw["layer"]), feature_kind(hw)) == (layer, kind)]
        need = sorted({t for k in same for t in plan[k][3]})
        X = cached_hidden_features(lm, {t: inputs[t] for t in need}, [layer], cache, kind=kind)[layer]
        for k in same:
            hw, path, keep, todo = plan[k]
            plan[k] = (hw, path, keep + verdict_rows(hw, X, todo, subjects), [])
    written = []
    for _hw, path, rows, _ in plan:
        if rows or path.is_file():
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
            written.append(path)
    return written
