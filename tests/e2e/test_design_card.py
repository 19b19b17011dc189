"""The design card's two commands, exactly as a new user types them, in a fresh clone.

    python3 experiments/linear_probe.py
    python3 experiments/steer.py --alpha 4

Why a copy of the tree and not this checkout: a new user has no ``runs/`` from earlier sessions, no editable
install pointing elsewhere and (in the fallback variant) no ``../shared`` beside the clone, so the default
dataset is the builtin one. The copy holds every file git tracks or would track (``git ls-files --cached
--others --exclude-standard``), so the test exercises this working tree's code, uncommitted changes included,
and it is made a git repository of its own like a clone. The scripts put the clone first on ``sys.path``
themselves, so the clone's package is the one imported (checked below).

The with-shared variant puts a ``shared`` link beside the clone pointing at the real ``shared`` folder (found
upwards from this repository, as the package finds it); without one it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, requires_smollm2, shared_data_dir

pytestmark = [pytest.mark.slow, requires_smollm2]

COMMANDS = (["experiments/linear_probe.py"], ["experiments/steer.py", "--alpha", "4"])


def _fresh_clone(parent: Path) -> Path:
    """This working tree's tracked and trackable files, copied into ``parent/mechprobe`` and committed there."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    clone = parent / "mechprobe"
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():  # a tracked file deleted in the working tree is gone from the clone too
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / f)
    git = ["git", "-c", "user.name=e2e", "-c", "user.email=e2e@example.invalid"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fresh clone"]):
        subprocess.run([*git, *cmd], cwd=clone, check=True, capture_output=True)
    return clone


def _env() -> dict[str, str]:
    """The user's environment minus anything that points the commands at data or code outside the clone."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MECHPROBE_DATA_DIR")}
    return {**env, "HF_HUB_OFFLINE": "1"}


def _tail(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout (tail)\n{p.stdout[-3000:]}\n--- stderr (tail)\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("with_shared", [False, True], ids=["builtin-fallback", "with-shared"])
def test_design_card_commands_on_a_fresh_clone(tmp_path: Path, with_shared: bool) -> None:
    if with_shared:
        data = shared_data_dir()
        if data is None:
            pytest.skip("no shared/data beside this repository (or above it): the with-shared variant needs one")
        (tmp_path / "shared").symlink_to(data.parent.resolve(), target_is_directory=True)
    elif any((base / "shared").exists() for base in tmp_path.parents):
        pytest.skip(f"a shared folder sits above {tmp_path}, so no clone there can be without ../shared")
    clone = _fresh_clone(tmp_path)
    env = _env()
    where = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); import mechprobe; "
                            "print(mechprobe.__file__)"], cwd=clone, env=env, capture_output=True, text=True)
    assert Path(where.stdout.strip()).resolve().is_relative_to(clone.resolve()), _tail(where)
    seconds = {}
    for cmd in COMMANDS:
        t0 = time.time()
        p = subprocess.run([sys.executable, *cmd], cwd=clone, env=env, capture_output=True, text=True)
        seconds[" ".join(cmd)] = round(time.time() - t0, 1)
        assert p.returncode == 0, f"python3 {' '.join(cmd)}: " + _tail(p)
        assert "Traceback" not in p.stderr, _tail(p)
    print(f"\n[{'with-shared' if with_shared else 'builtin-fallback'}] wall seconds: {json.dumps(seconds)}")
    runs = [r for r in (clone / "runs").iterdir() if r.is_dir()]
    assert len(runs) == 1, f"both commands must use one default run, got {runs}"
    run = runs[0]
    assert run.name.endswith("-gsm8k" if with_shared else "-builtin"), run.name
    for fig in (run / "figures" / f"linear_probe_{run.name}.png", run / "figures" / f"steer_{run.name}.png"):
        assert fig.is_file() and fig.stat().st_size > 10_000, fig
    res = json.loads((run / "steering" / "results.json").read_text())
    assert res["heldout"] and (run / "steering" / "results.md").is_file()
