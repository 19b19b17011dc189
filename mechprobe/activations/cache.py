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
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mechprobe.activations.backends import BACKENDS, CACHE_POSITIONS, Backend, HooksBackend, make_backend
from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import check_writable_dir, read_json, read_jsonl, sha256_file, write_json
from mechprobe.lm.choice import ChoiceScorer, crop_kv
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.records import LabelRecord, UserTurnRecord

CACHE_DIR = "activations"
FORMAT = "mechprobe.activations.cache/1"
LAYER_CONVENTION = ("residual index r in 0..L: r = 0 is the input to block 0 (embeddings), r = i is the output of "
                    "block i-1 (raw residual, before the final norm)")
# Stored in every manifest so a reader from another library maps indices correctly: TransformerLens
# ``resid_pre`` uses ours; steering-vectors, repeng and nnsight ``layers[L].output`` index block outputs,
# so their layer L is our r = L + 1.
RESIDUAL_CONVENTION = "resid_pre: r = input of block r; 0 = embeddings"
LAYERS_HELP = ("all, or residual indices (space- or comma-separated): r = input of block r (TransformerLens "
               "resid_pre), 0 = embeddings, L = after the last block. steering-vectors, repeng and nnsight "
               "index block outputs: their layer L is our r = L+1")
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_CANON = {"fp16": "float16", "fp32": "float32", "bf16": "bfloat16"}
_FP16_MAX = 65504.0


class CacheMismatch(UserError, RuntimeError):
    """A cache does not belong to this run / model / template, or is damaged."""


class CacheCorrupt(CacheMismatch):
    """A shard file is missing, truncated or altered: ``mechprobe cache RUN`` rebuilds exactly its rows."""


# Which flag of ``mechprobe cache`` sets each identity key, so a mismatch names the flag to change.
_FLAGS = {"dtype": "--dtype", "positions": "--positions", "layers": "--layers", "backend": "--backend",
          "model_dtype": "the run's model dtype (probe --dtype)", "weight_hash": "--model",
          "model": "--model", "tokenizer_hash": "--model", "template_hash": "--model (its chat template)"}


