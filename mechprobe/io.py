"""Files between stages: append-only JSONL that survives ``kill -9``, and run manifests.

Why append + flush + fsync per row: a long CPU/GPU run must lose at most the row being written
when it dies. On restart :class:`JsonlStore` drops a torn last line (the only damage a killed
append can do), and callers skip keys already present, so resuming never duplicates rows.

Why everything else is an error: a malformed line *before* the last one, or two rows with one key,
is not something a killed writer leaves behind -- it is an edited file or two writers at once
(:func:`writer_lock` prevents the latter). Dropping or picking rows silently would change every
statistic computed from the file, so readers name the file and line and stop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError, UserError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"

# Keys whose values must never be written anywhere (logs, manifests, caches).
# Names of fields that hold a secret (exact, or as a ``_suffix``: ``openai_api_key``, ``hf_token``). A bare ``key``
# is not one (row keys, cell keys), and only text is a secret: a number in a ``*_per_token`` field is data.
_SECRET_KEYS = ("api_key", "apikey", "token", "secret", "password", "authorization")


def redact(obj: Any) -> Any:
    """Return a copy of ``obj`` with the text of secret-looking fields replaced, so configs can be logged safely.

    Example:
        >>> redact({"api_key": "sk-1", "error_rms_per_token": 0.04, "key": "r1"})
        {'api_key': '<redacted>', 'error_rms_per_token': 0.04, 'key': 'r1'}
    """
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            lk = str(k).lower()
            if any(lk == s or lk.endswith("_" + s) for s in _SECRET_KEYS) and isinstance(v, str) and v:
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
    """An append-only JSONL file keyed by one field: a long run appends each row as it is made and, resumed,
    skips the keys already there (a torn last line from a kill is repaired on open).

    Example:
        >>> import tempfile
        >>> store = JsonlStore(Path(tempfile.mkdtemp()) / "turns.jsonl", key="record_id")
        >>> row = {"record_id": "r1", "text": "Why 84?"}
        >>> if not store.has(row["record_id"]): store.append(row)
        >>> store.has("r1"), len(store)
        (True, 1)
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
        rows, good_end = _parse_lines(self.path, data)
        for lineno, row in rows:
            self._index(row, lineno)
        if good_end != len(data):
            log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted writer",
                        self.path, len(data) - good_end)
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def _index(self, row: dict[str, Any], lineno: int) -> None:
        if self.key not in row:
            raise UserError(f"{self.path}:{lineno}: row has no {self.key!r} field; the file is not a "
                            f"{self.path.name} written by mechprobe (fix or remove that line)")
        k = str(row[self.key])
        if k in self._keys:
            raise UserError(_duplicate_message(self.path, self.key, k, lineno))
        self._keys.add(k)

    def __len__(self) -> int:
        return len(self._keys)

    def has(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> set[str]:
        return set(self._keys)

    def append(self, row: dict[str, Any]) -> None:
        """Append one row durably, or leave the file exactly as it was.

        Why: a full disk (or quota) failing the write left a partial line, or an empty file created by the first
        append, and ended in an ``OSError`` traceback. The file is cut back to its size before the append (and
        removed if this append created it), and the error is one line: the rows already written stay.
        """
        k = str(row[self.key])
        if k in self._keys:
            raise ValueError(f"duplicate {self.key}={k!r} in {self.path}")
        data = (dumps_row(row) + "\n").encode("utf-8")
        created = not self.path.exists()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise _write_error(self.path, e, len(self._keys)) from None
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                if created:
                    self.path.unlink()
            raise _write_error(self.path, e, len(self._keys)) from None
        finally:
            os.close(fd)
        self._keys.add(k)

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        for r in rows:
            self.append(r)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(read_jsonl(self.path))


def _write_error(path: Path, e: OSError, n_kept: int) -> UserError:
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = "free disk space" if full else "make it writable"
    return UserError(f"cannot write {path} ({e.strerror or e}); {fix} and re-run: the {n_kept} rows already in it "
                     f"are kept and the stage resumes after them")


def shell_arg(value: str | Path) -> str:
    """``value`` as one shell word, for a command a message suggests (a path with spaces stays one argument)."""
    return shlex.quote(str(value))


def named(label: str, value: object) -> str:
    """``label=value`` for a setting's field name (``out=runs/x``), ``label value`` for a positional (``RUN runs/x``).

    Why: messages below :mod:`mechprobe.cli` name the config field; the CLI rewrites ``field=`` into its flag."""
    return f"{label}={value}" if label.isidentifier() and label.islower() else f"{label} {value}"


def check_writable_dir(path: str | Path, flag: str) -> Path:
    """Refuse, before anything runs, a directory a stage cannot write: one that is a file, a symlink loop, a
    dangling symlink (or a path under one), or read-only (tried with a real temporary file, so it holds for root
    and read-only mounts too). A directory that does not exist yet is checked at its nearest existing parent.
    ``flag`` names the setting in the error (a field name such as ``out``, or ``RUN``).

    Why: each of these ended in a traceback (``FileExistsError``, ``RuntimeError: Symlink loop``,
    ``PermissionError``) after the model was loaded, or after the first stage had run.
    """
    p = Path(path)
    try:
        p.resolve()
    except (RuntimeError, OSError) as e:
        raise UsageError(f"{named(flag, p)}: cannot be resolved ({e}); point it at a real directory") from None
    if p.exists() and not p.is_dir():
        raise UsageError(f"{named(flag, p)} is a file, not a directory: pass a directory (a new name is created)")
    probe = p
    while not probe.exists():
        if probe.is_symlink():  # exists() follows the link: its target is gone, and mkdir would fail on it
            raise UsageError(f"{named(flag, p)}: {probe} is a symlink to {os.readlink(probe)}, which does not exist; "
                             f"create that directory or pass another path")
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{named(flag, p)}: {probe} is a file, not a directory: pass a path under a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".mechprobe-write-check-")
    except OSError as e:
        raise UsageError(f"{named(flag, p)}: {probe} is not writable ({e.strerror or e}); copy the run somewhere "
                         f"writable (cp -r) or make it writable (chmod -R u+w)") from None
    os.close(fd)
    os.unlink(tmp)
    return p


