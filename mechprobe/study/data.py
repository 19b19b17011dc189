"""The study's data: every run directory under the study root read into plain records, and the small
aggregates every table counts with.

:func:`collect` reads ``ROOT/<model>/<dataset>/`` (probe run), ``.../variants/<variant>/`` (perturbations),
``ROOT/_human/<dataset>/`` (real next human turns) and ``ROOT/plan.json`` (what was asked, which models were
unavailable). Every rate is the share of *judged* user turns labelled ``genuine_followup`` (``judge_error``
rows and unjudged rows excluded).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.io import read_json, read_jsonl
from mechprobe.records import truncated_item_ids
from mechprobe.stats import Rate
from mechprobe.taxonomy import GENUINE, JUDGE_ERROR

HUMAN_DIR = "_human"
PLAN = "plan.json"
STAGES = "study_stages.jsonl"
T_REF = 1.0  # the sampled temperature of studies 1, 3 and 5 and of the claims
DEGENERATE = "empty_or_degenerate"
N_BOOT = 2000


@dataclass
class Turn:
    item_id: str
    decoding: str
    temperature: float
    label: str | None  # None: not judged (or a judge error)
    stop_reason: str


@dataclass
class RunData:
    """One run directory's items, judged turns and judges (the unit every table aggregates)."""

    model: str
    dataset: str
    variant: str
    path: str
    scores: dict[str, float | None]  # item -> task score of the assistant turn
    answer_stops: dict[str, str]  # item -> stop reason of the assistant turn
    turns: list[Turn]
    judges: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    n_truncated_turns: int = 0  # user turns after a truncated answer, left out of ``turns`` (0 when included)


def labels_file_for(judge: str) -> str:
    """``labels_<judge>.jsonl``: one file per judge spec, so a second judge never mixes into the first's."""
    return "labels_" + re.sub(r"[^A-Za-z0-9.]+", "_", judge).strip("_") + ".jsonl"


def load_run_data(run: Path, labels_file: str, model: str, dataset: str, variant: str = "full",
                  include_truncated: bool = False) -> RunData | None:
    """One run's data; user turns after a truncated assistant answer are left out unless ``include_truncated``
    (counted in ``n_truncated_turns``; the answers themselves stay in ``answer_stops``)."""
    if not (run / "user_turns.jsonl").exists():
        return None
    a = read_jsonl(run / "assistant.jsonl", key="item_id")
    cut = set() if include_truncated else truncated_item_ids(a)
    labels = {r["record_id"]: r for r in read_jsonl(run / labels_file, key="record_id")}
    turns = []
    n_cut = 0
    for u in read_jsonl(run / "user_turns.jsonl", key="record_id"):
        if u["item_id"] in cut:
            n_cut += 1
            continue
        lab = labels.get(u["record_id"], {}).get("label")
        turns.append(Turn(u["item_id"], u["decoding"], float(u["temperature"]),
                          None if lab in (None, JUDGE_ERROR) else lab, u["stop_reason"]))
    man = run / "manifest.json"
    cfg = read_json(man).get("config", {}) if man.exists() else {}
    return RunData(model=model, dataset=dataset, variant=variant, path=str(run),
                   scores={r["item_id"]: r.get("score") for r in a},
                   answer_stops={r["item_id"]: r.get("stop_reason", "") for r in a}, turns=turns,
                   judges=sorted({r.get("judge", "?") for r in labels.values()}), config=cfg, n_truncated_turns=n_cut)


@dataclass
class StudyData:
    root: str
    labels_file: str
    full: dict[tuple[str, str], RunData]
    variants: dict[tuple[str, str, str], RunData]
    human: dict[str, RunData]
    plan: dict[str, Any]
    stages: dict[tuple[str, str], dict[str, float]]
    include_truncated: bool = False

    def models(self) -> list[str]:
        return sorted({m for m, _ in self.full})

    def datasets(self, model: str | None = None) -> list[str]:
        return sorted({d for m, d in self.full if model is None or m == model})

    def judges(self) -> list[str]:
        runs = [*self.full.values(), *self.variants.values(), *self.human.values()]
        return sorted({j for r in runs for j in r.judges})


