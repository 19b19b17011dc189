"""The probe stage: dataset rows -> assistant turns -> user turns, written to a run directory.

``RUN/assistant.jsonl`` holds one :class:`AssistantRecord` per item and ``RUN/user_turns.jsonl`` one
:class:`UserTurnRecord` per generated user turn (greedy, plus ``samples`` per temperature > 0). Both are
appended row by row, so a killed run resumes where it stopped; ``RUN/manifest.json`` pins the model,
tokenizer, template, generation config and data source (a hash of the data file), and a mismatching
command is refused rather than mixed in. Everything is validated before the first byte is written, so a
rejected command leaves nothing behind that would make the corrected one look like a mismatch.

Rows whose prompt plus token budget does not fit the model's context are skipped, per row, and
listed with the reason in ``RUN/skipped_rows.jsonl`` (and counted in the manifest): see
docs/gotchas.md for why skip and not truncate.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import (
    JsonlStore,
    check_manifest,
    check_or_write_manifest,
    check_writable_dir,
    read_json,
    read_jsonl,
    read_run_manifest,
    writer_lock,
)
from mechprobe.lm import chat
from mechprobe.lm.generation import batches_by_length, decode
from mechprobe.lm.kv import reuse_problem
from mechprobe.lm.models import LoadedModel
from mechprobe.lm.prefix import PrefixStore
from mechprobe.records import AssistantRecord, Item, UserTurnRecord, make_record_id
from mechprobe.turns.config import ENGINES, ProbeConfig, default_run_dir
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.engines import context_length, decode_rows, load_generator, rows_per_call
from mechprobe.turns.perturb import check_variants, variant_prompt, variant_records
from mechprobe.turns.run_files import ASSISTANT, SKIPPED, USER_TURNS, load_run, summarize_run
from mechprobe.turns.scoring import score

# The config, engine and run-file names are re-exported: callers and tests use them as ``pipeline.X``.
__all__ = ["ASSISTANT", "ENGINES", "SKIPPED", "USER_TURNS", "VARIANTS_DIR", "ProbeConfig", "assistant_answers",
           "context_length", "decoding_plan", "default_run_dir", "load_generator", "load_items", "load_run",
           "row_seed", "run_probe", "run_variant", "summarize_run", "variant_dir"]

log = logging.getLogger(__name__)

def row_seed(base_seed: int, record_id: str) -> int:
    """A per-row seed derived from the record id, so any row can be regenerated alone."""
    h = hashlib.sha256(f"{base_seed}:{record_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def decoding_plan(temperatures: list[float], samples: int) -> list[tuple[str, float, int]]:
    """(decoding, temperature, sample_index) for each user turn of one item."""
    plan: list[tuple[str, float, int]] = []
    for t in temperatures:
        if not math.isfinite(t) or t < 0:  # NaN passes `t < 0` and `t == 0`: it would become a "sample"
            raise UsageError(f"temperature {t} must be a finite number >= 0; use 0 for greedy")
        if t == 0:
            plan.append(("greedy", 0.0, 0))
        else:
            plan.extend(("sample", float(t), k) for k in range(samples))
    if not plan:
        raise UsageError("no decodings requested: pass temperatures=0 (greedy) and/or values > 0 with "
                        "samples= >= 1")
    return plan


def load_items(cfg: ProbeConfig) -> tuple[list[Item], dict[str, Any]]:
    res = load_dataset(cfg.dataset, path=cfg.data_path, limit=cfg.limit)
    info = {
        "dataset_source": res.source,
        "fingerprint": res.fingerprint,
        "n_items": len(res.items),
        "n_malformed_rows": len(res.skipped),
        "malformed_rows": [asdict(s) if hasattr(s, "__dataclass_fields__") else s for s in res.skipped[:50]],
    }
    return res.items, info


def _score(item: Item, response: str) -> tuple[float | None, str | None]:
    return score(item.dataset, response, item.gold, item.meta)


def _check_items_match_run(out: Path, items: list[Item]) -> None:
    """Refuse items whose id is in the run with another prompt: ids are row positions, so a second file
    with the same dataset name would otherwise pair its rows with the first file's turns."""
    have = {r["item_id"]: r for r in read_jsonl(out / ASSISTANT, key="item_id")}
    for it in items:
        r = have.get(it.item_id)
        if r is not None and (r["prompt"] != it.prompt or (r.get("messages") or []) != (it.messages or [])):
            raise UserError(f"{out / ASSISTANT} has item {it.item_id!r} with a different prompt than the data "
                            f"now loaded ({r['prompt'][:60]!r} vs {it.prompt[:60]!r}): the run was made from "
                            f"other data. Use a new run directory (out=), or the run's own data_path=")