def dumps_row(row: dict[str, Any]) -> str:
    """One JSONL row. ``allow_nan=False``: bare ``NaN``/``Infinity`` is not JSON, and a NaN in a record
    (a temperature, a score) is a bug upstream that must stop the run, not be written and read back."""
    try:
        return json.dumps(row, ensure_ascii=False, allow_nan=False)
    except ValueError as e:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        raise ValueError(f"refusing to write a non-finite number into a JSONL row (fields {bad}): {e}") from e


def _duplicate_message(path: Path, key: str, value: str, lineno: int) -> str:
    return (f"{path}:{lineno}: duplicate {key}={value!r} (an earlier line has the same {key}); two processes "
            f"probably wrote this file at once. Keep one row per {key} (or delete the file and re-run the stage); "
            f"nothing was changed")


def _parse_lines(path: Path, data: bytes) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """Rows (with 1-based line numbers) and the byte offset after the last complete line.

    Only an unterminated last line (a killed append) is tolerated; a malformed complete line is a
    :class:`UserError` naming the file and line, because the rows after it are valid data.
    """
    rows: list[tuple[int, dict[str, Any]]] = []
    good_end = 0
    for lineno, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.endswith(b"\n"):
            break  # torn final line from a killed writer: the caller drops it
        good_end += len(line)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}:{lineno}: malformed line ({e}); only a torn *last* line is repaired "
                            f"automatically. Fix or delete line {lineno} (nothing was changed), or delete the "
                            f"file and re-run the stage") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}; fix or delete "
                            f"line {lineno} (nothing was changed)")
        rows.append((lineno, row))
    return rows, good_end


def read_jsonl(path: str | Path, key: str | None = None) -> list[dict[str, Any]]:
    """Read all complete rows of a JSONL file (a torn last line is ignored).

    A malformed line elsewhere is a :class:`UserError` naming file and line. With ``key``, two rows
    with the same ``row[key]`` are an error too: a reader that kept the first or the last would
    silently change the data (two judges appending at once produced exactly that).
    """
    path = Path(path)
    if not path.exists():
        return []
    rows, _ = _parse_lines(path, path.read_bytes())
    if key is not None:
        seen: set[str] = set()
        for lineno, row in rows:
            k = str(row.get(key))
            if k in seen:
                raise UserError(_duplicate_message(path, key, k, lineno))
            seen.add(k)
    return [r for _, r in rows]


