"""`mechprobe judge` on a run it cannot write: a symlink loop, a file, a full disk. One line, exit 2, and the
labels already written stay whole (no empty or torn labels.jsonl)."""

from __future__ import annotations

import errno
import os

import pytest

from mechprobe.cli.judge import main as main_judge
from mechprobe.io import JsonlStore, read_jsonl
from tests.judges.test_judge_stage import make_run


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_symlink_loop_is_one_line(tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert main_judge([str(loop), "--judge", "offline-lexical", "--no-progress"]) == 2
    assert "loop" in _one_line_error(capsys)


def test_run_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "run.txt"
    f.write_text("not a run")
    assert main_judge([str(f), "--judge", "offline-lexical", "--no-progress"]) == 2
    assert "run.txt" in _one_line_error(capsys)
    assert f.read_text() == "not a run"


def _labels_fd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith("labels.jsonl")
    except OSError:
        return False


@pytest.mark.parametrize("fail", ["fsync", "write"])
@pytest.mark.parametrize("after", [0, 3])
def test_disk_full_keeps_the_rows_written_and_resumes(tmp_path, capsys, monkeypatch, fail, after):
    """ENOSPC on the (after+1)-th row: the first ``after`` rows stay whole, nothing torn or empty is left, the
    error is one line, and a re-run with space again labels the rest."""
    run = make_run(tmp_path)
    real = {"fsync": os.fsync, "write": os.write}
    calls = {"n": 0}

    def full(fd, *args):
        if _labels_fd(fd):
            calls["n"] += 1
            if calls["n"] > after:
                if fail == "write":  # half the line reaches the disk, then the disk is full
                    real["write"](fd, bytes(args[0])[: len(args[0]) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real[fail](fd, *args)

    monkeypatch.setattr(os, fail, full)
    assert main_judge([str(run), "--judge", "offline-lexical", "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "No space left" in err and "labels.jsonl" in err
    labels = run / "labels.jsonl"
    if after == 0:
        assert not labels.exists()  # never an empty labels.jsonl
    else:
        assert labels.read_bytes().endswith(b"\n") and len(read_jsonl(labels)) == after
    assert not (run / "labels_summary.md").exists()
    monkeypatch.setattr(os, fail, real[fail])
    assert main_judge([str(run), "--judge", "offline-lexical", "--no-progress"]) == 0
    assert len(read_jsonl(labels, key="record_id")) == 8


def test_store_append_failure_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    store = JsonlStore(tmp_path / "x.jsonl", key="k")
    store.append({"k": "a"})
    before = (tmp_path / "x.jsonl").read_bytes()
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(Exception, match="free disk space") as e:
        store.append({"k": "b"})
    assert type(e.value).__name__ == "UserError"
    monkeypatch.setattr(os, "fsync", real)
    assert (tmp_path / "x.jsonl").read_bytes() == before and not store.has("b")
    store.append({"k": "b"})
    assert [r["k"] for r in read_jsonl(tmp_path / "x.jsonl")] == ["a", "b"]
