"""``scripts/judge_table_rows.py``: the docs' rows of one test round, each kappa bound to its findings key, ordered
per model strict then lenient; an unknown round is one clear error naming the rounds there are."""

from __future__ import annotations

import pytest

from tests.script_loader import load_script

rt = load_script("scripts/judge_table_rows.py")


def _r(judge, model, reading, split="test_g", dataset="all", kappa=0.5):
    return {"judge": judge, "model": model, "reading": reading, "split": split, "dataset": dataset,
            "kappa": kappa, "lo": 0.25, "hi": 0.755, "agree": 9, "n": 10, "items": 5, "judge_genuine": 3,
            "labellers_genuine": 2, "finding": f"judge_table.{judge}.{model}.{dataset}.{reading}.{split}"}


def test_rows_are_bound_and_ordered():
    table = {"rows": [_r("b", "m1", "lenient"), _r("a", "m1", "strict"), _r("b", "m1", "strict"),
                      _r("a", "m0", "lenient", kappa=None), _r("a", "m1", "strict", dataset="gsm8k"),
                      _r("a", "m1", "strict", split="test_other")]}
    rows = rt.rows_of(table, "test_g", ["b", "a"])
    assert [r.split("|")[1:4] for r in rows] == [[" m0 ", " lenient ", " `a` "], [" m1 ", " strict ", " `b` "],
                                                 [" m1 ", " strict ", " `a` "], [" m1 ", " lenient ", " `b` "]]
    assert "0.50 [0.25, 0.76] (9/10 agree)<!-- =judge_table.b.m1.all.strict.test_g -->" in rows[1]
    assert "n/a (9/10 agree)" in rows[0]
    assert rt.rows_of(table, "test_g", ["a"]) == [rows[0], rows[2]]


def test_unknown_round_names_the_rounds():
    with pytest.raises(SystemExit, match="groups: test_g"):
        rt.rows_of({"rows": [_r("a", "m", "strict")]}, "test_nope", None)
