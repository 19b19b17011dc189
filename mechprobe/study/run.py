"""The paper's studies as one resumable command: every embedded chat model x the shared datasets.

``python experiments/study.py [--quick] [--models ...] [--datasets ...] [--report-only]``. For each
(model, dataset) it runs, each step skipped when already complete on disk:

1. the probe stage (:func:`mechprobe.turns.pipeline.run_probe`): assistant turns, then greedy + ``samples`` user
   turns per temperature of the profile;
2. the perturbations (:func:`mechprobe.turns.pipeline.run_variant`) of the same assistant records: greedy +
   ``variant_samples`` turns at T=1.0 each;
3. the judge (``--judge``, one labels file per judge spec) on the run and every variant;
4. on HH-RLHF and Topical-Chat, the real next human turns, judged by the same judge;

then writes the report (:mod:`mechprobe.study.report`), a pure function of the runs. Models whose
weights are not fetched are skipped and named in the report; a (model, dataset) that fails with a
:class:`UserError` is reported and the rest goes on. Stage seconds go to ``study_stages.jsonl``.

Layout: ``ROOT/<model>/<dataset>/`` (a normal probe run) with ``variants/<variant>/`` inside,
``ROOT/_human/<dataset>/`` and ``ROOT/plan.json``; ROOT is ``runs/study/<profile>`` by default.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mechprobe.errors import UsageError, UserError
from mechprobe.io import JsonlStore, output_dir_lock, read_json, read_jsonl, write_json
from mechprobe.judges.factory import check_judge_spec, make_judge, model_unavailable
from mechprobe.judges.registry import OFFLINE_JUDGE
from mechprobe.judges.run import judge_run
from mechprobe.lm.device import native_bf16_dtype
from mechprobe.lm.models import check_model_source
from mechprobe.records import AssistantRecord, UserTurnRecord
from mechprobe.stages import probe_complete
from mechprobe.study.data import HUMAN_DIR, PLAN, STAGES, T_REF, labels_file_for
from mechprobe.study.report import write_report
from mechprobe.turns.datasets import NAMES, load_dataset
from mechprobe.turns.perturb import VARIANTS, check_variants
from mechprobe.turns.pipeline import (
    ASSISTANT,
    USER_TURNS,
    ProbeConfig,
    decoding_plan,
    load_generator,
    run_probe,
    run_variant,
    variant_dir,
)

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
DATASETS = ("gsm8k", "math500", "ifeval", "mt_bench", "hh_rlhf", "topical_chat")
HUMAN_DATASETS = ("hh_rlhf", "topical_chat")


@dataclass(frozen=True)
class Caps:
    """Token caps (assistant answer, user turn). An answer cut by its cap is a truncation in itself, so
    the caps are set per model from how long its answers run: the Qwen models' GSM8K answers often run
    past 256 tokens (docs/../shared notes), SmolLM2's mostly end before 200."""

    assistant: int
    user: int


CAPS: dict[str, dict[str, Caps]] = {
    "full": {"smollm2-135m-instruct": Caps(256, 48), "qwen2.5-coder-0.5b-instruct": Caps(384, 48),
             "qwen2.5-coder-1.5b-instruct": Caps(512, 48)},
    "quick": {"smollm2-135m-instruct": Caps(128, 32), "qwen2.5-coder-0.5b-instruct": Caps(160, 32),
              "qwen2.5-coder-1.5b-instruct": Caps(192, 32)},
}
DEFAULT_CAPS = {"full": Caps(384, 48), "quick": Caps(160, 32)}


@dataclass(frozen=True)
class Profile:
    """Items per dataset, samples per temperature > 0, the temperatures of the main run, and samples at T=1.0
    per perturbation variant (beside its greedy turn)."""

    name: str
    limit: int
    samples: int
    temperatures: tuple[float, ...]
    variant_samples: int = 2