def shard_entry(path: Path, file: str, start: int, end: int) -> dict[str, Any]:
    """The manifest entry of a written shard: row range, byte size and sha256 of the file."""
    return {"file": file, "start": start, "end": end, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def shard_problem(path: Path, entry: dict[str, Any]) -> str | None:
    """Why the shard file ``path`` does not match its manifest ``entry``, or None when it does.

    Cost: one stat plus one sha256 pass over the file, on top of reading it (measured 0.7 GB/s on this
    project's 2-core EPYC: 27 ms for a default 512-row, 31-layer float16 SmolLM2 shard of 18 MB); every byte is covered, so a
    truncated file, a zeroed block or a swapped shard is caught. Shards written before checksums were
    recorded (no ``sha256`` in the entry) only get a header check.
    """
    if not path.exists():
        return "is missing"
    size = path.stat().st_size
    if "bytes" in entry and size != entry["bytes"]:
        return f"has {size} bytes, the manifest recorded {entry['bytes']} (truncated or overwritten)"
    if "sha256" in entry:
        return None if sha256_file(path) == entry["sha256"] else "does not match its recorded sha256 (corrupted bytes)"
    try:
        with safe_open(str(path), framework="pt") as st:
            list(st.keys())
    except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike mean: unreadable
        return f"cannot be read ({type(e).__name__}: {e})"
    return None


def resid_name(r: int, n_layers: int) -> str:
    """Human-readable name of residual index ``r`` (for plot labels and messages)."""
    if not 0 <= r <= n_layers:
        raise ValueError(f"residual index {r} out of range 0..{n_layers}")
    if r == 0:
        return "r0 = embeddings (input to block 0)"
    return f"r{r} = output of block {r - 1}" + (" (last block, before final norm)" if r == n_layers else "")


def parse_layers(layers: str | Sequence[int] | None, n_layers: int) -> list[int]:
    """``"all"`` / None -> 0..L; ``"0,6,12"`` or a list (of ints, or of strings as ``nargs='+'`` gives,
    each possibly a comma list) -> those residual indices (validated, sorted). r = input of block r."""
    if isinstance(layers, str):
        layers = [layers]
    toks = None if layers is None else [t.strip() for x in layers for t in str(x).split(",") if t.strip()]
    if toks is None or toks == ["all"]:
        return list(range(n_layers + 1))
    try:
        vals = [int(x) for x in toks]
    except ValueError:
        raise UsageError(f"--layers must be 'all' or comma-separated integers, got {layers!r}") from None
    bad = [v for v in vals if not 0 <= v <= n_layers]
    if bad:
        raise UsageError(f"--layers {bad} out of range: residual indices run 0..{n_layers} (0 = embeddings)")
    return sorted(set(vals))


def parse_positions(positions: str | Sequence[str]) -> list[str]:
    """``"boundary,assistant_last"`` or a list (entries may be comma lists) -> validated list, order kept,
    duplicates dropped."""
    items = [positions] if isinstance(positions, str) else list(positions)
    vals = [p.strip() for x in items for p in str(x).split(",") if p.strip()]
    bad = [p for p in vals if p not in CACHE_POSITIONS]
    if bad or not vals:
        raise UsageError(f"unknown positions {bad}; choose from {', '.join(CACHE_POSITIONS)}")
    return list(dict.fromkeys(vals))


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
            raise MissingInput(f"no activation cache at {path}: run `mechprobe cache {run}`")
        meta = read_json(man_path)
        if "record_ids" not in meta:  # a run directory's own (probe) manifest, not a cache's
            raise MissingInput(f"no activation cache at {path / CACHE_DIR} (the manifest at {man_path} is not a "
                               f"cache's): run `mechprobe cache {run}`")
        n, n_l, d = len(meta["record_ids"]), len(meta["layers"]), int(meta["d_model"])
        if meta.get("n_done", 0) != n:
            raise CacheMismatch(f"{path}: cache is incomplete ({meta.get('n_done', 0)}/{n} rows); run "
                                f"`mechprobe cache {path.parent}` to finish it")
        store = _DTYPES[meta["dtype"]]
        tensors = {p: torch.empty((n, n_l, d), dtype=store) for p in meta["positions"]}
        expect = 0
        for sh in meta["shards"]:
            f = path / sh["file"]
            if sh["start"] != expect:
                raise CacheMismatch(f"{path}: shard rows not contiguous at {expect}; "
                                    f"delete {path} and re-run `mechprobe cache {path.parent}`")
            problem = shard_problem(f, sh)
            if problem:
                raise CacheCorrupt(f"activation shard {f} {problem}: run `mechprobe cache {path.parent}` to "
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
                                    f"regenerated; delete {self.path} and re-run `mechprobe cache {run}`")
            if len(ids) > len(self.record_ids):
                warnings.warn(f"{self.path} covers {len(self.record_ids)} of the run's {len(ids)} user turns; run "
                              f"`mechprobe cache {run}` to add the rest", stacklevel=3)
        man = run / "manifest.json"
        if man.exists():
            run_id = read_json(man).get("identity", {})
            mine = self.meta["identity"]
            diff = [k for k in ("weight_hash", "tokenizer_hash", "template_hash") if k in run_id and
                    run_id[k] != mine.get(k)]
            if diff:
                raise CacheMismatch(f"{self.path} was cached with another model/template than {run} "
                                    f"({', '.join(diff)} differ); delete it and re-run `mechprobe cache {run}`")

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
            raise KeyError(f"position {position!r} not cached (have {self.positions}); re-cache with "
                           f"`mechprobe cache {self.path.parent} --positions {','.join([*self.positions, position])}` "
                           "into a fresh directory")
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
            raise MissingInput(f"no {labels_file} in {run}: run `mechprobe judge {run}` first")
        # read_jsonl names file and line for a garbage line, and refuses two verdicts for one record
        # (two judges appending at once) instead of silently keeping the last.
        by_id = {}
        for n, r in enumerate(read_jsonl(p, key="record_id"), start=1):
            try:
                by_id[r["record_id"]] = LabelRecord.from_dict(r)
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"{p}: row {n} is not a label record ({type(e).__name__}: {e}); fix or delete "
                                f"that row, or re-run `mechprobe judge {run}`") from None
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
                             f"with `mechprobe cache {self.path.parent} --layers ...` into a fresh directory")
        y = self.labels("genuine", labels_file) if labels is None else self._own_labels(labels)
        keep = ~torch.isnan(y)
        if not keep.any():
            where = "the labels passed" if labels is not None else str(self.path.parent / labels_file)
            raise UsageError(f"no usable labels in {where} (all unjudged, judge_error or NaN)")
        idx = keep.nonzero().flatten().tolist()
        return LabeledData(X=self.resid(layer, position)[keep], y=y[keep].long(),
                           groups=[self.item_ids[i] for i in idx], record_ids=[self.record_ids[i] for i in idx])


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
        raise UsageError(f"{man} names no model: pass one (cache_run(run, model=load_model(...)) or --model)")
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
        raise UsageError("--batch-size and shard_rows must be >= 1")
    if run_dir.exists() or run_dir.is_symlink():  # a file, a loop or a read-only run: refused before the model loads
        check_writable_dir(run_dir / CACHE_DIR if (run_dir / CACHE_DIR).is_dir() else run_dir, "RUN")
    turns = run_dir / "user_turns.jsonl"
    if not turns.exists():
        raise MissingInput(f"{turns} not found: run `mechprobe probe --out {run_dir}` first")
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
    flags = " ".join(f"{_FLAGS[k]} {_flag_value(old[k])}" for k in diff
                     if k in ("dtype", "positions", "layers", "backend") and k in old)
    again = f" (`mechprobe cache {run_dir} {flags}`)" if flags else ""
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
                         "(65504): cache with --dtype bfloat16 or float32")


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


# ---------- CLI ----------