def _merged_limit(out: Path, limit: int | None) -> int | None:
    """The largest ``limit`` any command asked of this run (None = every row), so the manifest's
    config reproduces the whole run and a later ``--run`` resolution does not shrink or grow it."""
    man = out / "manifest.json"
    if not man.exists():
        return limit
    old = read_json(man).get("config", {}).get("limit", -1)
    if old is None or limit is None:
        return None
    return max(old, limit)


def run_probe(cfg: ProbeConfig, out: str | Path, lm: LoadedModel | None = None,
              progress: bool = True, items: list[Item] | None = None, engine: Any = None,
              continue_from_answer: bool = True) -> Path:
    """Build or extend the probe run in ``out``. Safe to re-run after a crash: done rows are skipped.

    With the HF engine, each batch of answers is followed at once by its user turns, which continue from the
    answers' KV cache (``continue_from_answer``): only the end of the assistant turn and the user-role header
    are prefilled, not the query and the answer again. Answers that already existed (a resumed run) get
    their user turns from a plain prefill.

    ``items`` bypasses the dataset loader (your own prompts from a notebook); ``cfg.dataset`` then
    only names them. Nothing is written to ``out`` until the config, the data, the model and its
    template have all been checked. ``lm`` and ``engine`` (from :func:`load_generator`) let a caller
    that probes several datasets load the model once.

    Args:
        cfg: the :class:`ProbeConfig` (validated first).
        out: the run directory (created); an existing run with another identity is refused.
        lm: a loaded :class:`~mechprobe.lm.models.LoadedModel` to reuse; None (default) loads ``cfg.model``.
        progress: show tqdm progress bars (default True).
        items: your own :class:`~mechprobe.records.Item` list instead of the dataset loader; None (default).
        engine: the generation engine from :func:`load_generator` (vLLM/llama.cpp); None (default) with
            ``lm=None`` loads it, with an ``lm`` given means the HF path.
        continue_from_answer: user turns continue from the answer batch's KV cache (HF engine; default True).
            Same turns up to floating-point rounding (fp32: tested token for token; bf16: docs/cpu_speed.md).

    Returns:
        ``out`` as a :class:`~pathlib.Path`, now holding ``assistant.jsonl``, ``user_turns.jsonl``,
        ``manifest.json`` and ``skipped_rows.jsonl`` (rows too long for the context).

    Raises:
        UserError: an invalid config, no items, a template that cannot host the probe, or a run in ``out``
            made with another model, template, config or data.

    Example:
        >>> from mechprobe import ProbeConfig, load_run, run_probe
        >>> cfg = ProbeConfig(model="smollm2-135m-instruct", dataset="gsm8k", limit=20)   # doctest: +SKIP
        >>> run = run_probe(cfg, "runs/smol-gsm8k")                                     # doctest: +SKIP
        >>> answers, turns = load_run(run)                                              # doctest: +SKIP
    """
    out = Path(out)
    cfg.validate()
    check_writable_dir(out, "out")  # a file, a symlink loop or a read-only place: refused before the model loads
    plan = decoding_plan(cfg.temperatures, cfg.samples)
    if items is None:
        items, data_info = load_items(cfg)
    else:
        # No file to hash, and a notebook may pass a growing list: the per-item check below guards these.
        data_info = {"dataset_source": "items passed to run_probe", "fingerprint": "items passed to run_probe",
                     "n_items": len(items), "n_malformed_rows": 0}
    if not items:
        raise UsageError(f"dataset {cfg.dataset!r} gave no items (limit={cfg.limit}); nothing to probe")
    if cfg.engine not in ENGINES:
        raise UsageError(f"unknown engine {cfg.engine!r}: use {', '.join(ENGINES)}")
    read_run_manifest(out)  # a cut-off manifest or another kind of directory is refused before the model loads
    if lm is None:
        lm, engine = load_generator(cfg)
    tok = lm.tokenizer
    # Fail before any generation when the template cannot host the probe (base models).
    chat.user_header(tok)
    a_jobs = _assistant_jobs(cfg, lm, items, out)
    identity = {**lm.identity(), "config": cfg.identity(), "data_source": data_info["fingerprint"]}
    check_manifest(out, identity)  # read-only: refuse a mismatch naming the key before anything is written
    _check_items_match_run(out, items)
    full_cfg = {**asdict(cfg), "limit": _merged_limit(out, cfg.limit),
                "data_path": str(Path(cfg.data_path).resolve()) if cfg.data_path else None}
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as locks:
        for name in (ASSISTANT, USER_TURNS):
            locks.enter_context(writer_lock(out / name))
        check_or_write_manifest(out, identity, {"stage": "probe", "data": data_info, "config": full_cfg,
                                                "user_header": chat.user_header(tok)})
        t0 = time.time()
        skipped = JsonlStore(out / SKIPPED, key="item_id")
        n_skip0 = len(skipped)
        turns = _TurnsAfterAnswers(cfg, lm, plan, out, progress, engine, skipped,
                                   _answer_store(lm, engine) if continue_from_answer else None)
        n_a = _assistant_stage(cfg, lm, a_jobs, out, progress, engine, skipped, after_batch=turns)
        t_u = time.time()
        n_u = turns.rows + _user_stage(cfg, lm, {it.item_id for it in items}, plan, out, progress, engine, skipped)
        timing = _add_timing(read_json(out / "manifest.json").get("timing"),
                             assistant_seconds=t_u - t0 - turns.seconds, assistant_rows=n_a,
                             user_seconds=time.time() - t_u + turns.seconds, user_rows=n_u)
        n_skip = len(skipped)
        if n_skip > n_skip0:
            log.warning("%d row(s) skipped as too long for the model's context; see %s", n_skip - n_skip0,
                        out / SKIPPED)
        check_or_write_manifest(out, identity, {"last_run": {"new_assistant_rows": n_a, "new_user_rows": n_u,
                                                             "new_skipped_rows": n_skip - n_skip0,
                                                             "seconds": round(time.time() - t0, 1)},
                                                "skipped_rows": {"file": SKIPPED, "n": n_skip},
                                                "timing": timing})
    return out


