"""``--out`` pointed at a directory that holds something else (a run's activation cache) is refused before the
model loads, without advice that would delete it.

Why: ``mechprobe probe --out RUN/activations`` loaded the model, then said "delete RUN/activations to start over",
which deletes a valid cache.
"""

from __future__ import annotations

import json

import pytest

from mechprobe.cli.main import main
from mechprobe.errors import UserError
from mechprobe.io import check_manifest


def _fake_cache(d):
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format": "mechprobe.activations.cache/1", "layers": [1, 2],
                                                 "model": "smollm2-135m-instruct"}))
    (d / "L1_boundary.safetensors").write_bytes(b"shard")


def test_probe_into_an_activation_cache_is_one_line_exit_2_and_keeps_it(tmp_path, capsys, monkeypatch):
    import mechprobe.turns.pipeline as pipeline

    cache = tmp_path / "o1" / "activations"
    _fake_cache(cache)
    before = {p.name: p.read_bytes() for p in cache.iterdir()}

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(pipeline, "load_generator", no_load)
    assert main(["probe", "--out", str(cache), "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a run" in err and "activation cache" in err
    assert "delete" not in err.lower()
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before


def test_check_manifest_never_advises_deleting_a_directory_that_is_not_a_run(tmp_path):
    cache = tmp_path / "o1" / "activations"
    _fake_cache(cache)
    with pytest.raises(UserError) as ei:
        check_manifest(cache, {"model": "m"})
    assert "delete" not in str(ei.value).lower() and "not a run" in str(ei.value)
