"""Residual-stream activations at the user-role boundary, cached to disk and loaded as a first-class object.

**Layer convention** (one name, used everywhere in mechprobe): the *residual index* ``r`` in ``0..L``
counts blocks already applied. ``r = 0`` is the input to block 0 (the embeddings, after any embedding
scaling such as Gemma's sqrt(d)); ``r = i`` is the output of block ``i - 1``. This equals HF
``output_hidden_states[r]`` for ``r < L``. HF's *last* entry is taken after the final norm, ours is
the raw output of the last block (the residual stream itself): ``final_norm(resid(L)) ==
hidden_states[L]`` (checked in the tests for transformers 5.23 Llama/Qwen2/Gemma3). So "layer 12" means
"after 12 blocks", which is also where steering at layer 12 adds. :func:`resid_name` spells it out.

**Positions**: ``boundary`` (the last user-header token, where the model is about to write as the
user), ``assistant_last`` (last token of the assistant response) and ``assistant_mean`` (mean over the
response tokens; an empty response falls back to its first position, the end-of-turn token).

**Storage** (``RUN/activations/``): safetensors shards ``shard_XXXXX.safetensors``, each holding one
tensor per position of shape ``[rows, len(layers), d_model]`` for records ``start..end`` in
``user_turns.jsonl`` order, plus ``manifest.json`` (model/tokenizer/template hashes, backend, dtype,
positions, layers, record and item ids, shard row ranges and each shard's size and sha256). Shards are
written as they complete, so peak memory is one shard whatever the number of records, and an interrupted
run resumes at the next shard. A shard that is missing, truncated or altered on disk is detected by its
checksum on load (a clear error naming the file) and rebuilt, rows for rows, by ``mechprobe cache RUN``.
Readable without mechprobe: ``json`` + ``safetensors.torch.load_file``, concatenating shards in manifest
order (see docs/activations.md).

This module holds the reader (:class:`ActivationCache`); the layout and parsing helpers are in
:mod:`mechprobe.activations.layout`, the writer (:func:`cache_run`) in :mod:`mechprobe.activations.build`.
Every name is importable from here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors import safe_open

from mechprobe.activations.build import cache_run, run_model
from mechprobe.activations.layout import (
    _DTYPES,
    CACHE_DIR,
    FORMAT,
    LAYER_CONVENTION,
    LAYERS_HELP,
    RESIDUAL_CONVENTION,
    CacheCorrupt,
    CacheMismatch,
    parse_layers,
    parse_positions,
    resid_name,
    shard_entry,
    shard_problem,
)
from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import read_json, read_jsonl, shell_arg
from mechprobe.records import LabelRecord

__all__ = [
    "CACHE_DIR", "FORMAT", "LAYERS_HELP", "LAYER_CONVENTION", "RESIDUAL_CONVENTION", "ActivationCache", "CacheCorrupt",
    "CacheMismatch", "LabeledData", "cache_run", "parse_layers", "parse_positions", "resid_name", "run_model",
    "shard_entry", "shard_problem",
]


class LabeledData(NamedTuple):
    """Rows with a usable label: ``X [n, d]`` float32, ``y [n]`` long, ``groups`` (item ids) and record ids."""

    X: torch.Tensor
    y: torch.Tensor
    groups: list[str]
    record_ids: list[str]


@dataclass
class ActivationCache:
    """Cached activations of a run, one row per user turn in ``user_turns.jsonl`` order.

    Build it with :func:`cache_run` (or ``mechprobe cache RUN``) and open it with :meth:`load`, which
    checks every shard; the constructor is internal. Layers are residual indices (TransformerLens
    ``resid_pre``: ``r`` = input of block ``r``, 0 = embeddings, ``L`` = raw output of the last block, before
    the final norm). Positions are the cached ones (``boundary``, ``assistant_last``, ``assistant_mean``).

    Attributes:
        path: the cache directory (``RUN/activations``); its parent is the run directory, where
            :meth:`labels` reads ``labels.jsonl``.
        meta: the parsed ``manifest.json`` (identity hashes, ``record_ids``, ``item_ids``, ``layers``,
            ``positions``, ``d_model``, ``n_layers_model``, ``dtype``, shards).
        record_ids: row order (``user_turns.jsonl`` order); ``item_ids``: the source item of each row, the
            groups for grouped cross-validation.
        layers: cached residual indices; ``positions``: cached positions; ``d_model``; ``n_layers_model``.
        model_name: the model named in the manifest (``load_model(cache.model_name)`` loads it);
            ``weight_hash``: the hash of its weights.

    Example:
        >>> from mechprobe import ActivationCache
        >>> cache = ActivationCache.load("runs/smol-gsm8k")   # doctest: +SKIP
        >>> X = cache.resid(12)          # [n_records, d_model] float32, input of block 12  # doctest: +SKIP
        >>> S = cache.stack("boundary")  # [n_records, len(cache.layers), d_model]          # doctest: +SKIP
        >>> y = cache.labels("genuine")  # 1/0, NaN where unlabelled or judge_error         # doctest: +SKIP
        >>> X, y, groups, ids = cache.dataset(12)             # doctest: +SKIP
    """

    path: Path
    meta: dict[str, Any]
    _tensors: dict[str, torch.Tensor]

    # ---------- loading ----------
    @classmethod
    def load(cls, path: str | Path, check_run: bool = True) -> ActivationCache:
        """Load a cache directory (or a run directory holding ``activations/``), with integrity checks.

        Checks: manifest present and complete, every shard's size and sha256 against the manifest
        (see :func:`shard_problem` for the cost), shard shapes and contiguity, no NaN/Inf, and (with
        ``check_run``) that record ids and model/template hashes still match the run beside it.
        """
        path = Path(path)
        if (path / CACHE_DIR / "manifest.json").exists():
            path = path / CACHE_DIR
        man_path = path / "manifest.json"
        run = path.parent if path.name == CACHE_DIR else path
        if not man_path.exists():
            raise MissingInput(f"no activation cache at {path}: run `mechprobe cache {shell_arg(run)}`")
        meta = read_json(man_path)
        if "record_ids" not in meta:  # a run directory's own (probe) manifest, not a cache's
            raise MissingInput(f"no activation cache at {path / CACHE_DIR} (the manifest at {man_path} is not a "
                               f"cache's): run `mechprobe cache {shell_arg(run)}`")
        n, n_l, d = len(meta["record_ids"]), len(meta["layers"]), int(meta["d_model"])
        if meta.get("n_done", 0) != n:
            raise CacheMismatch(f"{path}: cache is incomplete ({meta.get('n_done', 0)}/{n} rows); run "
                                f"`mechprobe cache {shell_arg(path.parent)}` to finish it")
        store = _DTYPES[meta["dtype"]]
        tensors = {p: torch.empty((n, n_l, d), dtype=store) for p in meta["positions"]}
        expect = 0
        for sh in meta["shards"]:
            f = path / sh["file"]
            if sh["start"] != expect:
                raise CacheMismatch(f"{path}: shard rows not contiguous at {expect}; "
                                    f"delete {path} and re-run `mechprobe cache {shell_arg(path.parent)}`")
            problem = shard_problem(f, sh)
            if problem:
                raise CacheCorrupt(f"activation shard {f} {problem}: run `mechprobe cache {shell_arg(path.parent)}` to "
                                   f"rebuild its rows {sh['start']}..{sh['end'] - 1} (nothing else is recomputed)")
            want = (sh["end"] - sh["start"], n_l, d)
            with safe_open(str(f), framework="pt") as st:
                for p in meta["positions"]:
                    shape = tuple(st.get_slice(p).get_shape())  # header only: no data read yet
                    if shape != want:
                        raise CacheMismatch(f"{f}: {p} has shape {shape}, expected {want}")
                    x = st.get_tensor(p)
                    if not torch.isfinite(x).all():
                        raise CacheMismatch(f"{f}: {p} contains NaN/Inf")
                    tensors[p][sh["start"]:sh["end"]] = x
            expect = sh["end"]
        cache = cls(path=path, meta=meta, _tensors=tensors)
        if check_run:
            cache._check_run()
        return cache

    def _check_run(self) -> None:
        run = self.path.parent
        turns = run / "user_turns.jsonl"
        if turns.exists():
            ids = [r["record_id"] for r in read_jsonl(turns, key="record_id")]
            if ids[: len(self.record_ids)] != self.record_ids:
                raise CacheMismatch(f"{self.path} does not match {turns} (record ids differ): the run was "
                                    f"regenerated; delete {self.path} and re-run `mechprobe cache {shell_arg(run)}`")
            if len(ids) > len(self.record_ids):
                warnings.warn(f"{self.path} covers {len(self.record_ids)} of the run's {len(ids)} user turns; run "
                              f"`mechprobe cache {shell_arg(run)}` to add the rest", stacklevel=3)
        man = run / "manifest.json"
        if man.exists():
            run_id = read_json(man).get("identity", {})
            mine = self.meta["identity"]
            diff = [k for k in ("weight_hash", "tokenizer_hash", "template_hash") if k in run_id and
                    run_id[k] != mine.get(k)]
            if diff:
                raise CacheMismatch(f"{self.path} was cached with another model/template than {run} "
                                    f"({', '.join(diff)} differ); delete it and re-run `mechprobe cache {shell_arg(run)}`")

    # ---------- access ----------
    @property
    def record_ids(self) -> list[str]:
        return list(self.meta["record_ids"])

    @property
    def item_ids(self) -> list[str]:
        """Source item of each row: group CV folds by this (greedy and sampled turns share one prompt)."""
        return list(self.meta["item_ids"])

    @property
    def layers(self) -> list[int]:
        """Cached residual indices (0 = embeddings, i = output of block i-1)."""
        return list(self.meta["layers"])

    @property
    def positions(self) -> list[str]:
        return list(self.meta["positions"])

    @property
    def model_name(self) -> str | None:
        """The model the activations came from, as the manifest names it (embedded name, hub id or path).

        Why: a probe or steering vector fitted on this cache only means something for that model;
        ``load_model(cache.model_name)`` loads it (None when the manifest names none).
        """
        return self.meta.get("model") or self.meta.get("identity", {}).get("model")

    @property
    def weight_hash(self) -> str | None:
        """sha256 of the weights the activations came from; steering refuses a model with other weights."""
        return self.meta.get("identity", {}).get("weight_hash")

    @property
    def n_layers_model(self) -> int:
        return int(self.meta["n_layers_model"])

    @property
    def d_model(self) -> int:
        return int(self.meta["d_model"])

    def __len__(self) -> int:
        return len(self.meta["record_ids"])

    def __repr__(self) -> str:
        return (f"ActivationCache({len(self)} records, model={self.model_name!r}, layers {self.layers[0]}.."
                f"{self.layers[-1]}, positions={self.positions}, dtype={self.meta['dtype']}, path={str(self.path)!r})")

    def _position(self, position: str) -> torch.Tensor:
        if position not in self._tensors:
            raise KeyError(f"position {position!r} not cached (have {self.positions}); re-cache "
                           f"into a fresh directory with positions={','.join([*self.positions, position])} "
                           f"(`mechprobe cache {shell_arg(self.path.parent)}`, cache_run)")
        return self._tensors[position]

    def resid(self, layer: int, position: str = "boundary", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Residual stream after ``layer`` blocks (0 = embeddings): ``[n_records, d_model]``, one row per record."""
        x = self._position(position)
        if layer not in self.meta["layers"]:
            raise KeyError(f"layer {layer} not cached (cached residual indices: {self.layers})")
        return x[:, self.meta["layers"].index(layer)].to(dtype)

    def stack(self, position: str = "boundary", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All cached layers: ``[n_records, len(self.layers), d_model]``."""
        return self._position(position).to(dtype)

    def to_numpy(self, position: str = "boundary") -> np.ndarray:
        """``[n_records, len(self.layers), d_model]`` float32 array (layers in ``self.layers`` order)."""
        return self.stack(position).numpy()

    # ---------- labels ----------
    def label_records(self, labels_file: str = "labels.jsonl") -> list[LabelRecord | None]:
        """The judge's record for each row (None where the row has not been judged)."""
        run = self.path.parent
        p = run / labels_file
        if not p.exists():
            raise MissingInput(f"no {labels_file} in {run}: run `mechprobe judge {shell_arg(run)}` first")
        # read_jsonl names file and line for a garbage line, and refuses two verdicts for one record
        # (two judges appending at once) instead of silently keeping the last.
        by_id = {}
        for n, r in enumerate(read_jsonl(p, key="record_id"), start=1):
            try:
                by_id[r["record_id"]] = LabelRecord.from_dict(r)
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"{p}: row {n} is not a label record ({type(e).__name__}: {e}); fix or delete "
                                f"that row, or re-run `mechprobe judge {shell_arg(run)}`") from None
        return [by_id.get(rid) for rid in self.record_ids]

    def labels(self, field: str = "genuine", labels_file: str = "labels.jsonl") -> Any:
        """Judged labels aligned with the rows.

        ``"genuine"`` -> float tensor of 1/0 with NaN where a row is unjudged or the judge failed
        (``judge_error``); :meth:`labeled_mask` selects the usable rows. ``"label"`` -> list of taxonomy
        label strings (None where unusable).
        """
        recs = self.label_records(labels_file)
        if field == "genuine":
            return torch.tensor([float("nan") if r is None or r.genuine is None else float(r.genuine) for r in recs])
        if field == "label":
            return [None if r is None or r.genuine is None else r.label for r in recs]
        raise ValueError(f"field must be 'genuine' or 'label', got {field!r}")

    def _own_labels(self, labels: Any) -> torch.Tensor:
        """Caller-given labels as a float tensor of 1/0/NaN aligned with the rows (checked)."""
        vals = [float("nan") if v is None else float(v) for v in
                (labels.tolist() if isinstance(labels, torch.Tensor | np.ndarray) else list(labels))]
        if len(vals) != len(self):
            raise UsageError(f"labels has {len(vals)} entries but the cache has {len(self)} rows: pass one label per "
                             "row, in cache.record_ids order (NaN or None for rows to leave out)")
        y = torch.tensor(vals, dtype=torch.float32)
        bad = ~torch.isnan(y) & (y != 0) & (y != 1)
        if bad.any():
            raise UsageError(f"labels must be 1/True (genuine follow-up), 0/False or NaN/None; row "
                             f"{int(bad.nonzero()[0])} is {vals[int(bad.nonzero()[0])]}")
        return y

    def labeled_mask(self, labels_file: str = "labels.jsonl") -> torch.Tensor:
        """Bool ``[n_records]``: True where the row has a usable genuine/not-genuine verdict."""
        return ~torch.isnan(self.labels("genuine", labels_file))

    def dataset(self, layer: int, position: str = "boundary", labels_file: str = "labels.jsonl",
                labels: Sequence[float | bool | None] | np.ndarray | torch.Tensor | None = None) -> LabeledData:
        """Labelled rows only, ready for a grouped-CV probe: ``X, y, groups, record_ids = cache.dataset(12)``.

        ``labels`` replaces the judge's labels with your own, one per row in :attr:`record_ids` order: 1/True
        for a genuine follow-up, 0/False for not, NaN/None to leave the row out.
        """
        if layer not in self.meta["layers"]:
            raise UsageError(f"layer {layer} is not cached here (cached residual indices: {self.layers}); re-cache "
                             f"into a fresh directory with layers= including {layer} "
                             f"(`mechprobe cache {shell_arg(self.path.parent)}`, cache_run)")
        y = self.labels("genuine", labels_file) if labels is None else self._own_labels(labels)
        keep = ~torch.isnan(y)
        if not keep.any():
            where = "the labels passed" if labels is not None else str(self.path.parent / labels_file)
            raise UsageError(f"no usable labels in {where} (all unjudged, judge_error or NaN)")
        idx = keep.nonzero().flatten().tolist()
        return LabeledData(X=self.resid(layer, position)[keep], y=y[keep].long(),
                           groups=[self.item_ids[i] for i in idx], record_ids=[self.record_ids[i] for i in idx])
