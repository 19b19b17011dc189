"""Building the activation cache of a run: load its model, capture the activations of every user turn at the
cached positions and layers, and write them as checksummed safetensors shards (resuming and repairing shards).
The layout is :mod:`mechprobe.activations.layout`; reading it back is :class:`~mechprobe.activations.cache.ActivationCache`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mechprobe.activations.backends import BACKENDS, Backend, HooksBackend, make_backend
from mechprobe.activations.layout import (
    _CANON,
    _DTYPES,
    _FLAGS,
    _FP16_MAX,
    CACHE_DIR,
    FORMAT,
    LAYER_CONVENTION,
    RESIDUAL_CONVENTION,
    CacheMismatch,
    parse_layers,
    parse_positions,
    shard_entry,
    shard_problem,
)
from mechprobe.errors import MissingInput, UsageError
from mechprobe.io import check_writable_dir, read_json, read_jsonl, shell_arg, write_json
from mechprobe.lm.choice import ChoiceScorer, crop_kv
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.records import UserTurnRecord

# ---------- building ----------

def _token_pos(rec: UserTurnRecord) -> dict[str, Any]:
    s, e = rec.assistant_span
    return {"boundary": rec.boundary_index, "span": (s, max(e, s + 1))}


def run_model(run_dir: Path, device: str | None = None) -> LoadedModel:
    """Load the model a run was probed with (name, chat template and dtype from its manifest).

    Public because the cache command loads it itself when ``--device`` is given, with the same manifest rules.
    """
    man = run_dir / "manifest.json"
    if not man.exists():
        raise MissingInput(f"{man} not found: pass a model to cache_run, or run the probe first")
    ident = read_json(man).get("identity", {})
    cfg = ident.get("config", {})
    if "model" not in ident:
        raise UsageError(f"{man} names no model: pass one (cache_run(run, model=load_model(...)) or model=)")
    return load_model(ident["model"], device=device, dtype=cfg.get("dtype"), chat_template=cfg.get("chat_template"))


def cache_run(
    run_dir: str | Path,
    model: LoadedModel | None = None,
    *,
    backend: str = "hooks",
    positions: Sequence[str] | str = ("boundary",),
    dtype: str = "float16",
    batch_size: int = 8,
    layers: str | Sequence[int] | None = "all",
    shard_rows: int = 512,
    progress: bool = True,
    prefixes: ChoiceScorer | None = None,
) -> Path:
    """Cache activations of every user turn of ``run_dir`` into ``run_dir/activations``; returns that path.

    Each unique prompt runs once (greedy and sampled turns of one item share it) and its vectors are
    written to every record using it. Resumable: finished shards are kept; a cache made with another
    model, template, backend, dtype, positions or layers is refused rather than mixed (backend, dtype and
    positions before the model is loaded). Shards damaged on disk (missing, truncated, altered: checked
    by size and sha256, see :func:`shard_problem`) are rebuilt in place, exactly their rows, and listed
    in the manifest's ``repaired``.

    Args:
        run_dir: a probe run directory holding ``user_turns.jsonl`` (and the ``manifest.json`` of the probe).
        model: the loaded model; None (default) loads the one named in the run's manifest with the run's
            dtype and chat template. A model whose weight/tokenizer/template hash differs from the run's is
            refused.
        backend: how activations are captured: ``"hooks"`` (default, forward hooks), ``"nnsight"`` or
            ``"transformer-lens"``.
        positions: which token positions to store, from ``"boundary"`` (last user-header token, default),
            ``"assistant_last"`` and ``"assistant_mean"``; a sequence or a comma-separated string.
        dtype: storage dtype of the shards: ``"float16"`` (default), ``"float32"`` or ``"bfloat16"``
            (``fp16``/``fp32``/``bf16`` accepted).
        batch_size: prompts per forward pass (default 8, >= 1).
        layers: residual indices to keep: ``"all"`` (default) or None = ``0..L``, or ints / a comma list
            (``r`` = input of block ``r``, 0 = embeddings, ``L`` = output of the last block).
        shard_rows: records per safetensors shard (default 512); peak memory is about one shard.
        progress: show a tqdm progress bar (default True).
        prefixes: a judge's KV store (``HybridJudge.store``) over the same loaded model; None (default). A prompt
            whose conversation it pooled runs only from there to its boundary instead of from its first token
            (boundary position, ``hooks`` backend; otherwise ignored). Why: the judge of a run already prefilled
            each conversation with the same weights; reading its keys and values makes the cache stage nearly
            free. Same vectors up to float summation order (tested); ``timing.prefix_hits`` counts the uses.

    Returns:
        The cache directory ``run_dir/activations`` (a :class:`~pathlib.Path`), ready for
        :meth:`ActivationCache.load`. Each shard holds one ``[rows, len(layers), d_model]`` tensor per position.

    Raises:
        UsageError: unknown backend/position/dtype, counts < 1, an empty run, NaN/Inf activations.
        MissingInput: no ``user_turns.jsonl`` (or no manifest naming the model when ``model`` is None).
        CacheMismatch: an existing cache or the passed model does not match this run or these options.

    Example:
        >>> from mechprobe import ActivationCache, cache_run
        >>> path = cache_run("runs/smol-gsm8k", layers=[0, 6, 12])          # doctest: +SKIP
        >>> ActivationCache.load(path).layers                              # doctest: +SKIP
        [0, 6, 12]
    """
    run_dir = Path(run_dir)
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    positions = parse_positions(positions)
    if dtype not in _DTYPES:
        raise UsageError(f"dtype must be one of float16, float32, bfloat16 (got {dtype!r})")
    dtype = _CANON.get(dtype, dtype)
    if batch_size < 1 or shard_rows < 1:
        raise UsageError("batch_size= and shard_rows must be >= 1")
    if run_dir.exists() or run_dir.is_symlink():  # a file, a loop or a read-only run: refused before the model loads
        check_writable_dir(run_dir / CACHE_DIR if (run_dir / CACHE_DIR).is_dir() else run_dir, "RUN")
    turns = run_dir / "user_turns.jsonl"
    if not turns.exists():
        raise MissingInput(f"{turns} not found: run `mechprobe probe {shell_arg(run_dir)}` first")
    recs = [UserTurnRecord.from_dict(r) for r in read_jsonl(turns, key="record_id")]
    if not recs:
        raise UsageError(f"{turns} is empty: the probe has not produced any user turns yet")
    out = run_dir / CACHE_DIR
    man_path = out / "manifest.json"
    if man_path.exists():  # options that need no model: refuse before loading one (seconds to minutes)
        _refuse_diff(read_json(man_path).get("identity", {}),
                     {"backend": backend, "dtype": dtype, "positions": positions}, run_dir, out)
    lm = model if model is not None else run_model(run_dir)
    layer_list = parse_layers(layers, lm.n_layers)
    identity = {**lm.identity(), "backend": backend, "dtype": dtype, "positions": positions, "layers": layer_list,
                "model_dtype": str(lm.dtype).replace("torch.", "")}
    run_man = run_dir / "manifest.json"
    if run_man.exists():
        run_id = read_json(run_man).get("identity", {})
        diff = [k for k in ("weight_hash", "template_hash", "tokenizer_hash") if k in run_id and run_id[k] != identity[k]]
        if diff:
            raise CacheMismatch(f"the model passed to cache_run is not the run's ({', '.join(diff)} differ): load "
                                f"{run_id.get('model')!r} with the run's chat template")
    ids = [r.record_id for r in recs]
    if man_path.exists():
        meta = read_json(man_path)
        _refuse_diff(meta.get("identity", {}), identity, run_dir, out)
        if ids[: meta["n_done"]] != meta["record_ids"][: meta["n_done"]]:
            raise CacheMismatch(f"{out} rows do not match {turns} (the run was regenerated); delete {out} and re-cache")
    else:
        meta = {"format": FORMAT, "identity": identity, "shards": [], "n_done": 0}
    meta.update({"record_ids": ids, "item_ids": [r.item_id for r in recs], "positions": positions,
                 "layers": layer_list, "d_model": lm.d_model, "n_layers_model": lm.n_layers, "backend": backend,
                 "dtype": dtype, "model": lm.name, "layer_convention": LAYER_CONVENTION,
                 "residual_convention": RESIDUAL_CONVENTION})
    out.mkdir(parents=True, exist_ok=True)
    known = {s["file"] for s in meta["shards"]}
    for f in [*out.glob("shard_*.safetensors"), *out.glob("*.tmp")]:
        if f.name not in known:  # written just before a crash, never recorded
            f.unlink()
    # Shards damaged on disk (missing, truncated, altered) are rebuilt in place, exactly their rows.
    broken = [i for i, sh in enumerate(meta["shards"]) if shard_problem(out / sh["file"], sh)]
    # Entries written before checksums existed get one now (they passed the header check above).
    for i, sh in enumerate(meta["shards"]):
        if i not in broken and "sha256" not in sh:
            meta["shards"][i] = shard_entry(out / sh["file"], sh["file"], sh["start"], sh["end"])
    meta["repaired"] = [meta["shards"][i]["file"] for i in broken]
    start = meta["n_done"]
    if start >= len(recs) and not broken:
        write_json(man_path, meta)
        return out

    store = _DTYPES[dtype]
    cap = make_backend(backend, lm.model, lm.tokenizer)
    todo = sum(meta["shards"][i]["end"] - meta["shards"][i]["start"] for i in broken) + len(recs) - start
    bar = tqdm(total=todo, desc=f"cache ({backend})", disable=not progress, unit="turn")

    # Cumulative forward-pass time per unique prompt, for the propensity probe's cost comparison
    # (one forward to the boundary vs sampling and judging k turns). Wall time, so it includes padding.
    timing = meta.setdefault("timing", {"forward_seconds": 0.0, "forward_prompts": 0, "rows": 0})

    # The judge's pooled conversations serve only the same weights (the very model object) and the boundary.
    pool = prefixes if (prefixes is not None and prefixes.model is lm.model and positions == ["boundary"]
                        and isinstance(cap, HooksBackend)) else None

    def write_shard(fname: str, a: int, b: int) -> dict[str, Any]:
        t = time.perf_counter()
        rows, hits, tokens = _capture_records(cap, recs[a:b], positions, layer_list, lm.d_model, batch_size, bar,
                                              pool)
        timing["forward_tokens"] = int(timing.get("forward_tokens", 0)) + tokens
        if pool is not None:
            timing["prefix_hits"] = int(timing.get("prefix_hits", 0)) + hits
        timing["forward_seconds"] = round(timing["forward_seconds"] + time.perf_counter() - t, 3)
        timing["forward_prompts"] += _n_unique_prompts(recs[a:b])
        timing["rows"] += b - a
        for p, x in rows.items():
            _check_storable(x, p, dtype)
        return _save_shard(out, fname, {p: rows[p].to(store).contiguous() for p in positions}, a, b, layer_list)

    try:
        for i in broken:
            sh = meta["shards"][i]
            meta["shards"][i] = write_shard(sh["file"], sh["start"], sh["end"])
            write_json(man_path, meta)
        while start < len(recs):
            end = min(len(recs), start + shard_rows)
            # Never split one prompt's rows (an item's greedy + sampled turns) across shards: each shard runs
            # its prompts in its own batches, and a prompt run twice with other padding differs in bf16
            # (measured: 0.5 of 75 at the 1.5B boundary), which breaks "one boundary state per item".
            while end < len(recs) and _prompt_key(recs[end]) == _prompt_key(recs[end - 1]):
                end += 1
            meta["shards"].append(write_shard(f"shard_{len(meta['shards']):05d}.safetensors", start, end))
            meta["n_done"] = end
            write_json(man_path, meta)
            start = end
    finally:
        bar.close()
    write_json(man_path, meta)
    return out


def _refuse_diff(old: dict[str, Any], new: dict[str, Any], run_dir: Path, out: Path) -> None:
    """Refuse to extend a cache made with other settings, naming each differing key and its flag."""
    # Keys a cache written by an older mechprobe lacks (model_dtype) cannot be compared; the rest must match.
    diff = [k for k in new if (k in old or k not in ("model_dtype",)) and old.get(k) != new[k]]
    if not diff:
        return
    details = "; ".join(f"{k}: cache has {old.get(k)!r}, now {new[k]!r} (set by {_FLAGS.get(k, k)})" for k in diff)
    flags = " ".join(f"{k}={_flag_value(old[k])}" for k in diff
                     if k in ("dtype", "positions", "layers", "backend") and k in old)
    again = f" (`mechprobe cache {shell_arg(run_dir)}` with {flags})" if flags else ""
    raise CacheMismatch(f"{out} was cached with a different configuration ({details}); pass the same "
                        f"options to extend it{again}, or delete {out} to re-cache")


def _flag_value(v: Any) -> str:
    return " ".join(str(x) for x in v) if isinstance(v, list) else str(v)


def _save_shard(out: Path, fname: str, tensors: dict[str, torch.Tensor], start: int, end: int,
                layers: list[int]) -> dict[str, Any]:
    """Write one shard atomically (tmp file, then rename) and return its manifest entry with checksum."""
    tmp = out / (fname + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "start": str(start), "end": str(end),
                                           "layers": json.dumps(layers)})
    entry = shard_entry(tmp, fname, start, end)
    os.replace(tmp, out / fname)
    return entry


def _check_storable(x: torch.Tensor, position: str, dtype: str) -> None:
    if not torch.isfinite(x).all():
        raise UsageError(f"the model produced NaN/Inf activations at {position}: load it in float32 or bfloat16 "
                         "(float16 models overflow)")
    if dtype == "float16" and x.abs().max() > _FP16_MAX:
        raise UsageError(f"activations at {position} reach {x.abs().max().item():.0f}, beyond float16's range "
                         "(65504): cache with dtype=bfloat16 or float32")


def _prompt_key(r: UserTurnRecord) -> tuple[int, ...]:
    """Records with the same key share one forward pass (greedy and sampled turns of one item)."""
    return (r.boundary_index, *r.assistant_span, *r.prompt_ids)


def _n_unique_prompts(recs: list[UserTurnRecord]) -> int:
    return len({_prompt_key(r) for r in recs})


def _capture_records(cap: Backend, recs: list[UserTurnRecord], positions: list[str], layers: list[int],
                     d_model: int, batch_size: int, bar: Any, pool: ChoiceScorer | None = None
                     ) -> tuple[dict[str, torch.Tensor], int, int]:
    """Capture one shard: each unique prompt runs once, sorted by length to limit padding; prompts whose KV
    ``pool`` holds run alone from it (:meth:`HooksBackend.capture_continued`). Returns (rows, pool hits, prompt
    tokens run, padding not counted)."""
    uniq: dict[tuple[int, ...], int] = {}
    order: list[int] = []
    prompts: list[UserTurnRecord] = []
    for r in recs:
        key = _prompt_key(r)
        if key not in uniq:
            uniq[key] = len(prompts)
            prompts.append(r)
        order.append(uniq[key])
    uses = np.bincount(order, minlength=len(prompts))
    res = {p: torch.empty(len(prompts), len(layers), d_model) for p in positions}
    hits = tokens = 0
    rest = []
    for i, r in enumerate(prompts):
        kv = pool.pooled(r.prompt_ids) if pool is not None else None
        if kv is None:
            rest.append(i)
            continue
        n = min(int(kv[0][0].shape[2]), r.boundary_index)
        assert isinstance(cap, HooksBackend)  # cache_run passes a pool with the hooks backend only
        res["boundary"][i] = cap.capture_continued(r.prompt_ids, r.boundary_index, layers, crop_kv(kv, n)).float().cpu()
        hits += 1
        tokens += r.boundary_index + 1 - n
        bar.update(int(uses[i]))
    by_len = sorted(rest, key=lambda i: len(prompts[i].prompt_ids))
    tokens += sum(len(prompts[i].prompt_ids) for i in rest)
    for b in range(0, len(by_len), batch_size):
        idx = by_len[b:b + batch_size]
        got = cap.capture([prompts[i].prompt_ids for i in idx], [_token_pos(prompts[i]) for i in idx], positions,
                          layers)
        for p in positions:
            res[p][idx] = got[p].float().cpu()
        bar.update(int(uses[idx].sum()))
    return {p: res[p][order] for p in positions}, hits, tokens
