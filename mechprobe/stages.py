"""Run resolution and reuse-or-build for every stage, so any experiment script works from a fresh clone.

:func:`resolve_run` turns ``--run``/``--model``/``--dataset`` into a run directory and the *full*
probe config (an existing run keeps its own: data file, limit, system prompt, token caps);
:func:`ensure_stages` then looks at the run directory, keeps what is already there (resuming partial
files) and builds only what is missing. Every experiment script goes through these two, so none of
them can quietly rebuild a run with another config. The model is loaded at most once and only when a
stage needs it.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from mechprobe.activations.cache import cache_run
from mechprobe.errors import MissingInput, UserError
from mechprobe.io import read_json, read_jsonl
from mechprobe.judges.base import JudgeMismatch
from mechprobe.judges.factory import (
    judges_model,
    labelled_by,
    make_judge,
    resolve_judge_spec,
    shared_judge_model,
)
from mechprobe.judges.hybrid import HybridJudge
from mechprobe.judges.registry import AUTO, OFFLINE_JUDGE
from mechprobe.judges.run import judge_run
from mechprobe.lm.choice import ChoiceScorer
from mechprobe.lm.device import native_bf16_dtype
from mechprobe.lm.generation import free_memory_bytes, kv_bytes_per_token
from mechprobe.lm.llamacpp import resolve_gguf
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.lm.registry import DEFAULT_MODEL
from mechprobe.splits import STEERING_SPLIT
from mechprobe.turns.datasets import find_data_dir, load_dataset
from mechprobe.turns.pipeline import (
    ASSISTANT,
    SKIPPED,
    USER_TURNS,
    ProbeConfig,
    decoding_plan,
    default_run_dir,
    run_probe,
)


def default_dataset() -> str:
    """GSM8K when the shared data folder is reachable, else the bundled prompts (offline machines)."""
    try:
        return "gsm8k" if find_data_dir() is not None else "builtin"
    except (ImportError, FileNotFoundError):
        return "builtin"


# The main job's probe configuration: enough sampled turns for some positives at T=1.0, small enough
# to finish in minutes on a 2-core CPU with the embedded 135M model.
MAIN_JOB = dict(limit=60, temperatures=[0.0, 1.0], samples=4, max_assistant_tokens=192, max_user_tokens=48,
                batch_size=16)


# judge_run's own keywords; the others given to Stages.labels build the judge (make_judge)
JUDGE_RUN_OPTS = frozenset({"labels_file", "retry_errors", "limit", "progress", "include_truncated"})


def pool_bytes_for(run: Path, model: Any, share: float = 0.25) -> int:
    """Bytes of KV that keep every distinct conversation prompt of ``run`` (its user turns' ``prompt_ids``), capped
    at ``share`` of the memory free now on the model's device: what a judge's pool needs so the cache stage finds
    each one again."""
    seen = {tuple(r["prompt_ids"]) for r in read_jsonl(run / USER_TURNS, key="record_id")}
    need = sum(len(p) for p in seen) * kv_bytes_per_token(model)
    return int(min(need, share * free_memory_bytes(next(model.parameters()).device)))


@dataclass
class Stages:
    """The run directory and a lazily loaded model shared by the stages."""

    run_dir: Path
    cfg: ProbeConfig
    lm: LoadedModel | None = None
    timings: dict[str, float] = field(default_factory=dict)
    prefixes: ChoiceScorer | None = None  # the judge's kept conversations, read by the cache stage

    def model(self) -> LoadedModel:
        if self.lm is None:
            self.lm = load_model(self.cfg.model, device=self.cfg.device, dtype=self.cfg.dtype,
                                 chat_template=self.cfg.chat_template)
        return self.lm

    def _timed(self, name: str, fn: Any) -> Any:
        t = time.time()
        out = fn()
        self.timings[name] = round(time.time() - t, 1)
        return out

    def probe(self) -> Path:
        """Generate (or finish generating) assistant and user turns.

        With ``cfg.engine`` other than ``hf`` (llama.cpp on CPU, vLLM on GPU) the probe stage loads its own
        generator; the hookable HF model is loaded only when a later stage (cache, steering) needs it.
        """
        if self.cfg.engine != "hf":
            return self._timed("probe", lambda: run_probe(self.cfg, self.run_dir))
        return self._timed("probe", lambda: run_probe(self.cfg, self.run_dir, lm=self.model()))

    def labels(self, judge: str = OFFLINE_JUDGE, **opts: Any) -> Any:
        """Judge the run's turns; a model-based judge of the run's own model reuses the loaded weights.

        Why the model may load here: after a llama.cpp (or vLLM) probe stage no HF model is held yet, and a
        ``hybrid-voice:`` judge of the run's own model would load the weights for itself, and the cache stage load
        them again after it. When the cache is still to be built, the stage model is loaded first and lent to the
        judge, so they load once (the judge's dtype permitting: :func:`shared_judge_model`). The judge then also
        keeps every conversation it prefilled (its KV pool, sized here for the run within a quarter of the free
        memory) and :meth:`cache` reads the boundary states from them instead of prefilling each conversation
        again."""
        pending = not cache_complete(self.run_dir)
        if (self.lm is None and isinstance(judge, str) and judges_model(judge) == str(self.cfg.model)
                and pending):
            self.model()
        shared = shared_judge_model(judge, self.lm) if isinstance(judge, str) else None
        if shared is None:
            return self._timed("judge", lambda: judge_run(self.run_dir, judge=judge, **opts))
        built = make_judge(judge, loaded=shared, **{k: v for k, v in opts.items() if k not in JUDGE_RUN_OPTS})
        # the hybrid judges prefill each conversation exactly as the cache stage would (conversation + user header)
        if pending and isinstance(built, HybridJudge) and built.store.pool_bytes > 0:
            built.store.pool_bytes = max(built.store.pool_bytes, pool_bytes_for(self.run_dir, shared.model))
            self.prefixes = built.store
        return self._timed("judge", lambda: judge_run(self.run_dir, judge=built,
                                                      **{k: v for k, v in opts.items() if k in JUDGE_RUN_OPTS}))

    def cache(self, backend: str = "hooks", positions: tuple[str, ...] = ("boundary",), **opts: Any) -> Path:
        """Cache the boundary activations, from the judge's kept conversations where :meth:`labels` left them."""
        try:
            return self._timed("cache", lambda: cache_run(self.run_dir, model=self.model(), backend=backend,
                                                          positions=positions, prefixes=self.prefixes, **opts))
        finally:
            if self.prefixes is not None:  # their memory is not needed after this stage
                self.prefixes.clear_pool()
                self.prefixes = None

    def all(self, judge: str = OFFLINE_JUDGE, backend: str = "hooks") -> Stages:
        self.probe()
        self.labels(judge)
        self.cache(backend)
        return self


# What `linear_probe.py` / `steer.py --model M` use for a *new* run of a model other than the embedded default:
# the settings of the documented 1.5B findings, not the main job's smoke-sized ones. Why these numbers: 200
# items put the item-bootstrap CI of a Spearman rho near 0.25 at about +-0.13 (1.5B GSM8K: 0.247 [0.110, 0.364]),
# where 60 items gave +-0.25; 8 samples at T=1 are the fewest that make the per-item follow-up propensity a
# target (its split-half ceiling needs two halves of 4); assistant cap 512: <= 5% of 1.5B GSM8K answers reach it (reports/answer_length/); 192 cut 94% of them.
FINDING = dict(limit=200, temperatures=[0.0, 1.0], samples=8, max_assistant_tokens=512, max_user_tokens=40,
               batch_size=None)  # None: rows per decode call from free memory (HF); llama.cpp decodes 32 rows


def finding_engine(model: str) -> dict[str, str]:
    """Generation engine (and dtype) for a finding-sized run of ``model`` on this machine.

    llama.cpp when it is installed, no GPU is visible and ``model`` is a GGUF (embedded name or .gguf file): the
    engine of the documented 1.5B findings (docs/findings_appendix.md; their turns came partly from an older sampler, so
    not token for token), at half the memory of bf16 HF (benchmarks/README.md: 2.7 vs 5.2 GB peak, 1.5B). It is
    not the fastest there: bf16 HF with automatic batches decoded 39 vs 24 tok/s in bench_speed.py (8 items), so
    pass ``--engine hf --dtype bfloat16`` for speed. Else HF, in bf16 on CPUs with native bf16 matmuls.
    """
    if not torch.cuda.is_available() and importlib.util.find_spec("llama_cpp") is not None:
        try:
            resolve_gguf(model)
            return {"engine": "llamacpp"}
        except UserError:
            pass
    dtype = native_bf16_dtype()
    return {"engine": "hf", **({"dtype": dtype} if dtype else {})}


def finding_preset(model: str | None) -> dict[str, Any] | None:
    """:data:`FINDING` plus :func:`finding_engine` for ``--model`` other than the embedded default, else None
    (the main job's settings). Applied only to a run that does not exist yet: an existing run keeps its own."""
    if model is None or model == DEFAULT_MODEL:
        return None
    return {**FINDING, **finding_engine(model)}


def finding_split(model: str | None, dataset: str | None) -> str | None:
    """The committed held-out split (:data:`mechprobe.splits.STEERING_SPLIT`) the steering experiment uses for
    ``--model`` other than the embedded default on its dataset (GSM8K), else None (the hash split)."""
    if finding_preset(model) is None or dataset != "gsm8k":
        return None
    return str(STEERING_SPLIT)


def share_items(total: int, sizes: list[int]) -> list[int]:
    """Split ``total`` items over datasets of ``sizes`` rows as evenly as the sizes allow.

    A dataset smaller than its even share gives all its rows and passes the rest on: 200 over GSM8K (1319)
    and MT-Bench (80) is 120 + 80, so the pooled probe gets the 200 items it was sized for.
    """
    out = [0] * len(sizes)
    left = total
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for k, i in enumerate(order):
        out[i] = min(sizes[i], left // (len(order) - k))
        left -= out[i]
    return out


def finding_presets(preset: dict[str, Any], datasets: list[str], limit: int | None) -> list[dict[str, Any]]:
    """One preset per dataset: with several datasets and no ``--limit``, the preset's items split over them
    (:func:`share_items`, dataset sizes read from the local files or the hub)."""
    if len(datasets) < 2 or limit is not None:
        return [preset] * max(1, len(datasets))

    sizes = [len(load_dataset(ds).items) for ds in datasets]
    return [{**preset, "limit": n} for n in share_items(preset["limit"], sizes)]


def auto_judge(run: Path, model: str) -> str:
    """The judge ``--judge auto`` means for ``run`` (:func:`mechprobe.judges.factory.default_judge`, given the
    judge that wrote the run's labels, if any)."""
    return resolve_judge_spec(AUTO, model, labelled_by(run))


def probe_config(model: str, dataset: str | None, preset: dict[str, Any] | None = None,
                 **overrides: Any) -> ProbeConfig:
    """The main job's config (or ``preset``'s) for ``model``/``dataset`` with explicit overrides (None ignored)."""
    kw = dict(preset if preset is not None else MAIN_JOB)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ProbeConfig(model=model, dataset=dataset or default_dataset(), **kw)


# Probe-stage options a user may pass through; None means "the run's own value / the main job's default".
PASSTHROUGH = ("limit", "samples", "temperatures", "max_assistant_tokens", "max_user_tokens", "batch_size", "engine",
               "dtype")


def run_config(run: Path) -> ProbeConfig | None:
    """The full probe config an existing run was made with (None when ``run`` has no manifest).

    Manifests written before the full config was recorded hold only the identity part; their
    ``limit`` is the item count of the last command and ``data_path`` is unknown (the data-source
    hash in the identity still refuses a different file).
    """
    man = run / "manifest.json"
    if not man.exists():
        return None
    m = read_json(man)
    names = {f.name for f in fields(ProbeConfig)}
    if "config" in m:
        return ProbeConfig(**{k: v for k, v in m["config"].items() if k in names})
    kw = {k: v for k, v in m["identity"]["config"].items() if k in names}
    return ProbeConfig(**{**kw, "limit": m.get("data", {}).get("n_items")})


def resolve_run(run: str | Path | None, model: str | None = None, dataset: str | None = None,
                preset: dict[str, Any] | None = None, new: bool = True, **overrides: Any) -> tuple[Path, ProbeConfig]:
    """Run dir and full config. An existing run keeps its own config; explicit ``overrides`` (keys of
    :data:`PASSTHROUGH`, None = not given) replace single values, and the probe stage then refuses a
    change that would mix configurations. A new run starts from ``preset`` (e.g. :func:`finding_preset`),
    else the main job's settings. Raises :class:`UserError` for invalid values, before any work.

    ``new=False``: an explicitly given ``run`` must already be a run (have a ``manifest.json``), so a mistyped
    path is refused in one line instead of starting a full build there; the default run (``run`` None) may
    always be built. A ``limit`` below the items an existing run already holds is refused too: its analysis
    would use every item while claiming the smaller count.
    """
    over = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(over) - set(PASSTHROUGH))
    if unknown:
        raise TypeError(f"resolve_run: unknown overrides {unknown}")
    every_item = over.get("limit") == 0  # the command line's --limit 0: no limit, as on every command
    if every_item:
        over.pop("limit")
    cfg = probe_config(model or DEFAULT_MODEL, dataset, preset=preset, **over)
    if every_item:
        cfg.limit = None
    path = Path(run) if run else default_run_dir(cfg)
    own = run_config(path)
    if own is None and run is not None and not new:
        raise MissingInput(f"{path} is not a run (no manifest.json there): check the path, or pass new=True to build "
                           "a new run in it")
    if own is not None:
        if "limit" in over and (own.limit is None or over["limit"] < own.limit):
            raise UserError(f"{path} already holds {own.limit or 'every'} items and every stage uses all of them, so "
                            f"limit={over['limit']} would not apply: drop limit=, or build a smaller run with "
                            "another run= and new=True")
        if dataset is not None and dataset != own.dataset:
            raise UserError(f"{path} is a run of dataset {own.dataset!r}, not {dataset!r}: drop dataset=, or "
                            f"pass another run=")
        kw = {f.name: getattr(own, f.name) for f in fields(ProbeConfig)}
        kw.update(over)
        if every_item:
            kw["limit"] = None
        if model:
            kw["model"] = model
        cfg = ProbeConfig(**kw)
    cfg.validate()
    return path, cfg


def _skipped(run: Path, stage: str) -> int:
    return sum(r.get("stage") == stage for r in read_jsonl(run / SKIPPED, key="item_id"))


def probe_complete(run: Path, cfg: ProbeConfig) -> bool:
    """All turns ``cfg`` asks for are on disk (so the model need not even be loaded); rows skipped as
    too long for the context count as done."""
    man = run / "manifest.json"
    if not man.exists():
        return False
    m = read_json(man)
    if m["identity"]["config"] != cfg.identity():
        return False
    # The last command loaded data.n_items rows; when it asked for this limit, that is what "all" means
    # (a limit above the dataset's size would otherwise never count as complete).
    loaded = m.get("data", {}).get("n_items")
    same_limit = cfg.limit is None or m.get("config", {}).get("limit") == cfg.limit
    want = (loaded if same_limit and loaded else cfg.limit) or 0
    n_items = len(read_jsonl(run / ASSISTANT, key="item_id"))
    n_turns = len(read_jsonl(run / USER_TURNS, key="record_id"))
    n_plan = len(decoding_plan(cfg.temperatures, cfg.samples))
    return (want > 0 and n_items + _skipped(run, "assistant") >= want
            and n_turns == (n_items - _skipped(run, "user")) * n_plan)


def cache_complete(run: Path) -> bool:
    """Every user turn of the run has cached activations, in order."""
    man = run / "activations" / "manifest.json"
    if not man.exists():
        return False
    meta = read_json(man)
    ids = [r["record_id"] for r in read_jsonl(run / USER_TURNS, key="record_id")]
    return meta.get("n_done") == len(ids) and meta.get("record_ids") == ids


def move_labels_aside(run: Path) -> None:
    """Keep the old judge's labels as ``labels.<judge>.jsonl`` (never delete a user's labels)."""
    old = run / "labels.jsonl"
    if old.exists():
        rows = read_jsonl(old)
        name = (rows[0].get("judge", "old") if rows else "old").replace("/", "_").replace(":", "_")
        dest = run / f"labels.{name}.jsonl"
        old.replace(dest)
        print(f"moved {old} aside to {dest}")


def ensure_stages(run: Path, cfg: ProbeConfig, judge: str, backend: str = "hooks", relabel: bool = False,
                  stages: Stages | None = None, include_truncated: bool = False) -> tuple[dict[str, float], str]:
    """probe -> judge -> cache, each reused when already complete. Returns (seconds per stage, judge name).

    Pass ``stages`` to keep its model loaded for later use (it is loaded only if a stage needs it).
    ``include_truncated``: the judge summary's rates keep the user turns after truncated answers."""

    st = stages if stages is not None else Stages(run, cfg)
    if judge == "auto":
        judge = auto_judge(run, cfg.model)
        print(f"judge: {judge} (judge=auto; pass judge= to choose)")
    print(f"run: {run}  (model {cfg.model}, dataset {cfg.dataset}, {cfg.limit} items, temperatures "
          f"{cfg.temperatures}, {cfg.samples} samples)")
    if probe_complete(run, cfg):
        print("probe: reusing complete turns")
        st.timings["probe"] = 0.0
    else:
        st.probe()
    if relabel:
        move_labels_aside(run)
    try:
        summary = st.labels(judge, include_truncated=include_truncated)
    except JudgeMismatch as e:
        raise UserError(f"{e}. Or pass relabel=True to move the old labels aside and relabel.") from e
    print(summary.table())
    if summary.n_records and not summary.n_labelled:
        raise UserError(f"every one of the {summary.n_records} user turns of {run} is a judge error or unlabelled "
                        f"({summary.errors or 'no verdicts'}); nothing can be analysed. Fix the judge (endpoint, "
                        f"key, model) and re-run: error rows are retried")
    if cache_complete(run):
        print("cache: reusing complete activations")
        st.timings["cache"] = 0.0
    else:
        st.cache(backend=backend)
    return st.timings, summary.judge


def ensure_transfer_runs(transfer_runs: list[str], transfer_datasets: list[str], run: Path, cfg: ProbeConfig,
                         judge: str, backend: str = "hooks", relabel: bool = False,
                         include_truncated: bool = False) -> list[Path]:
    """The runs a transfer matrix tests on, each with every stage built: existing ``transfer_runs`` (judged and
    cached where they lack it), then one run per ``transfer_datasets`` entry beside ``run`` with ``cfg``'s model
    and settings (``<parent>/<model>-<dataset>``), so their labels mean the same thing.

    Why here: the row-level and the item-level probes both evaluate train-on-A / test-on-B on the same runs.
    """
    runs = [Path(r) for r in transfer_runs]
    for r in runs:
        run_t, cfg_t = resolve_run(r, new=False)  # existing runs only
        ensure_stages(run_t, cfg_t, judge, backend, relabel, include_truncated=include_truncated)
    for ds in transfer_datasets:
        cfg_b = replace(cfg, dataset=ds, data_path=None)
        run_b = run.parent / default_run_dir(cfg_b).name
        ensure_stages(run_b, cfg_b, judge, backend, relabel, include_truncated=include_truncated)
        runs.append(run_b)
    return runs
