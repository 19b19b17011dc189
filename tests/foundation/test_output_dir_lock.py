"""Post-training and the study hold the writer lock of their output directory: a second run into the same
directory is refused with one line naming it, and the lock file is gone after a clean exit or an exception."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager

import pytest

from mechprobe.errors import UserError
from mechprobe.io import OUTPUT_LOCK, output_dir_lock
from mechprobe.post_train import evaluate as pt_eval
from mechprobe.post_train.config import PostTrainConfig
from mechprobe.study.run import StudyConfig, report, run_study


@contextmanager
def held_by_another_run(directory):
    """Hold the directory's writer lock the way a running command does (another open file description)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / OUTPUT_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, b"pid 4242, post_train.py", 0)
    try:
        yield
    finally:
        os.close(fd)


class Loaded(Exception):
    """Raised instead of loading a model: the command got past its checks."""


def _no_model(*a, **k):
    raise Loaded


def _one_line_refusal(e: pytest.ExceptionInfo, directory) -> None:
    msg = str(e.value)
    assert "\n" not in msg and str(directory) in msg and "in use" in msg and msg.endswith("=")  # names the setting


def test_second_post_training_run_into_one_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pt_eval, "load_model", _no_model)
    out = tmp_path / "pt"
    with held_by_another_run(out), pytest.raises(UserError) as e:
        pt_eval.run_post_train(PostTrainConfig(out=str(out), no_eval=True))
    _one_line_refusal(e, out)


def test_post_training_lock_file_is_removed_after_an_exception(tmp_path, monkeypatch):
    monkeypatch.setattr(pt_eval, "load_model", _no_model)
    out = tmp_path / "pt"
    with pytest.raises(Loaded):
        pt_eval.run_post_train(PostTrainConfig(out=str(out), no_eval=True))
    assert out.is_dir() and not (out / OUTPUT_LOCK).exists()


def test_second_study_into_one_root_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path / "empty-cache"))
    sc = StudyConfig(models=["qwen2.5-coder-1.5b-instruct"], datasets=["gsm8k"], profile="quick",
                     root=str(tmp_path / "runs"), report_dir=str(tmp_path / "rep"), figures_dir=str(tmp_path / "fig"),
                     progress=False)
    with held_by_another_run(tmp_path / "runs"), pytest.raises(UserError) as e:
        run_study(sc)
    _one_line_refusal(e, tmp_path / "runs")
    with held_by_another_run(tmp_path / "rep"), pytest.raises(UserError) as e:
        report(sc)
    _one_line_refusal(e, tmp_path / "rep")
    report(sc)  # nothing held: writes the (empty) report and leaves no lock behind
    assert (tmp_path / "rep" / "README.md").exists() and not (tmp_path / "rep" / OUTPUT_LOCK).exists()
    with pytest.raises(UserError, match="every model failed"):  # an exception inside the lock
        run_study(sc)
    assert not (tmp_path / "runs" / OUTPUT_LOCK).exists() and not (tmp_path / "rep" / OUTPUT_LOCK).exists()


def test_lock_file_is_removed_on_a_clean_exit_and_a_stale_file_does_not_block(tmp_path):
    (tmp_path / OUTPUT_LOCK).write_text("pid 1, crashed")  # left by a killed run: no flock on it
    with output_dir_lock(tmp_path, "study", "--root") as lock:
        assert lock.exists()
        with pytest.raises(UserError, match="in use by another study run"):
            with output_dir_lock(tmp_path, "study", "--root"):
                pass
    assert not lock.exists()
