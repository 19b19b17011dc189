"""Writing into ``<run>/audit/``: one writer at a time, and every file whole or not at all.

Why a lock: an audit command reads what is stored (the sample, the labellers) and then writes what it
derived from it (the sheet, the report). Two commands at once each write from what *they* read, so the
last one silently drops the other's work: a report without the labeller imported a second earlier, a
``sample.json`` and a sheet of two different samples. Every audit write therefore happens under one lock
on the audit directory (:func:`mechprobe.io.writer_lock`, as ``probe`` and ``judge`` use for their files);
a second command is refused in one line instead of waiting, and the lock file is removed on exit.

Why temp + rename: a full disk or a read-only directory must not leave a 0-byte ``sheet.csv`` or a cut-off
``report.json`` where a good one was, nor ``*.tmp`` debris; the OS error becomes one line naming the fix.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mechprobe.errors import UserError
from mechprobe.io import write_json, write_text_atomic, writer_lock

__all__ = ["audit_lock", "ensure_dir", "write_audit_text", "write_json_atomic", "os_error"]

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def os_error(e: OSError, path: Path) -> UserError | None:
    """The one-line error for a write that failed because the disk is full or read-only; None otherwise
    (any other OS error is not something the user can fix by the message, so it keeps its traceback)."""
    if e.errno in _FULL:
        return UserError(f"no space left writing {path} ({e.strerror}); free some disk space and re-run the same "
                         f"command (the files already in {path.parent} were kept as they were)")
    if e.errno in _READ_ONLY:
        return UserError(f"{path.parent} is read-only ({e.strerror}: {path}), and the audit writes into it. Copy the "
                         f"run somewhere writable (cp -r) and point the command there, or make it writable "
                         f"(chmod -R u+w)")
    return None


def ensure_dir(d: Path) -> None:
    """``mkdir -p d``, with a read-only or full disk as one line."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        err = os_error(e, d / ".")
        if err is None:
            raise
        raise err from None


@contextlib.contextmanager
def audit_lock(directory: str | Path) -> Iterator[Path]:
    """Hold the audit directory's writer lock (``<directory>/audit.lock``, removed on exit).

    Args:
        directory: ``<run>/audit`` (made if missing; the run directory must exist).
    Example:
        >>> with audit_lock(audit_dir(run)):  # doctest: +SKIP
        ...     write_report(run, rep)
    """
    d = Path(directory)
    if not d.parent.is_dir():
        raise UserError(f"{d.parent} is not a directory; pass a run directory")
    ensure_dir(d)
    with writer_lock(d / "audit", remove=True,
                     clash="two audits at once would overwrite each other's sample, sheet or report") as lock:
        yield lock


def write_audit_text(path: str | Path, text: str, newline: str | None = None) -> None:
    """:func:`mechprobe.io.write_text_atomic` into the audit directory (made if missing), a full or read-only
    disk named as :func:`os_error` says."""
    path = Path(path)
    ensure_dir(path.parent)
    write_text_atomic(path, text, newline, explain=os_error)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """:func:`mechprobe.io.write_json`'s text (redacted, non-finite floats as null), written atomically."""
    path = Path(path)
    ensure_dir(path.parent)
    write_json(path, obj, explain=os_error)