def _answer_store(lm: LoadedModel, engine: Any) -> PrefixStore | None:
    """A store for one answer batch's KV cache (HF engine only: the others keep their caches to themselves)."""
    if engine is not None or lm.model is None or reuse_problem(lm.model):
        return None
    return PrefixStore(lm, progress=False)


class _TurnsAfterAnswers:
    """Called after each answer batch: that batch's user turns, continued from the answers' KV cache.

    The store holds one batch's answers at a time (what the batch's own decoding held, so memory stays within
    the automatic batch's budget) and is cleared after their turns; ``rows`` and ``seconds`` are what it added.
    """

    def __init__(self, cfg: ProbeConfig, lm: LoadedModel, plan: list[tuple[str, float, int]], out: Path,
                 progress: bool, engine: Any, skipped: JsonlStore, store: PrefixStore | None) -> None:
        self.cfg, self.lm, self.plan, self.out, self.progress, self.engine = cfg, lm, plan, out, progress, engine
        self.skipped, self.store = skipped, store
        self.rows, self.seconds = 0, 0.0

    def __call__(self, item_ids: set[str]) -> None:
        if self.store is None:
            return
        t = time.time()
        try:
            self.rows += _user_stage(self.cfg, self.lm, item_ids, self.plan, self.out, self.progress, self.engine,
                                     self.skipped, prefix_store=self.store)
        finally:
            self.store.clear()
        self.seconds += time.time() - t


