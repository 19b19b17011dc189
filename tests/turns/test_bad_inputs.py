"""The probe stage refuses, in one line and before any model loads, a dataset file that is not UTF-8 and an
``--out`` it cannot write (a file, a symlink loop)."""

from __future__ import annotations

import gzip

import pytest

from mechprobe.errors import UserError
from mechprobe.turns.datasets import load_dataset


@pytest.fixture
def no_model(monkeypatch):
    import mechprobe.turns.pipeline as pipeline

    def refuse(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(pipeline, "load_generator", refuse)


@pytest.mark.parametrize("gz", [False, True])
def test_dataset_file_that_is_not_utf8(tmp_path, gz):
    rows = b'{"question": "What is 1+1?", "answer": "#### 2"}\n' * 3 + b'{"question": "caf\xe9?", "answer": "#### 1"}\n'
    p = tmp_path / ("test.jsonl.gz" if gz else "test.jsonl")
    p.write_bytes(gzip.compress(rows) if gz else rows)
    with pytest.raises(UserError, match="not UTF-8") as e:
        load_dataset("gsm8k", path=p)
    msg = str(e.value)
    assert f"{p}:4" in msg and "iconv" in msg and "\n" not in msg


def test_json_object_dataset_that_is_not_utf8(tmp_path):
    p = tmp_path / "test.json"
    p.write_bytes(b'{"c1": {"content": [{"message": "ol\xe1"}]}}')
    with pytest.raises(UserError, match="not UTF-8"):
        load_dataset("topical_chat", path=p)


def _probe(argv):
    from mechprobe.cli.main import main

    return main(["probe", "--dataset", "builtin", "--limit", "1", *argv])


def test_probe_out_that_is_a_file(tmp_path, capsys, no_model):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    assert _probe(["--out", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a file" in err and len(err.splitlines()) == 1
    assert f.read_text() == "keep me"


def test_probe_out_under_a_file_or_a_loop(tmp_path, capsys, no_model):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for out in (f / "run", loop):
        assert _probe(["--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "--out" in err and len(err.splitlines()) == 1
