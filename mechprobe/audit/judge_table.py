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

__all__ = ["VERDICTS_FILE", "read_verdicts", "judge_table", "cell_key", "model_short"]

VERDICTS_FILE = "reports/judge/verdicts.jsonl"
_NOT = "not_genuine"


def model_short(model: str) -> str:
    """``qwen2.5-coder-1.5b-instruct`` -> ``qwen1.5b``, ``smollm2-135m-instruct`` -> ``smollm135m`` (key parts)."""
    size = next((p for p in model.split("-") if p[:1].isdigit() and p[-1:] in "bm"), model)
    return ("qwen" if model.startswith("qwen") else model.split("-")[0].rstrip("0123456789.")) + size


def cell_key(judge: str, model: str, dataset: str, reading: str, split: str) -> str:
    """The findings key of one cell's kappa: ``judge_table.<judge>.<model>.<dataset>.<reading>.<split>``."""
    j = judge.replace(":", "_").replace(".", "_")
    return f"judge_table.{j}.{model_short(model)}.{dataset}.{reading}.{split}"


def read_verdicts(path: str | Path) -> list[JudgeVerdict]:
    """The verdicts file ``mechprobe judge-eval`` writes (one JSON object per turn, judge and reading)."""
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
                             "mechprobe judge-eval") from None
    return out


def _verdict_map(verdicts: Iterable[JudgeVerdict]) -> dict[tuple[str, str | None], dict[str, bool]]:
    """(judge, reading) -> turn -> verdict; where two files give one judge's verdict on a turn, the first stands."""
    out: dict[tuple[str, str | None], dict[str, bool]] = {}
    for v in verdicts:
        out.setdefault((v.judge, v.reading), {}).setdefault(v.turn_id, v.genuine)
    return out


def judge_table(blind: BlindSets, verdicts: Sequence[JudgeVerdict], splits: Sequence[str] = ("test",),
                readings: Sequence[str] = READINGS, n_boot: int = 500, seed: int = 0) -> list[dict[str, Any]]:
    """One row per (judge, model, dataset or ``all``, reading, split) with at least one scored turn.

    A judge's verdict under a reading is the one it gave for that reading, else its single verdict (reading None).
    """
    vmap = _verdict_map(verdicts)
    judges = sorted({j for j, _ in vmap})
    truth = {r: {t: consensus(blind.labels_of(t), r) for t in blind.turns} for r in readings}
    rows = []
    for judge in judges:
        for reading in readings:
            got = vmap.get((judge, reading)) or vmap.get((judge, None)) or {}
            cells: dict[tuple[str, str, str], list[str]] = {}
            for tid, t in blind.turns.items():
                sp = split_of_item(t.item)
                if sp not in splits or truth[reading][tid] is None or tid not in got:
                    continue
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