PROFILES = {
    # 20 items x 6 datasets x (1 + 4x2 main + 5 x (1 + 1) variants) = 19 user turns per item and model. The
    # first full run (5 x (1 + 2) variants, 24 turns) measured ~3.2 h on an idle 2-core CPU, over the 3 h
    # target; one sample per variant cuts a fifth of the turns (docs/study.md: the arithmetic); resumable.
    "full": Profile("full", 20, 2, (0.0, 0.4, 0.7, 1.0, 1.3), variant_samples=1),
    # sized for <= 20 min on the 1.5B model with llama.cpp for two datasets (docs/study.md: the arithmetic)
    "quick": Profile("quick", 4, 2, (0.0, 1.0, 1.3)),
}


@dataclass
class StudyConfig:
    models: list[str] = field(default_factory=lambda: list(MODELS))
    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    profile: str = "full"
    root: str | None = None
    judge: str = OFFLINE_JUDGE  # the fast path; `mechprobe study --judge auto` resolves to BEST_JUDGE where it can
    engine: str = "hf"
    dtype: str | None = None
    limit: int | None = None
    samples: int | None = None
    variant_samples: int | None = None  # None: the profile's (a resumed root keeps what plan.json recorded)
    temperatures: list[float] | None = None
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    max_assistant_tokens: int | None = None
    max_user_tokens: int | None = None
    batch_size: int | None = None  # None = auto (turns.engines.rows_per_call)
    data_path: str | None = None
    report_dir: str = "reports/study"
    figures_dir: str = "figures"
    progress: bool = True
    include_truncated: bool = False  # the report keeps user turns after truncated assistant answers

    def root_dir(self) -> Path:
        return Path(self.root) if self.root else Path("runs") / "study" / self.profile

    def probe_config(self, model: str, dataset: str) -> ProbeConfig:
        prof = PROFILES[self.profile]
        caps = CAPS[self.profile].get(model, DEFAULT_CAPS[self.profile])
        # `is None`, not `or`: an explicit value is never replaced by the profile's (limit 0 = every item).
        def given(v: Any, default: Any) -> Any:
            return default if v is None else v

        return ProbeConfig(model=model, dataset=dataset, data_path=self.data_path, limit=given(self.limit, prof.limit) or None,
                           temperatures=list(given(self.temperatures, prof.temperatures)),
                           samples=given(self.samples, prof.samples),
                           max_assistant_tokens=given(self.max_assistant_tokens, caps.assistant),
                           max_user_tokens=given(self.max_user_tokens, caps.user), batch_size=self.batch_size,
                           dtype=self.dtype, engine=self.engine)

    def variant_plan(self, cfg: ProbeConfig) -> list[tuple[str, float, int]]:
        """Greedy + the variant samples at T=1.0 for every variant (the temperature the claims compare at)."""
        k = self.variant_k()
        return decoding_plan([0.0, T_REF] if k else [0.0], k)

    def variant_k(self) -> int:
        """Samples at T=1.0 per variant: ``--variant-samples``, else the profile's."""
        return self.variant_samples if self.variant_samples is not None else PROFILES[self.profile].variant_samples

    def validate(self) -> None:
        """Refuse every bad option before anything is loaded or written (plan.json included): a bad value saved
        into plan.json would be inherited by every resume of the root."""
        if self.profile not in PROFILES:
            raise UsageError(f"unknown profile {self.profile!r}: use {', '.join(PROFILES)}")

        bad = sorted(set(self.datasets) - set(NAMES))
        if bad:
            raise UsageError(f"unknown dataset(s) {bad}: use any of {', '.join(NAMES)}")
        self.variants = check_variants(self.variants)
        if not self.models or not self.datasets:
            raise UsageError("nothing to do: pass at least one models= and one datasets=")
        if self.limit is not None and self.limit < 0:
            raise UsageError(f"limit={self.limit}: must be >= 0 (items per dataset; 0 = every item)")
        if self.variant_samples is not None and self.variant_samples < 0:
            raise UsageError(f"variant_samples={self.variant_samples}: must be >= 0 (samples at T=1.0 per variant)")
        if self.data_path is not None and not Path(self.data_path).exists():
            raise UsageError(f"data_path={self.data_path} does not exist: pass a folder laid out like shared/data")
        check_judge_spec(self.judge)
        for m in self.models:
            check_model_source(m, "models")
        for m in self.models:
            self.probe_config(m, self.datasets[0]).validate()


