"""Every public function and class of ``mechprobe`` documents its arguments, result and use, and its examples run.

Why a test: the public names are what notebooks import; a docstring without ``Args:`` or with an
example that no longer runs misleads silently. Examples that need a real model or run directory carry
``# doctest: +SKIP`` on each such line; everything else (tiny models, small tensors, records) runs here.
"""

from __future__ import annotations

import doctest
import inspect

import pytest

import mechprobe

PUBLIC = sorted(n for n in mechprobe.__all__
                if inspect.isclass(getattr(mechprobe, n)) or inspect.isfunction(getattr(mechprobe, n)))
FUNCTIONS = [n for n in PUBLIC if inspect.isfunction(getattr(mechprobe, n))]


def _returns_none(fn) -> bool:
    return inspect.signature(fn).return_annotation in (None, "None")


def test_public_names_are_found():
    # Guard against the filter above silently dropping everything (e.g. after a wrapper change).
    assert {"SteeringVector", "ActivationCache", "steer", "diff_of_means", "tiny_model"} <= set(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_has_sections(name):
    obj = getattr(mechprobe, name)
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    assert "Example" in doc, f"{name}: docstring lacks an Example section"
    if inspect.isclass(obj):
        assert "Args:" in doc or "Attributes:" in doc, f"{name}: class docstring lacks Args: or Attributes:"
        return
    if inspect.signature(obj).parameters:
        assert "Args:" in doc, f"{name}: docstring lacks Args:"
        if not _returns_none(obj):
            assert "Returns:" in doc, f"{name}: docstring lacks Returns:"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_args_name_every_parameter(name):
    fn = getattr(mechprobe, name)
    doc = inspect.getdoc(fn) or ""
    args = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    for p in inspect.signature(fn).parameters.values():
        label = {p.VAR_KEYWORD: f"**{p.name}", p.VAR_POSITIONAL: f"*{p.name}"}.get(p.kind, p.name)
        assert f"{label}:" in args, f"{name}: Args: does not describe parameter {label!r}"


@pytest.mark.parametrize("name", PUBLIC)
def test_examples_run(name):
    obj = getattr(mechprobe, name)
    tests = doctest.DocTestFinder().find(obj, f"mechprobe.{name}")
    assert any(t.examples for t in tests), f"{name}: no >>> example found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for t in tests:
        runner.run(t, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed\n" + "".join(report)
