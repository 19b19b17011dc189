"""Files between stages: append-only JSONL that survives ``kill -9``, and run manifests.

Why append + flush + fsync per row: a long CPU/GPU run must lose at most the row being written
when it dies. On restart :class:`JsonlStore` drops a torn last line (the only damage a killed
append can do), and callers skip keys already present, so resuming never duplicates rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import UserError

MANIFEST = "manifest.json"

# Keys whose values must never be written anywhere (logs, manifests, caches).
_SECRET_KEYS = ("api_key", "apikey", "key", "token", "secret", "password", "authorization")


def redact(obj: Any) -> Any:
    """Return a copy of ``obj`` with secret-looking keys replaced, so configs can be logged safely."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            lk = str(k).lower()
            if any(lk == s or lk.endswith("_" + s) for s in _SECRET_KEYS) and v is not None:
                out[k] = "<redacted>"
            else:
                out[k] = redact(v)
        return out
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    return obj


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class JsonlStore:
    """An append-only JSONL file keyed by one field.

    >>> store = JsonlStore(path, key="record_id")
    >>> if not store.has(rid): store.append(row)
    """

    def __init__(self, path: str | Path, key: str):
        self.path = Path(path)
        self.key = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._keys: set[str] = set()
        self._repair_and_index()

    def _repair_and_index(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good_end = 0
        pos = 0
        for line in data.splitlines(keepends=True):
            pos_next = pos + len(line)
            stripped = line.strip()
            if not line.endswith(b"\n"):
                break  # torn final line from a killed writer
            if stripped:
                try:
                    row = json.loads(stripped)
                except json.JSONDecodeError:
                    break
                self._keys.add(str(row[self.key]))
            good_end = pos_next
            pos = pos_next
        if good_end != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def __len__(self) -> int:
        return len(self._keys)

    def has(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> set[str]:
        return set(self._keys)

    def append(self, row: dict[str, Any]) -> None:
        k = str(row[self.key])
        if k in self._keys:
            raise ValueError(f"duplicate {self.key}={k!r} in {self.path}")
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._keys.add(k)

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        for r in rows:
            self.append(r)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(read_jsonl(self.path))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read all complete rows of a JSONL file (a torn last line is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (tmp + rename) so a crash never leaves half a manifest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(redact(obj), indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def versions() -> dict[str, str]:
    """Library versions that change numbers: recorded in every manifest."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for mod in ("torch", "transformers", "mechprobe", "numpy", "sklearn", "nnsight", "transformer_lens"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "unknown")
        except Exception:  # noqa: BLE001 - optional packages
            continue
    return out


class ManifestMismatch(UserError, RuntimeError):
    """A run directory was made by a different model/template/config than the current command."""


def check_or_write_manifest(run_dir: str | Path, identity: dict[str, Any], extra: dict[str, Any],
                            name: str = MANIFEST) -> dict[str, Any]:
    """Create ``run_dir/manifest.json`` or verify that an existing one matches ``identity``.

    ``identity`` holds what must not change within a run (model and template hashes, generation
    config); ``extra`` is informational (versions, counts) and is refreshed. Mixing rows of two
    configurations in one directory would silently corrupt every downstream statistic, so a
    mismatch is an error that names the differing keys and the fix.
    """
    run_dir = Path(run_dir)
    path = run_dir / name
    identity = redact(identity)
    if path.exists():
        old = read_json(path)
        old_id = old.get("identity", {})
        new_id = json.loads(json.dumps(identity, default=str))
        diff = sorted(k for k in set(old_id) | set(new_id) if old_id.get(k) != new_id.get(k))
        if diff:
            details = "; ".join(f"{k}: run has {old_id.get(k)!r}, command has {new_id.get(k)!r}" for k in diff)
            raise ManifestMismatch(
                f"{path} was written by a different configuration ({details}). "
                f"Use a new --out directory, or delete {run_dir} to start over."
            )
        manifest = {**old, **extra, "identity": old_id}
    else:
        manifest = {**extra, "identity": identity}
    manifest["versions"] = versions()
    write_json(path, manifest)
    return manifest
