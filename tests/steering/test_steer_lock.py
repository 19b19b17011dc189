"""Two ``steer`` commands on one steering directory: the second is refused (one line naming the directory) while the
first holds the directory's writer lock, and the lock file is gone after a clean exit or an exception.

Two threads run the real driver (:func:`mechprobe.steering.experiment.steer_experiment`) on a tiny run directory;
run resolution and the stage checks are stubbed (no model), and the steer stage proper (``_steer``) is replaced by
a function that holds the first thread inside the stage until the second has tried, so the overlap is certain.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import mechprobe.steering.experiment as exp
from mechprobe.errors import UserError
from mechprobe.io import writer_lock
from mechprobe.steering.config import SteerConfig


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A run directory and a driver whose steer stage reports who entered it and waits for ``release``."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = SimpleNamespace(model="smollm2-135m-instruct", dataset="builtin", engine="hf", max_user_tokens=8)
    monkeypatch.setattr(exp, "resolve_run", lambda *a, **k: (run, cfg))
    monkeypatch.setattr(exp, "ensure_stages", lambda *a, **k: None)
    monkeypatch.setattr(exp, "Stages", lambda *a, **k: None)
    entered, release = threading.Event(), threading.Event()
    state = SimpleNamespace(entered=entered, release=release, calls=0, fail=False)

    def stage(a, run_, cfg_, out_dir, *rest):
        state.calls += 1
        if state.calls > 1 and not release.is_set():
            return "second writer"  # two commands inside the stage at once: what the lock must prevent
        entered.set()
        assert release.wait(30)
        if state.fail:
            raise RuntimeError("stage failed")
        return "done"

    monkeypatch.setattr(exp, "_steer", stage)
    return SimpleNamespace(run=run, state=state)


def _config(run) -> SteerConfig:
    return SteerConfig(run=str(run), judge="offline", steer_engine="hf", alpha=[0.0, 0.1], kinds="diff_means")


@pytest.mark.parametrize("fail", [False, True])
def test_second_steer_on_the_same_directory_is_refused_and_no_lock_lingers(tiny, fail):
    steering = tiny.run / "steering"
    lock = tiny.run / "steering.lock"
    tiny.state.fail = fail
    out: dict[str, object] = {}

    def first() -> None:
        try:
            out["first"] = exp.steer_experiment(_config(tiny.run))
        except BaseException as e:  # noqa: BLE001 - the test reads it below
            out["first"] = e

    t = threading.Thread(target=first)
    t.start()
    try:
        assert tiny.state.entered.wait(30), "the first steer never reached the steer stage"
        with pytest.raises(UserError) as err:
            exp.steer_experiment(_config(tiny.run))
        msg = str(err.value)
        assert "\n" not in msg and str(steering) in msg and "another process" in msg
        assert tiny.state.calls == 1  # the second never entered the stage
        assert lock.exists()  # the refused command left the holder's lock alone
    finally:
        tiny.state.release.set()
        t.join(30)
    assert isinstance(out["first"], RuntimeError) if fail else out["first"] == "done"
    assert not lock.exists(), "the lock file lingers after the steer command ended"
    assert sorted(p.name for p in tiny.run.iterdir()) == ["steering"]
    # The directory is free again: a later steer runs.
    tiny.state.fail = False
    assert exp.steer_experiment(_config(tiny.run)) == "done" and not lock.exists()


def test_removing_lock_hands_over_to_a_writer_that_opened_the_old_file(tmp_path):
    """A writer whose lock file was removed under it by the previous holder locks the new file, never the old one."""
    target = tmp_path / "steering"
    with writer_lock(target, remove=True) as lock:
        assert lock.exists()
        with pytest.raises(UserError, match="being written by another process"):
            with writer_lock(target, remove=True):
                pass
    assert not lock.exists()
    with writer_lock(target, remove=True), pytest.raises(UserError):
        with writer_lock(target, remove=True):
            pass
    assert not lock.exists()