def _record_stage(run: Path, stage: str, seconds: float, new_rows: int, cpu_seconds: float | None = None) -> None:
    """One row per command that did work on ``run``: the report sums them per stage.

    ``cpu_seconds`` (process CPU time, all threads) beside the wall seconds: wall time also counts time the process
    was stopped or shared the CPU with other jobs, CPU time does not (on an idle machine with T threads busy,
    wall ~ CPU / T)."""
    store = JsonlStore(run / STAGES, key="id")
    store.append({"id": f"{stage}#{len(store)}", "stage": stage, "seconds": round(seconds, 2), "new_rows": new_rows,
                  **({"cpu_seconds": round(cpu_seconds, 2)} if cpu_seconds is not None else {})})


def _n_rows(path: Path) -> int:
    return len(read_jsonl(path)) if path.exists() else 0


def _update_plan(root: Path, sc: StudyConfig, unavailable: dict[str, str], errors: dict[str, str]) -> None:
    """``plan.json``: what was asked (merged over commands) and what could not run, for the report."""
    old = read_json(root / PLAN) if (root / PLAN).exists() else {}
    plan = {"profile": sc.profile, "root": str(root), "judge": sc.judge, "variant_samples": sc.variant_k(),
            "models": sorted(set(old.get("models", [])) | set(sc.models)),
            "datasets": sorted(set(old.get("datasets", [])) | set(sc.datasets)),
            "variants": sorted(set(old.get("variants", [])) | set(sc.variants)),
            "unavailable": {**{k: v for k, v in old.get("unavailable", {}).items() if k not in sc.models}, **unavailable},
            "errors": {**{k: v for k, v in old.get("errors", {}).items()
                          if k.split("/")[0] not in sc.models or k.split("/")[1] not in sc.datasets}, **errors}}
    write_json(root / PLAN, plan)


class _Generator:
    """The model (and engine) of one model name, loaded on first use and shared by its datasets."""

    def __init__(self, cfg: ProbeConfig):
        self.cfg = cfg
        self.lm: Any = None
        self.engine: Any = None

    def get(self) -> tuple[Any, Any]:
        if self.lm is None:
            t = time.time()
            self.lm, self.engine = load_generator(self.cfg)
            # The thread count is fixed here, at load (device.cpu_threads): print it, so a model loaded while
            # another job ran (1 thread on 2 cores, half speed for the rest of the study) can be seen and restarted.
            print(f"loaded {self.cfg.model} ({self.cfg.engine}) in {time.time() - t:.1f} s, "
                  f"{torch.get_num_threads()} torch threads")
        return self.lm, self.engine


def _probe_done(run: Path, cfg: ProbeConfig) -> bool:
    return probe_complete(run, cfg)


def _variant_done(run: Path, variant: str, plan: list[tuple[str, float, int]]) -> bool:
    out = variant_dir(run, variant)
    n_items = _n_rows(run / ASSISTANT)
    skipped = _n_rows(out / "skipped_rows.jsonl")
    return n_items > 0 and _n_rows(out / ASSISTANT) == n_items and _n_rows(out / USER_TURNS) == (n_items - skipped) * len(plan)


