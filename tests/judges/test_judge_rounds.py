"""Each text-fit fit is scored once on the test items no earlier fit held; earlier fits stay scorable."""

from __future__ import annotations

import json

import pytest

from mechprobe.audit.blind_sets import BlindLabel, BlindSets, BlindTurn, query_item_key, split_of_item
from mechprobe.audit.judge_table import judge_table, round_group, round_groups
from mechprobe.errors import UsageError
from mechprobe.judges.judge_eval import archive_weights, archived_weights, fit_rounds
from mechprobe.judges.textfit import TEXTFIT_FEATURES, WEIGHTS_FORMAT, weights_digest
from mechprobe.taxonomy import GENUINE


def _w(version: str, bias: float) -> dict:
    n = len(TEXTFIT_FEATURES)
    w = {"format": WEIGHTS_FORMAT, "version": version, "features": list(TEXTFIT_FEATURES), "embed": False,
         "mean": [0.0] * n, "scale": [1.0] * n,
         "heads": {h: {"coef": [1.0] * n, "intercept": bias, "threshold": 0.5} for h in ("lenient", "strict")}}
    w["weights_sha256"] = weights_digest(w)
    return w


def _blind(queries: list[str]) -> BlindSets:
    turns = {f"t{i}": BlindTurn(f"t{i}", "s", "m", "d", query_item_key(q), "", q, "a", "u")
             for i, q in enumerate(queries)}
    labels = [BlindLabel(t, "s", "v2", who, GENUINE if i % 2 else "new_query", "yes" if i % 2 else None, False)
              for i, t in enumerate(turns) for who in ("labeller-a", "labeller-b")]
    return BlindSets(turns, labels, [])


def _test_queries(n: int, start: int = 0) -> list[str]:
    out, i = [], start
    while len(out) < n:
        q = f"query number {i}"
        if split_of_item(query_item_key(q)) == "test":
            out.append(q)
        i += 1
    return out


def test_a_refit_scores_once_only_the_test_items_no_earlier_fit_held(tmp_path):
    path = tmp_path / "rounds.json"
    first, later = _test_queries(4), _test_queries(3, start=10_000)
    r1 = fit_rounds(path, _w("v1", 0.0), _blind(first), record=True)
    assert [len(r["fresh_items"]) for r in r1] == [4]
    r2 = fit_rounds(path, _w("v2", 1.0), _blind(first + later), record=True)
    fresh = set(r2[1]["fresh_items"])
    assert fresh == {query_item_key(q) for q in later}
    assert round_groups(path) == {"test_v1": {query_item_key(q) for q in first}, "test_v2": fresh}
    # a labelled set added after v2's fit: v2 never saw it, so v2's round takes it in; v1's round stays frozen
    added = _test_queries(2, start=20_000)
    r3 = fit_rounds(path, _w("v2", 1.0), _blind(first + later + added), record=False)
    assert len(r3) == 2 and set(r3[1]["fresh_items"]) == fresh | {query_item_key(q) for q in added}
    assert set(r3[0]["fresh_items"]) == {query_item_key(q) for q in first}
    # weights that are not the newest fit (e.g. from elsewhere) record nothing
    assert fit_rounds(path, _w("v0", 5.0), _blind(first + later + added), record=False) == r3


def test_round_groups_become_table_splits(tmp_path):
    qs = _test_queries(4)
    b = _blind(qs)
    from mechprobe.audit.blind_sets import JudgeVerdict
    verdicts = [JudgeVerdict(t, "j", None, True, "") for t in b.turns]
    group = {query_item_key(qs[0]), query_item_key(qs[1])}
    rows = judge_table(b, verdicts, splits=("test",), readings=("lenient",), n_boot=20, groups={"test_v9": group})
    by = {r["split"]: r for r in rows if r["dataset"] == "all"}
    assert by["test"]["n"] == 4 and by["test_v9"]["n"] == 2
    assert by["test_v9"]["finding"].endswith(".lenient.test_v9")
    assert round_group({"weights": "textfit-v2"}) == "test_textfit-v2"


def test_a_bad_rounds_file_is_one_clear_error(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"rounds": [{"weights": "v1"}]}))
    with pytest.raises(UsageError, match="not a rounds file"):
        round_groups(f)
    assert round_groups(tmp_path / "missing.json") == {}


def test_replaced_weights_are_archived_and_scored_under_their_version(tmp_path):
    old, new = _w("textfit-v1", 0.0), _w("textfit-v2", 1.0)
    archive_weights(tmp_path, old)
    archive_weights(tmp_path, old)  # idempotent
    assert [w["version"] for w in archived_weights(tmp_path, new)] == ["textfit-v1"]
    assert archived_weights(tmp_path, old) == []  # the current fit is never scored twice
    # the hidden-state judge's archived fits share the folder and are not text-fit weights: skipped, not refused
    (tmp_path / "weights" / "hidden_some-reader_hidden-v1.json").write_text(json.dumps({"format": "other"}))
    assert [w["version"] for w in archived_weights(tmp_path, new)] == ["textfit-v1"]


def test_a_hidden_fit_followed_by_later_rounds_gets_every_item_it_never_saw(tmp_path):
    rounds = [{"weights": "textfit-v2", "fresh_items": ["a"]}, {"weights": "hidden:r@v4", "fresh_items": ["b"]},
              {"weights": "hidden:r@v5", "fresh_items": ["c", "d"]}, {"weights": "hidden:r@v6", "fresh_items": ["e"]}]
    f = tmp_path / "rounds.json"
    f.write_text(json.dumps({"rounds": rounds}))
    groups = round_groups(f)
    assert groups["since_hidden:r@v4"] == {"b", "c", "d", "e"} and groups["since_hidden:r@v5"] == {"c", "d", "e"}
    assert "since_hidden:r@v6" not in groups  # no later round: the same items as its own round
    assert "since_textfit-v2" not in groups  # only the hidden-state lineage
    assert groups["test_hidden:r@v5"] == {"c", "d"}
