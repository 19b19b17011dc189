"""Every docstring example in the package runs and shows what it says (illustrative ones that need a run or a
model on disk are marked ``# doctest: +SKIP``). Why a test: an example that no longer runs is worse than none."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mechprobe

MODULES = sorted(m.name for m in pkgutil.walk_packages(mechprobe.__path__, "mechprobe.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False,
                          report=False)
    assert res.failed == 0, f"{name}: {res.failed} of {res.attempted} docstring examples fail; run pytest " \
                            f"--doctest-modules {name.replace('.', '/')}.py to see them"
