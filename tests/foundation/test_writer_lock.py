"""The writer lock that guards every stage file leaves no ``*.lock`` behind and still refuses a second writer."""

from __future__ import annotations

import pytest

from mechprobe.errors import UserError
from mechprobe.io import writer_lock


def test_no_lock_file_lingers_after_a_clean_exit(tmp_path):
    target = tmp_path / "labels.jsonl"
    with writer_lock(target) as lock:
        assert lock.exists()
    assert not list(tmp_path.glob("*.lock"))


def test_no_lock_file_lingers_after_an_exception(tmp_path):
    target = tmp_path / "labels.jsonl"
    with pytest.raises(RuntimeError), writer_lock(target):
        raise RuntimeError("stage failed")
    assert not list(tmp_path.glob("*.lock"))


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path):
    target = tmp_path / "user_turns.jsonl"
    with writer_lock(target), pytest.raises(UserError, match="being written by another process"):
        with writer_lock(target):
            pass
    with writer_lock(target):  # released and removed: the next writer gets in
        pass
    assert not list(tmp_path.glob("*.lock"))