def collect(root: str | Path, labels_file: str, include_truncated: bool = False) -> StudyData:
    """Read every run under ``root`` (sorted, so the report does not depend on directory order); user turns
    after truncated assistant answers are left out unless ``include_truncated``."""
    root = Path(root)
    full: dict[tuple[str, str], RunData] = {}
    variants: dict[tuple[str, str, str], RunData] = {}
    human: dict[str, RunData] = {}
    stages: dict[tuple[str, str], dict[str, float]] = {}
    for mdir in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        for ddir in sorted(p for p in mdir.iterdir() if p.is_dir()):
            if mdir.name == HUMAN_DIR:
                rd = load_run_data(ddir, labels_file, "human", ddir.name, "human", include_truncated)
                if rd is not None:
                    human[ddir.name] = rd
                continue
            rd = load_run_data(ddir, labels_file, mdir.name, ddir.name, include_truncated=include_truncated)
            if rd is None:
                continue
            full[(mdir.name, ddir.name)] = rd
            vroot = ddir / "variants"
            for vdir in sorted(p for p in vroot.iterdir() if p.is_dir()) if vroot.exists() else []:
                vd = load_run_data(vdir, labels_file, mdir.name, ddir.name, vdir.name, include_truncated)
                if vd is not None:
                    variants[(mdir.name, ddir.name, vdir.name)] = vd
            secs: dict[str, float] = {}
            for r in read_jsonl(ddir / STAGES):
                secs[r["stage"]] = round(secs.get(r["stage"], 0.0) + float(r["seconds"]), 1)
                if "cpu_seconds" in r:  # recorded since 2026-11-24; older rows have wall time only
                    k = "cpu:" + r["stage"]
                    secs[k] = round(secs.get(k, 0.0) + float(r["cpu_seconds"]), 1)
            stages[(mdir.name, ddir.name)] = secs
    plan = read_json(root / PLAN) if (root / PLAN).exists() else {}
    return StudyData(str(root), labels_file, full, variants, human, plan, stages, include_truncated)


# --------------------------------------------------------------------------- small aggregates


def _judged(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t.label is not None]


def rate(turns: list[Turn], label: str = GENUINE) -> Rate:
    j = _judged(turns)
    return Rate(sum(t.label == label for t in j), len(j))


def greedy(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t.decoding == "greedy"]


def sampled(turns: list[Turn], temperature: float = T_REF) -> list[Turn]:
    return [t for t in turns if t.decoding == "sample" and math.isclose(t.temperature, temperature)]


def accuracy(rd: RunData) -> Rate:
    s = [v for v in rd.scores.values() if v is not None]
    return Rate(int(sum(v >= 1.0 for v in s)), len(s))


def answers_at_cap(runs: list[RunData]) -> Rate:
    stops = [s for r in runs for s in r.answer_stops.values()]
    return Rate(sum(s == "max_tokens" for s in stops), len(stops))


def turns_at_cap(turns: list[Turn]) -> Rate:
    return Rate(sum(t.stop_reason == "max_tokens" for t in turns), len(turns))


def keyed(rd: RunData) -> list[tuple[str, Turn]]:
    """Turns keyed by (dataset|item), so items of two datasets never pair up when a model's runs are pooled."""
    return [(f"{rd.dataset}|{t.item_id}", t) for t in rd.turns]


def per_item(pairs: list[tuple[str, Turn]]) -> dict[str, tuple[int, int]]:
    """item -> (genuine, judged) over the given turns."""
    out: dict[str, list[int]] = {}
    for key, t in pairs:
        if t.label is None:
            continue
        c = out.setdefault(key, [0, 0])
        c[0] += t.label == GENUINE
        c[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _temperatures(data: StudyData, model: str) -> list[float]:
    return sorted({t.temperature for d in data.datasets(model) for t in data.full[(model, d)].turns})
