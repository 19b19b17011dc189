"""A judge cache entry holding NaN (or garbage) is a miss, never a verdict: the turn is recomputed and the entry
overwritten, so a judge run neither writes NaN nor stops half-way."""

from __future__ import annotations

import json
import math

import pytest

from mechprobe.io import dumps_row, read_jsonl
from mechprobe.judges.base import inputs_from_rows
from mechprobe.judges.hybrid import HybridJudge
from mechprobe.judges.llm import JudgeCache
from tests.conftest import REPO, requires_smollm2

FIXTURE = REPO / "tests" / "fixtures" / "hand_labels.jsonl"


@pytest.mark.parametrize("text", ['{"pmi": NaN}', '{"scores": [Infinity, 0.0]}', '[1, 2]', '{"label": "x", '])
def test_unusable_entry_is_a_miss(tmp_path, text):
    cache = JudgeCache(tmp_path)
    p = cache._path("abcdef")
    p.parent.mkdir(parents=True)
    p.write_text(text)
    assert cache.get("abcdef") is None


def test_non_finite_value_is_never_stored(tmp_path):
    cache = JudgeCache(tmp_path)
    cache.put("abcdef", {"pmi": float("nan")})
    assert cache.get("abcdef") is None
    cache.put("abcdef", {"pmi": 0.25})
    assert cache.get("abcdef") == {"pmi": 0.25}


@requires_smollm2
def test_hybrid_judge_recomputes_a_poisoned_cache(smol, tmp_path):
    rows = [r for r in read_jsonl(FIXTURE) if r["split"] == "dev"][:3]
    first = list(HybridJudge(loaded=smol, cache_dir=tmp_path / "c").label_many(inputs_from_rows(rows)))
    entries = sorted((tmp_path / "c").rglob("*.json"))
    assert entries
    for e in entries:  # every cached score becomes NaN, as a bad write or a hand edit would leave it
        d = json.loads(e.read_text())
        e.write_text(json.dumps({k: float("nan") for k in d}))
    again = list(HybridJudge(loaded=smol, cache_dir=tmp_path / "c").label_many(inputs_from_rows(rows)))
    assert [r.label for r in again] == [r.label for r in first]
    for r in again:
        assert all(math.isfinite(v) for v in r.probs.values())
        dumps_row(r.to_dict())  # what labels.jsonl gets: refuses NaN
    assert all("NaN" not in e.read_text() for e in entries)  # recomputed values replaced the entries