@contextlib.contextmanager
def writer_lock(path: str | Path, remove: bool = True, clash: str = "two writers would duplicate rows",
                busy: Callable[[str, Path], str] | None = None) -> Iterator[Path]:
    """Hold an exclusive, non-blocking lock on ``<path>.lock`` while writing ``path``.

    Why: two processes appending to one stage file (two ``mechprobe judge`` on one run) each skip the
    keys *they* saw at start and then both append, so rows get duplicated. ``flock`` is released by
    the kernel when the holder dies, so a crashed writer never leaves a stale lock behind. The lock
    file records the holder's pid and program for the refusal message. The directory must exist.

    Args:
        path: the file (or directory) the caller writes; the lock is ``<path>.lock`` beside it.
        remove: delete the lock file on exit (while still holding it), so no ``*.lock`` is left in the run
            directory after a clean exit or an exception (default). Safe
            because every acquirer checks, after locking, that the file it locked is still the one at
            the path (a holder may have removed it between our open and our lock); if not, it retries.
        clash: what would go wrong with two writers, for the refusal message.
        busy: the whole refusal message from ``(holder, lock)``, where ``clash`` is not enough.
    """
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    for _ in range(20):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise UserError(f"{path.parent} is read-only ({e.strerror}: {lock}), and this command writes into it "
                            f"({path.name}). Copy the run somewhere writable (cp -r) and point the command there, "
                            "or make it writable (chmod -R u+w)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process"
            os.close(fd)
            if busy is not None:
                raise UserError(busy(holder, lock)) from None
            raise UserError(f"{path} is being written by another process ({holder}; lock {lock}). Wait for it "
                            f"to finish, or stop it, then re-run; {clash}") from None
        if _same_file(fd, lock):
            break
        os.close(fd)  # we locked a file its holder removed on exit: lock the one at the path now
    else:
        raise UserError(f"{lock} keeps being replaced by other processes; stop the other writers of {path} and "
                        f"re-run")
    try:
        os.ftruncate(fd, 0)
        # pid and program only: a command line may carry a secret.
        os.pwrite(fd, f"pid {os.getpid()}, {Path(sys.argv[0]).name or 'python'}".encode(), 0)
        yield lock
    finally:
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)  # still held: a process that opened it meanwhile sees the inode change
        os.close(fd)  # closing the descriptor releases the flock


def _same_file(fd: int, path: Path) -> bool:
    """Whether the descriptor ``fd`` is the file now at ``path`` (a holder may have removed and recreated it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


OUTPUT_LOCK = ".mechprobe_writer.lock"


@contextlib.contextmanager
def output_dir_lock(directory: str | Path, command: str, other: str) -> Iterator[Path]:
    """Hold the writer lock of a command's whole output directory (:func:`writer_lock` on
    ``<directory>/.mechprobe_writer.lock``) while ``command`` writes into it; the lock file is removed on exit,
    clean or not.

    Why: post-training and the study write many files (checkpoints, summaries, the report, the figures) into
    one directory; a second run into the same directory would interleave them. ``other`` names the setting that
    points a run elsewhere (``out``, ``root``). Creates the directory.
    """
    directory = Path(directory)
    check_writable_dir(directory, other)
    directory.mkdir(parents=True, exist_ok=True)
    with writer_lock(directory / OUTPUT_LOCK.removesuffix(".lock"), busy=lambda holder, lock: (
            f"{directory} is in use by another {command} run ({holder}; lock {lock}). Wait for it to finish, or "
            f"stop it, or give this run another {other}=")) as lock:
        yield lock


def write_json(path: str | Path, obj: Any, explain: Callable[[OSError, Path], UserError | None] | None = None) -> None:
    """Write JSON atomically (tmp + rename) so a crash never leaves half a manifest; ``explain`` as in
    :func:`write_text_atomic`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite(redact(obj)), indent=2, sort_keys=True, default=str, allow_nan=False)
    write_text_atomic(path, text + "\n", explain=explain)


def _write_failed(e: OSError, path: Path) -> UserError:
    fix = "free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return UserError(f"cannot write {path} ({e.strerror or e}); {fix} and re-run")