def _add_timing(old: dict[str, Any] | None, **new: float) -> dict[str, Any]:
    """Cumulative seconds and row counts over every command that added rows to the run.

    Kept so a later analysis can say what generating one user turn cost (the propensity probe compares
    it with one forward pass to the boundary); a resumed run adds its share rather than overwriting.
    """
    out = dict(old or {})
    for k, v in new.items():
        out[k] = round(out.get(k, 0) + v, 3) if k.endswith("seconds") else int(out.get(k, 0) + v)
    return out


def _too_long(skipped: JsonlStore, item_id: str, stage: str, n_prompt: int, max_new: int,
              ctx: int | None) -> bool:
    """True (and recorded once in ``skipped_rows.jsonl``) when prompt + token budget exceed the context.

    Skip, not truncate: cutting the conversation would change what the user turn responds to, and the
    boundary state would no longer be the one of the real conversation.
    """
    if ctx is None or n_prompt + max_new <= ctx:
        return False
    if not skipped.has(item_id):
        reason = (f"{stage} prompt has {n_prompt} tokens + {max_new} new tokens > the model's context of {ctx}")
        log.warning("skipping item %s: %s", item_id, reason)
        skipped.append({"item_id": item_id, "stage": stage, "reason": "too_long_for_context", "detail": reason,
                        "prompt_tokens": n_prompt, "max_new_tokens": max_new, "context": ctx})
    return True


def _assistant_jobs(cfg: ProbeConfig, lm: LoadedModel, items: list[Item], out: Path
                    ) -> list[tuple[Item, list[int]]]:
    """Items still missing an assistant turn, with their prompts (built before anything is written,
    so a template that cannot render a row fails the command cleanly)."""
    done = {r["item_id"] for r in read_jsonl(out / ASSISTANT, key="item_id")}
    tok = lm.tokenizer
    return [(it, chat.build_assistant_prompt(tok, it.prompt, system=cfg.system, history=it.messages or None))
            for it in items if it.item_id not in done]


def _assistant_stage(cfg: ProbeConfig, lm: LoadedModel, jobs: list[tuple[Item, list[int]]], out: Path,
                     progress: bool, engine: Any, skipped: JsonlStore,
                     after_batch: _TurnsAfterAnswers | None = None) -> int:
    """Greedy answers of ``jobs``, appended to ``out/assistant.jsonl``; ``after_batch`` (the user turns that
    continue from the answers) runs after each batch, its answers' KV cache in its store."""
    tok = lm.tokenizer
    store = JsonlStore(out / ASSISTANT, key="item_id")
    ctx = context_length(lm)
    todo = [(it, p) for it, p in jobs if not store.has(it.item_id)
            and not _too_long(skipped, it.item_id, "assistant", len(p), cfg.max_assistant_tokens, ctx)]
    if not todo:
        return 0
    prompts = [p for _, p in todo]
    stops = chat.assistant_stop_token_ids(tok, lm.model)
    bar = tqdm(total=len(todo), desc="assistant turns", disable=not progress, unit="item")
    rows = rows_per_call(cfg, engine, lm, max(len(p) for p in prompts), cfg.max_assistant_tokens)
    for batch in batches_by_length([len(p) for p in prompts], rows):
        gens = decode_rows(lm, engine, [prompts[i] for i in batch], stop_ids=stops,
                             max_new_tokens=cfg.max_assistant_tokens, temperatures=0.0, pad_id=tok.pad_token_id,
                             kv_store=after_batch.store if after_batch is not None else None)
        for i, g in zip(batch, gens):
            it = todo[i][0]
            _, text = decode(tok, g)
            sc, extracted = _score(it, text)
            rec = AssistantRecord(item_id=it.item_id, dataset=it.dataset, prompt=it.prompt, response=text,
                                  stop_reason=g.stop_reason, n_tokens=len(g.token_ids), score=sc,
                                  extracted=extracted, gold=it.gold, messages=it.messages,
                                  reference_next_user=it.reference_next_user)
            store.append(rec.to_dict())
            bar.update(1)
        bar.refresh()  # tqdm throttles redraws: without this the bar shows the batch's first item until the next one
        if after_batch is not None:
            after_batch({todo[i][0].item_id for i in batch})
    bar.close()
    return len(todo)


