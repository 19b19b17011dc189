"""The activation cache's on-disk layout and conventions: directory and format names, the residual-index
convention, the flags that set each manifest key, shard checksums, and parsing of ``--layers`` / ``--positions``.

Shared by the reader (:mod:`mechprobe.activations.cache`) and the writer (:mod:`mechprobe.activations.build`);
see :mod:`mechprobe.activations.cache` for the conventions in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mechprobe.activations.backends import CACHE_POSITIONS
from mechprobe.errors import UsageError, UserError
from mechprobe.io import sha256_file

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


# Which setting of cache_run (``mechprobe cache``) sets each identity key, so a mismatch names the one to change
# (as ``field=``; the command line shows its flag).
_FLAGS = {"dtype": "dtype=", "positions": "positions=", "layers": "layers=", "backend": "backend=",
          "model_dtype": "the run's model dtype (probe dtype=)", "weight_hash": "model=",
          "model": "model=", "tokenizer_hash": "model=", "template_hash": "model= (its chat template)"}


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
        raise UsageError(f"layers={layers!r}: must be 'all' or comma-separated integers") from None
    bad = [v for v in vals if not 0 <= v <= n_layers]
    if bad:
        raise UsageError(f"layers={bad} out of range: residual indices run 0..{n_layers} (0 = embeddings)")
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
