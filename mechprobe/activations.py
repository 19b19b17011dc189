"""Residual-stream activations at the user-role boundary, cached to disk and loaded as a first-class object.

Layer convention (one name, used everywhere in mechprobe): **residual index** ``r`` in ``0..L``.
``r = 0`` is the input to block 0 (the embeddings, after any embedding scaling, e.g. Gemma's sqrt(d));
``r = i`` is the output of block ``i - 1``. This equals HF ``output_hidden_states[r]`` for ``r < L``;
HF's *last* entry is after the final norm, ours is the raw output of the last block (the residual
stream itself), so ``final_norm(resid(L)) == hidden_states[L]``. "Layer 12" in mechprobe therefore
means "after 12 blocks", which is also what steering at layer 12 adds to.

Positions: ``boundary`` (the last user-header token, where the model is about to write as the user),
``assistant_last`` (last token of the assistant response) and ``assistant_mean`` (mean over the
response tokens).

Storage (``RUN/activations/``): safetensors shards, one tensor per position of shape
``[rows, n_layers, d_model]``, plus ``manifest.json`` (model/tokenizer/template hashes, backend, dtype,
positions, layers, record ids in ``user_turns.jsonl`` order, shard row ranges). Shards are written as
they complete, so peak memory is one shard and an interrupted run resumes at the next shard. Readable
without mechprobe: ``safetensors.torch.load_file`` + ``json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .backends import BACKENDS, capture
from .io import read_json, read_jsonl, write_json
from .models import LoadedModel, load_model
from .records import LabelRecord, UserTurnRecord

POSITIONS = ("boundary", "assistant_last", "assistant_mean")
CACHE_DIR = "activations"
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class CacheMismatch(RuntimeError):
    """A cache does not belong to this run / model / template."""


def parse_layers(layers: str | Sequence[int] | None, n_layers: int) -> list[int]:
    """``"all"`` / None -> 0..L; ``"0,6,12"`` or a list -> those residual indices (validated)."""
    if layers is None or layers == "all":
        return list(range(n_layers + 1))
    vals = [int(x) for x in layers.split(",")] if isinstance(layers, str) else [int(x) for x in layers]
    bad = [v for v in vals if not 0 <= v <= n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: residual indices run 0..{n_layers} (0 = embeddings)")
    return sorted(set(vals))


def parse_positions(positions: str | Sequence[str]) -> list[str]:
    vals = [p.strip() for p in positions.split(",")] if isinstance(positions, str) else list(positions)
    bad = [p for p in vals if p not in POSITIONS]
    if bad:
        raise ValueError(f"unknown positions {bad}; choose from {', '.join(POSITIONS)}")
    return vals


@dataclass
class ActivationCache:
    """Boundary (and optional assistant) activations of a run, aligned with its user turns.

    >>> cache = ActivationCache.load("runs/smol-gsm8k/activations")
    >>> X = cache.resid(layer=12)          # [n_records, d_model]
    >>> y = cache.labels("genuine")        # aligned with X
    """

    path: Path
    meta: dict[str, Any]
    _tensors: dict[str, torch.Tensor]

    # ---------- loading ----------
    @classmethod
    def load(cls, path: str | Path, check_run: bool = True) -> ActivationCache:
        """Load a cache directory (or a run directory holding ``activations/``), with integrity checks."""
        path = Path(path)
        if (path / CACHE_DIR / "manifest.json").exists():
            path = path / CACHE_DIR
        man_path = path / "manifest.json"
        if not man_path.exists():
            raise FileNotFoundError(f"no activation cache at {path}: run `mechprobe cache {path.parent}`")
        meta = read_json(man_path)
        from safetensors.torch import load_file

        parts: dict[str, list[torch.Tensor]] = {p: [] for p in meta["positions"]}
        expect = 0
        for sh in meta["shards"]:
            if sh["start"] != expect:
                raise CacheMismatch(f"{path}: shards are not contiguous at row {expect}; re-run `mechprobe cache`")
            t = load_file(str(path / sh["file"]))
            for p in meta["positions"]:
                x = t[p]
                want = (sh["end"] - sh["start"], len(meta["layers"]), meta["d_model"])
                if tuple(x.shape) != want:
                    raise CacheMismatch(f"{sh['file']}:{p} has shape {tuple(x.shape)}, expected {want}")
                if not torch.isfinite(x).all():
                    raise CacheMismatch(f"{sh['file']}:{p} contains NaN/Inf values")
                parts[p].append(x)
            expect = sh["end"]
        if expect != len(meta["record_ids"]):
            raise CacheMismatch(f"{path}: cache is incomplete ({expect}/{len(meta['record_ids'])} rows); "
                                "re-run `mechprobe cache` to finish it")
        tensors = {p: torch.cat(v) if v else torch.empty(0, len(meta["layers"]), meta["d_model"])
                   for p, v in parts.items()}
        cache = cls(path=path, meta=meta, _tensors=tensors)
        if check_run:
            cache._check_run()
        return cache

    def _check_run(self) -> None:
        turns = self.path.parent / "user_turns.jsonl"
        if not turns.exists():
            return
        ids = [r["record_id"] for r in read_jsonl(turns)]
        if ids[: len(self.record_ids)] != self.record_ids:
            raise CacheMismatch(f"{self.path} does not match {turns} (record ids differ): the run was regenerated; "
                                f"delete {self.path} and re-run `mechprobe cache {self.path.parent}`")

    # ---------- access ----------
    @property
    def record_ids(self) -> list[str]:
        return list(self.meta["record_ids"])

    @property
    def item_ids(self) -> list[str]:
        """Source item of each row: group cross-validation folds by this (samples of a prompt share a state)."""
        return list(self.meta["item_ids"])

    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    @property
    def positions(self) -> list[str]:
        return list(self.meta["positions"])

    def __len__(self) -> int:
        return len(self.meta["record_ids"])

    def resid(self, layer: int, position: str = "boundary", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Residual stream at residual index ``layer`` (0 = embeddings), one row per record."""
        if position not in self._tensors:
            raise KeyError(f"position {position!r} not cached (have {self.positions}); "
                           f"re-run `mechprobe cache RUN --positions {position}`")
        if layer not in self.meta["layers"]:
            raise KeyError(f"layer {layer} not cached (have {self.layers[0]}..{self.layers[-1]})")
        return self._tensors[position][:, self.meta["layers"].index(layer)].to(dtype)

    def stack(self, position: str = "boundary", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All cached layers: ``[n_records, n_layers, d_model]``."""
        return self._tensors[position].to(dtype)

    def label_records(self, labels_file: str = "labels.jsonl") -> list[LabelRecord | None]:
        p = self.path.parent / labels_file
        if not p.exists():
            raise FileNotFoundError(f"no {labels_file} beside this cache: run `mechprobe judge {self.path.parent}`")
        by_id = {r["record_id"]: LabelRecord.from_dict(r) for r in read_jsonl(p)}
        return [by_id.get(rid) for rid in self.record_ids]

    def labels(self, field: str = "genuine", labels_file: str = "labels.jsonl") -> torch.Tensor | list[str | None]:
        """Judged labels aligned with rows.

        ``"genuine"`` -> float tensor with 1/0 and NaN where a row is unlabelled or the judge failed
        (``judge_error``); use :meth:`labeled_mask` to drop those rows. ``"label"`` -> list of label
        strings (None for missing).
        """
        recs = self.label_records(labels_file)
        if field == "genuine":
            return torch.tensor([float("nan") if r is None or r.genuine is None else float(r.genuine) for r in recs])
        if field == "label":
            return [None if r is None or r.genuine is None else r.label for r in recs]
        raise ValueError("field must be 'genuine' or 'label'")

    def labeled_mask(self, labels_file: str = "labels.jsonl") -> torch.Tensor:
        return ~torch.isnan(self.labels("genuine", labels_file))  # type: ignore[arg-type]

    def to_numpy(self, position: str = "boundary") -> np.ndarray:
        """``[n_records, n_layers, d_model]`` float32 array (layers in ``self.layers`` order)."""
        return self.stack(position).numpy()


# ---------- building ----------

def _token_positions(rec: UserTurnRecord) -> dict[str, Any]:
    s, e = rec.assistant_span
    return {"boundary": rec.boundary_index, "span": (s, max(e, s + 1))}


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
) -> Path:
    """Cache activations for every user turn of ``run_dir`` into ``run_dir/activations``; resumable."""
    run_dir = Path(run_dir)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    positions = parse_positions(positions)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    recs = [UserTurnRecord.from_dict(r) for r in read_jsonl(run_dir / "user_turns.jsonl")]
    if not recs:
        raise FileNotFoundError(f"{run_dir} has no user turns: run `python experiments/probe.py --out {run_dir}`")
    if model is None:
        run_man = read_json(run_dir / "manifest.json")
        model = load_model(run_man["identity"]["model"])
    lm = model
    layer_list = parse_layers(layers, lm.n_layers)
    out = run_dir / CACHE_DIR
    identity = {**lm.identity(), "backend": backend, "dtype": dtype, "positions": positions, "layers": layer_list}
    run_man_path = run_dir / "manifest.json"
    if run_man_path.exists():
        run_id = read_json(run_man_path).get("identity", {})
        for k in ("weight_hash", "template_hash", "tokenizer_hash"):
            if k in run_id and run_id[k] != identity[k]:
                raise CacheMismatch(f"the model passed to cache_run differs from the run's ({k}); load the run's "
                                    f"model {run_id.get('model')!r}")
    man_path = out / "manifest.json"
    if man_path.exists():
        meta = read_json(man_path)
        diff = [k for k in identity if meta["identity"].get(k) != identity[k]]
        if diff:
            raise CacheMismatch(f"{out} was cached with a different {', '.join(diff)}; delete it or pass the same "
                                "options")
        ids = [r.record_id for r in recs]
        if ids[: meta["n_done"]] != meta["record_ids"][: meta["n_done"]]:
            raise CacheMismatch(f"{out} rows do not match {run_dir}/user_turns.jsonl; delete {out} and re-cache")
    else:
        meta = {"identity": identity, "shards": [], "n_done": 0}
    meta.update({"record_ids": [r.record_id for r in recs], "item_ids": [r.item_id for r in recs],
                 "positions": positions, "layers": layer_list, "d_model": lm.d_model, "n_layers_model": lm.n_layers,
                 "backend": backend, "dtype": dtype, "model": lm.name, "layer_convention":
                 "residual index: 0 = embeddings (input to block 0), r = output of block r-1 (pre final norm)"})
    out.mkdir(parents=True, exist_ok=True)
    # Drop shard files not in the manifest (written just before a crash).
    known = {s["file"] for s in meta["shards"]}
    for f in out.glob("shard_*.safetensors"):
        if f.name not in known:
            f.unlink()
    start = meta["n_done"]
    bar = tqdm(total=len(recs), initial=start, desc=f"cache ({backend})", disable=not progress, unit="turn")
    from safetensors.torch import save_file

    cap = _DTYPES[dtype]
    while start < len(recs):
        end = min(len(recs), start + shard_rows)
        chunk = recs[start:end]
        rows = _capture_records(lm, chunk, positions, layer_list, backend, batch_size, bar)
        fname = f"shard_{len(meta['shards']):05d}.safetensors"
        tmp = out / (fname + ".tmp")
        save_file({p: rows[p].to(cap).contiguous() for p in positions}, str(tmp))
        os.replace(tmp, out / fname)
        meta["shards"].append({"file": fname, "start": start, "end": end})
        meta["n_done"] = end
        write_json(man_path, meta)
        start = end
    bar.close()
    write_json(man_path, meta)
    return out


def _capture_records(lm: LoadedModel, recs: list[UserTurnRecord], positions: list[str], layers: list[int],
                     backend: str, batch_size: int, bar: Any) -> dict[str, torch.Tensor]:
    """Capture one chunk; each unique prompt runs once, rows sharing it copy its vectors."""
    uniq: dict[tuple[int, ...], int] = {}
    order: list[int] = []
    prompts: list[UserTurnRecord] = []
    for r in recs:
        key = tuple(r.prompt_ids)
        if key not in uniq:
            uniq[key] = len(prompts)
            prompts.append(r)
        order.append(uniq[key])
    by_len = sorted(range(len(prompts)), key=lambda i: len(prompts[i].prompt_ids))
    res: dict[str, torch.Tensor] = {p: torch.empty(len(prompts), len(layers), lm.d_model) for p in positions}
    n_batches = math.ceil(len(by_len) / batch_size)
    for b in range(n_batches):
        idx = by_len[b * batch_size:(b + 1) * batch_size]
        got = capture(lm.model, [prompts[i].prompt_ids for i in idx],
                      [_token_positions(prompts[i]) for i in idx], positions, layers, backend=backend,
                      tokenizer=lm.tokenizer)
        for p in positions:
            res[p][idx] = got[p].float().cpu()
        bar.update(sum(order.count(i) for i in idx))
    return {p: res[p][order] for p in positions}


# ---------- CLI ----------

def add_cache_args(p: Any) -> None:
    p.add_argument("run", help="run directory (holds user_turns.jsonl)")
    p.add_argument("--backend", default="hooks", choices=list(BACKENDS))
    p.add_argument("--positions", default="boundary", help=f"comma list of {', '.join(POSITIONS)}")
    p.add_argument("--layers", default="all", help="all, or residual indices like 0,6,12 (0 = embeddings)")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default=None, help="default: the run's model")
    p.add_argument("--device", default=None)


def run_cache_cli(a: Any) -> int:
    lm = None
    if a.model or a.device:
        model_name = a.model or read_json(Path(a.run) / "manifest.json")["identity"]["model"]
        lm = load_model(model_name, device=a.device)
    out = cache_run(a.run, lm, backend=a.backend, positions=a.positions, dtype=a.dtype, batch_size=a.batch_size,
                    layers=a.layers)
    meta = read_json(out / "manifest.json")
    print(json.dumps({"cache": str(out), "rows": meta["n_done"], "layers": len(meta["layers"]),
                      "positions": meta["positions"], "backend": meta["backend"], "dtype": meta["dtype"]}))
    return 0
