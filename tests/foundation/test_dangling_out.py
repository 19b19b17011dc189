"""An output path that is a dangling symlink (or lies under one) is refused before anything runs.

Why: ``--out`` pointing at a symlink whose target is gone passed the writability check (it does not "exist"),
the model loaded, then ``mkdir`` died with ``FileExistsError`` (a traceback, exit 1).
"""

from __future__ import annotations

import pytest

from mechprobe.errors import UsageError
from mechprobe.io import check_writable_dir, output_dir_lock


@pytest.fixture
def dangling(tmp_path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone" / "target")
    return link


@pytest.mark.parametrize("sub", ["", "inner/deeper"])
def test_check_writable_dir_refuses_a_dangling_symlink(dangling, sub):
    p = dangling / sub if sub else dangling
    with pytest.raises(UsageError, match="symlink") as ei:
        check_writable_dir(p, "--out")
    msg = str(ei.value)
    assert "--out" in msg and str(dangling) in msg and "\n" not in msg
    assert not (dangling.parent / "gone").exists()


def test_output_dir_lock_refuses_a_dangling_symlink(dangling):
    with pytest.raises(UsageError, match="symlink"), output_dir_lock(dangling, "post-training", "--out"):
        pass


def test_a_symlink_to_a_directory_is_still_fine(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert check_writable_dir(tmp_path / "link", "--out") == tmp_path / "link"
    assert check_writable_dir(tmp_path / "link" / "new", "--out") == tmp_path / "link" / "new"


def test_probe_with_a_dangling_out_is_one_line_exit_2_before_the_model_loads(dangling, capsys, monkeypatch):
    import mechprobe.turns.pipeline as pipeline
    from mechprobe.cli.main import main

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(pipeline, "load_model", no_load, raising=False)
    assert main(["probe", str(dangling), "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "symlink" in err and len(err.splitlines()) == 1
    assert dangling.is_symlink() and not (dangling.parent / "gone").exists()  # nothing created, nothing lost