def run_model_dataset(sc: StudyConfig, model: str, dataset: str, gen: _Generator, judge: Any) -> None:
    cfg = sc.probe_config(model, dataset)
    run = sc.root_dir() / model / dataset
    if _probe_done(run, cfg):
        print(f"{model}/{dataset}: probe complete, reused")
    else:
        lm, engine = gen.get()
        n0 = _n_rows(run / USER_TURNS) + _n_rows(run / ASSISTANT)
        t, c = time.time(), time.process_time()
        run_probe(cfg, run, lm=lm, engine=engine, progress=sc.progress)
        _record_stage(run, "probe", time.time() - t, _n_rows(run / USER_TURNS) + _n_rows(run / ASSISTANT) - n0,
                      time.process_time() - c)
    plan = sc.variant_plan(cfg)
    for v in sc.variants:
        if v == "swap" and _n_rows(run / ASSISTANT) < 2:
            continue
        if _variant_done(run, v, plan):
            continue
        lm, engine = gen.get()
        out = variant_dir(run, v)
        n0 = _n_rows(out / USER_TURNS)
        t, c = time.time(), time.process_time()
        run_variant(cfg, run, v, plan, lm=lm, engine=engine, progress=sc.progress)
        _record_stage(run, "variants", time.time() - t, _n_rows(out / USER_TURNS) - n0, time.process_time() - c)
    _judge_dirs(sc, [run, *[variant_dir(run, v) for v in sc.variants if variant_dir(run, v).exists()]], judge, run)


def _judge_dirs(sc: StudyConfig, dirs: list[Path], judge: Any, stage_run: Path) -> None:
    labels = labels_file_for(sc.judge)
    t, c, n = time.time(), time.process_time(), 0
    for d in dirs:
        before = _n_rows(d / labels)
        judge_run(d, judge.get(), labels_file=labels, progress=sc.progress)
        n += _n_rows(d / labels) - before
    if n:
        _record_stage(stage_run, "judge", time.time() - t, n, time.process_time() - c)


class _LazyJudge:
    def __init__(self, spec: str):
        self.spec = spec
        self.j: Any = None

    def get(self) -> Any:
        if self.j is None:
            self.j = make_judge(self.spec)
        return self.j


def human_reference_run(sc: StudyConfig, dataset: str, judge: _LazyJudge) -> Path | None:
    """``ROOT/_human/<dataset>``: the real next human turn after the original reply, as a judgeable run.

    Written as ordinary run files (assistant.jsonl holds the original conversation, user_turns.jsonl the
    human's turn with ``decoding == "human"``) so the judge stage labels it unchanged.
    """

    limit = max(sc.probe_config(m, dataset).limit or 0 for m in sc.models) or None
    items = load_dataset(dataset, path=sc.data_path, limit=limit).items
    run = sc.root_dir() / HUMAN_DIR / dataset
    sa, su = JsonlStore(run / ASSISTANT, key="item_id"), JsonlStore(run / USER_TURNS, key="record_id")
    for it in items:
        reply = it.meta.get("original_assistant") or it.meta.get("original_reply")
        if not reply or not it.reference_next_user or sa.has(it.item_id):
            continue
        sa.append(AssistantRecord(item_id=it.item_id, dataset=dataset, prompt=it.prompt, response=reply,
                                  stop_reason="end_of_turn", n_tokens=0, score=None, extracted=None, gold=None,
                                  messages=it.messages, reference_next_user=it.reference_next_user).to_dict())
        nxt = it.reference_next_user
        su.append(UserTurnRecord(record_id=f"{it.item_id}|human", item_id=it.item_id, dataset=dataset,
                                 decoding="human", temperature=0.0, sample_index=0, seed=None, raw_text=nxt, text=nxt,
                                 stop_reason="end_of_turn", prompt_ids=[], boundary_index=0, assistant_span=(0, 0),
                                 variant="human").to_dict())
    if not len(su):
        return None
    _judge_dirs(sc, [run], judge, run)
    return run


@dataclass
class StudyResult:
    """What a study command wrote (the command line prints it): the README, and which models were unavailable and
    which (model, dataset) failed in this command (empty for ``--report-only``)."""

    readme: Path
    unavailable: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def run_study(sc: StudyConfig) -> StudyResult:
    """Run (or resume) every model x dataset, then write the report."""
    sc.validate()
    root = sc.root_dir()
    with contextlib.ExitStack() as locks:
        locks.enter_context(output_dir_lock(root, "study", "root"))
        if Path(sc.report_dir).resolve() != root.resolve():
            locks.enter_context(output_dir_lock(sc.report_dir, "study report", "report_dir"))
        return _run_study(sc, root)