def write_text_atomic(path: str | Path, text: str, newline: str | None = None,
                      explain: Callable[[OSError, Path], UserError | None] | None = None) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and a rename: a full disk leaves
    the old file (or none), never an empty or cut-off one, and no temporary file is left behind, even on an
    interrupt. The one atomic text write of the package.

    Args:
        newline: passed to :func:`open` (``""`` for CSV, which writes its own line ends).
        explain: turns the :class:`OSError` of a failed write into the one-line :class:`UserError` to raise
            (None: re-raise the OS error as it is); default: "cannot write PATH (...); free disk space / make
            it writable and re-run".
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline=newline) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            err = (explain or _write_failed)(e, path)
            if err is not None:
                raise err from None
        raise


def finite(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by None: JSON has no NaN, and an undefined statistic
    (a rate over zero rows, a CI that could not be drawn) is written as ``null``, never a bare ``NaN``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def read_json(path: str | Path) -> Any:
    """Parse a JSON file; a cut-off or edited one (a manifest truncated by a full disk or a copy) is a
    :class:`UsageError` (still a ``ValueError``) naming the file and the fix, not a ``JSONDecodeError`` traceback."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON ({e}): it was cut off or edited. Restore it from a copy, or "
                        f"delete it and re-run the stage that writes it (for a run's manifest.json: rebuild the run "
                        f"in a new directory)") from None


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


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys, so a mismatch names ``config.max_user_tokens``, not all of ``config``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def identity_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``"key: run has X, command has Y"`` for every (dotted) key whose value differs, sorted by key."""
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: run has {a.get(k)!r}, command has {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def check_manifest(run_dir: str | Path, identity: dict[str, Any], name: str = MANIFEST) -> dict[str, Any] | None:
    """Read-only half of :func:`check_or_write_manifest`: the existing manifest (None when there is
    none), or :class:`ManifestMismatch` naming every differing key. Lets a stage refuse before writing."""
    run_dir = Path(run_dir)
    path = run_dir / name
    if not path.exists():
        return None
    old = read_run_manifest(run_dir, name)
    assert old is not None  # the file exists
    diff = identity_diff(old["identity"], json.loads(json.dumps(redact(identity), default=str)))
    if diff:
        raise ManifestMismatch(f"{path} was written by a different configuration ({'; '.join(diff)}). "
                               f"Use a new out= directory; nothing was changed.")
    return old


def read_run_manifest(run_dir: str | Path, name: str = MANIFEST) -> dict[str, Any] | None:
    """A run directory's manifest (None when there is none); :class:`ManifestMismatch` when the directory holds
    something else (a manifest without a run's ``identity``, e.g. a run's activation cache).

    Why: ``--out RUN/activations`` was treated as a run of another configuration, after the model had loaded, with
    the advice to delete the directory: a valid cache. Nothing here suggests deleting anything.
    """
    path = Path(run_dir) / name
    if not path.exists():
        return None
    old = read_json(path)
    if not isinstance(old, dict) or "identity" not in old:
        fmt = str(old.get("format", "")) if isinstance(old, dict) else ""
        what = "an activation cache" if "activations.cache" in fmt else f"a {fmt or 'non-run'} manifest"
        raise ManifestMismatch(f"{run_dir} is not a run directory: it holds {what} ({path}); pass a new or run "
                               f"directory as out=; nothing was changed")
    return old


def check_or_write_manifest(run_dir: str | Path, identity: dict[str, Any], extra: dict[str, Any],
                            name: str = MANIFEST) -> dict[str, Any]:
    """Create ``run_dir/manifest.json`` or verify that an existing one matches ``identity``.

    ``identity`` holds what must not change within a run (model and template hashes, generation
    config, data source); ``extra`` is informational (versions, counts) and is refreshed. Mixing rows
    of two configurations in one directory would silently corrupt every downstream statistic, so a
    mismatch is an error that names the differing keys (with both values) and the fix.
    """
    run_dir = Path(run_dir)
    path = run_dir / name
    identity = redact(identity)
    old = check_manifest(run_dir, identity, name)
    if old is not None:
        manifest = {**old, **extra, "identity": old["identity"]}
    else:
        manifest = {**extra, "identity": identity}
    manifest["versions"] = versions()
    write_json(path, manifest)
    return manifest
