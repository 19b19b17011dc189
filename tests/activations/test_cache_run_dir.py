"""`cache` on a run it cannot write (read-only, a file, a symlink loop) is one line, before the model loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from mechprobe.errors import UserError
from tests.judges.test_judge_stage import make_run


def _writable(d) -> bool:
    try:
        fd, p = tempfile.mkstemp(dir=d)
    except OSError:
        return False
    os.close(fd)
    os.unlink(p)
    return True


@pytest.fixture
def read_only_run(tmp_path):
    """A run directory nobody can write: mode 0555, and for root (who ignores modes) the immutable flag."""
    run = make_run(tmp_path)
    run.chmod(0o555)
    immutable = False
    if _writable(run) and shutil.which("chattr"):
        immutable = subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode == 0
    if _writable(run):
        run.chmod(0o755)
        pytest.skip("cannot make a directory read-only here (root without chattr)")
    yield run
    if immutable:
        subprocess.run(["chattr", "-i", str(run)], check=False)
    run.chmod(0o755)


@pytest.fixture
def no_model(monkeypatch):
    import mechprobe.activations.build as build

    def refuse(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(build, "run_model", refuse)


def test_read_only_run_is_refused_before_the_model_loads(read_only_run, no_model):
    from mechprobe.activations.cache import cache_run

    with pytest.raises(UserError, match="not writable") as e:
        cache_run(read_only_run)
    assert "\n" not in str(e.value) and not (read_only_run / "activations").exists()


def test_cache_cli_on_a_read_only_run_exits_2(read_only_run, no_model, capsys):
    from mechprobe.cli.main import main

    assert main(["cache", str(read_only_run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(read_only_run) in err and len(err.splitlines()) == 1


def test_symlink_loop_run(tmp_path, no_model):
    from mechprobe.activations.cache import cache_run

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(UserError, match="cannot be resolved"):
        cache_run(loop)