def assistant_answers(cfg: ProbeConfig, lm: LoadedModel, items: list[Item], out: str | Path,
                      progress: bool = True, engine: Any = None) -> list[AssistantRecord]:
    """Greedy assistant answers of ``items`` under ``cfg`` (system prompt, token cap), resumably in
    ``out/assistant.jsonl``; for items a caller needs outside a run's own (fixed held-out splits)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with writer_lock(out / ASSISTANT):
        _assistant_stage(cfg, lm, _assistant_jobs(cfg, lm, items, out), out, progress, engine,
                         JsonlStore(out / SKIPPED, key="item_id"))
    want = {it.item_id for it in items}
    return [AssistantRecord.from_dict(r) for r in read_jsonl(out / ASSISTANT, key="item_id") if r["item_id"] in want]


def _user_stage(cfg: ProbeConfig, lm: LoadedModel, wanted: set[str], plan: list[tuple[str, float, int]],
                out: Path, progress: bool, engine: Any, skipped: JsonlStore, *,
                prompt_for: Callable[[AssistantRecord], chat.ProbePrompt] | None = None,
                variant: str = "full", prefix_store: PrefixStore | None = None) -> int:
    """User turns for the assistant records in ``out`` whose item is in ``wanted``.

    ``prompt_for`` builds the probe prompt of a record (default: conversation + user header); the
    study's perturbations pass their own and tag rows with ``variant`` (also part of the record id).
    ``prefix_store``: prompts continue from the longest prefix stored there (the answers' KV cache).
    """
    tok = lm.tokenizer
    assistants = [AssistantRecord.from_dict(r) for r in read_jsonl(out / ASSISTANT, key="item_id")]
    assistants = [a for a in assistants if a.item_id in wanted]
    store = JsonlStore(out / USER_TURNS, key="record_id")
    stops = chat.stop_token_ids(tok, lm.model)
    ctx = context_length(lm)
    if prompt_for is None:
        def prompt_for(a: AssistantRecord) -> chat.ProbePrompt:
            return chat.build_probe_prompt(tok, a.prompt, a.response, system=cfg.system, history=a.messages or None)
    jobs: list[tuple[AssistantRecord, chat.ProbePrompt, str, float, int, str]] = []
    for a in assistants:
        pp = prompt_for(a)
        rids = [(d, t, k, make_record_id(a.item_id, d, t, k, variant)) for d, t, k in plan]
        if all(store.has(rid) for *_, rid in rids):
            continue
        if _too_long(skipped, a.item_id, "user", len(pp.input_ids), cfg.max_user_tokens, ctx):
            continue
        jobs.extend((a, pp, d, t, k, rid) for d, t, k, rid in rids if not store.has(rid))
    if not jobs:
        return 0
    bar = tqdm(total=len(jobs), desc="user turns", disable=not progress, unit="turn")
    fill = None
    if prefix_store is not None and engine is None:
        # Rows that continue from a stored prefix prefill only their rest (end of the answer, user header).
        fill = max(len(j[1].input_ids) - prefix_store.covered(j[1].input_ids, len(j[1].input_ids) - 1) for j in jobs)
    rows = rows_per_call(cfg, engine, lm, max(len(j[1].input_ids) for j in jobs), cfg.max_user_tokens, fill)
    for batch in batches_by_length([len(j[1].input_ids) for j in jobs], rows):
        sel = [jobs[i] for i in batch]
        seeds = [row_seed(cfg.seed, j[5]) if j[3] > 0 else None for j in sel]
        gens = decode_rows(lm, engine, [j[1].input_ids for j in sel], stop_ids=stops,
                             max_new_tokens=cfg.max_user_tokens, temperatures=[j[3] for j in sel], seeds=seeds,
                             pad_id=tok.pad_token_id, kv_store=prefix_store, reuse=True)
        for (a, pp, decoding, temp, k, rid), seed, g in zip(sel, seeds, gens):
            raw, text = decode(tok, g)
            rec = UserTurnRecord(record_id=rid, item_id=a.item_id, dataset=a.dataset, decoding=decoding,
                                 temperature=temp, sample_index=k, seed=seed, raw_text=raw, text=text,
                                 stop_reason=g.stop_reason, prompt_ids=list(pp.input_ids),
                                 boundary_index=pp.boundary_index, assistant_span=pp.assistant_span,
                                 generated_ids=g.token_ids, variant=variant)
            store.append(rec.to_dict())
            bar.update(1)
    bar.close()
    return len(jobs)


VARIANTS_DIR = "variants"


def variant_dir(run: str | Path, variant: str) -> Path:
    return Path(run) / VARIANTS_DIR / variant


def run_variant(cfg: ProbeConfig, run: str | Path, variant: str, plan: list[tuple[str, float, int]], *,
                lm: LoadedModel, engine: Any = None, progress: bool = True) -> Path:
    """User turns of one perturbation (:mod:`mechprobe.turns.perturb`) of a finished probe run, resumably.

    Writes ``RUN/variants/VARIANT/``: ``assistant.jsonl`` holds the conversations as the model sees them
    (derived from ``RUN/assistant.jsonl``, never regenerated), ``user_turns.jsonl`` their user turns
    (``variant`` set, record ids ``...|VARIANT``), and a manifest pinning the parent run's identity, the
    variant and its decoding plan. So the judge stage runs on the directory unchanged and sees exactly
    what the model saw. A conversation already written that differs from the one computed now (a swap
    partner changes when the item set grows) is refused rather than mixed.
    """

    check_variants([variant])
    run = Path(run)
    if not (run / "manifest.json").exists():
        raise MissingInput(f"{run} has no manifest.json: run the probe stage before its perturbations")
    parent = read_json(run / "manifest.json")
    mine = {**lm.identity(), "config": cfg.identity()}
    diff = [k for k in mine if parent["identity"].get(k) != json.loads(json.dumps(mine[k], default=str))]
    if diff:
        raise UserError(f"{run} was probed with another {', '.join(diff)} than this command: its perturbations "
                        f"must use the run's own model and config")
    records = [AssistantRecord.from_dict(r) for r in read_jsonl(run / ASSISTANT, key="item_id")]
    if not records:
        raise MissingInput(f"{run / ASSISTANT} has no assistant turns to perturb")
    tok = lm.tokenizer
    perturbed = variant_records(tok, records, variant, seed=cfg.seed)
    out = variant_dir(run, variant)
    identity = {"parent": parent["identity"], "variant": variant, "plan": [list(p) for p in plan]}
    check_manifest(out, identity)
    have = {r["item_id"]: r for r in read_jsonl(out / ASSISTANT, key="item_id")}
    for v in perturbed:
        old = have.get(v.item_id)
        if old is not None and (old["prompt"], old["response"]) != (v.prompt, v.response):
            raise UserError(f"{out / ASSISTANT} holds item {v.item_id!r} with another {variant} conversation than "
                            f"the one computed now (the item set of {run} changed?). Delete {out} to rebuild it")
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as locks:
        for name in (ASSISTANT, USER_TURNS):
            locks.enter_context(writer_lock(out / name))
        check_or_write_manifest(out, identity, {"stage": "variant", "variant": variant, "parent_run": str(run)})
        store = JsonlStore(out / ASSISTANT, key="item_id")
        for v in perturbed:
            if not store.has(v.item_id):
                store.append(v.to_dict())
        t0 = time.time()
        n = _user_stage(cfg, lm, {v.item_id for v in perturbed}, plan, out, progress, engine,
                        JsonlStore(out / SKIPPED, key="item_id"), variant=variant,
                        prompt_for=lambda v: variant_prompt(tok, v, variant, system=cfg.system))
        check_or_write_manifest(out, identity, {"last_run": {"new_user_rows": n,
                                                             "seconds": round(time.time() - t0, 1)}})
    return out