def _run_study(sc: StudyConfig, root: Path) -> StudyResult:
    """:func:`run_study` once the root and the report directory are locked."""
    judge = _LazyJudge(sc.judge)
    unavailable: dict[str, str] = {}
    errors: dict[str, str] = {}
    _update_plan(root, sc, unavailable, errors)
    for model in tqdm(sc.models, desc="models", disable=not sc.progress):
        why = model_unavailable(model)
        if why:
            print(f"skipping {model}: {why}", file=sys.stderr)
            unavailable[model] = why
            continue
        gen = _Generator(sc.probe_config(model, sc.datasets[0]))
        for dataset in sc.datasets:
            try:
                run_model_dataset(sc, model, dataset, gen, judge)
            except UserError as e:
                print(f"{model}/{dataset}: {e}", file=sys.stderr)
                errors[f"{model}/{dataset}"] = str(e)
        gen.lm = gen.engine = None  # free the model before the next one loads
    for dataset in [d for d in sc.datasets if d in HUMAN_DATASETS]:
        try:
            human_reference_run(sc, dataset, judge)
        except UserError as e:
            errors[f"human/{dataset}"] = str(e)
    _update_plan(root, sc, unavailable, errors)
    ran = [m for m in sc.models if m not in unavailable and any(f"{m}/{d}" not in errors for d in sc.datasets)]
    if not ran:
        try:
            where = _write(sc)  # names why each model was skipped or failed
        except UserError:  # no runs at all: an existing report is kept, not replaced by a list of failures
            where = root / PLAN
        raise StudyFailed(f"every model failed or is unavailable ({', '.join(sc.models)}): nothing was run; see the "
                          f"messages above (also in {where}), fix them and re-run (finished steps are reused)")
    return StudyResult(_write(sc), unavailable, errors)


class StudyFailed(UserError):
    """No model of the study produced a run: the command must not exit 0."""


def report(sc: StudyConfig) -> StudyResult:
    """Rewrite the README and figures from the runs under the study root (``--report-only``), holding the report
    directory's writer lock (the runs are only read)."""
    with output_dir_lock(sc.report_dir, "study report", "report_dir"):
        return StudyResult(_write(sc))


def _write(sc: StudyConfig) -> Path:
    return write_report(sc.root_dir(), labels_file_for(sc.judge), sc.report_dir, sc.figures_dir,
                        include_truncated=sc.include_truncated)


def _floats(xs: list[str]) -> list[float]:
    out = []
    for x in xs:
        out += [float(v) for v in str(x).split(",") if v]
    if any(not math.isfinite(v) for v in out):
        raise UsageError("temperatures must be finite numbers")
    return out


def _names(xs: list[str] | None) -> list[str] | None:
    return None if xs is None else [v for x in xs for v in str(x).split(",") if v]






def config_from_namespace(a: Any) -> StudyConfig:
    """A :class:`StudyConfig` from the study command's parsed flags (any object with those attributes).

    Public because the command line builds the config with it; list flags take spaces or comma strings here.
    """
    return StudyConfig(models=_names(a.models) or list(MODELS), datasets=_names(a.datasets) or list(DATASETS),
                       profile="quick" if a.quick else "full", root=a.root, judge=a.judge or OFFLINE_JUDGE, engine=a.engine,
                       dtype=a.dtype or native_bf16_dtype(), limit=a.limit, samples=a.samples,
                       variant_samples=a.variant_samples,
                       temperatures=_floats(a.temperatures) if a.temperatures else None,
                       variants=_names(a.variants) if a.variants is not None else list(VARIANTS),
                       max_assistant_tokens=a.max_assistant_tokens, max_user_tokens=a.max_user_tokens,
                       batch_size=a.batch_size, data_path=a.data_path, report_dir=a.report_dir,
                       figures_dir=a.figures_dir, progress=not a.no_progress,
                       include_truncated=getattr(a, "include_truncated", False))




def config_dict(sc: StudyConfig) -> dict[str, Any]:
    return asdict(sc)
