"""The turn table reads a real run (probe + steering layout); the sample is stratified, recorded and reused."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mechprobe.audit import draw_sample, load_or_draw, load_run_table
from mechprobe.errors import UsageError
from mechprobe.io import read_json

from .run_fixture import CONDITION_NAMES, build_run


@pytest.fixture()
def run(tmp_path):
    build_run(tmp_path)
    return tmp_path


def test_table_reads_probe_and_steering_turns(run):
    t = load_run_table(run)
    counts = Counter(r.condition for r in t.rows)
    assert counts == {"probe": 12, **dict.fromkeys(CONDITION_NAMES.values(), 16)}
    assert set(t.judges) == {"hand-D", "hybrid:test"}
    r = t.get("steering/alpha_0_none.jsonl#gsm8k-0185")
    assert r.query.startswith("Jenna and her mother") and r.turn.endswith("<|im_end|>")
    assert Counter(r.decoding for r in t.rows)["T1"] == 8
    assert set(t.sources) >= {"assistant.jsonl", "labels.jsonl", "steering/alpha_0_none.jsonl"}


def test_sample_is_stratified_seeded_and_coordinated(run):
    t = load_run_table(run)
    s = draw_sample(t, 20, "condition", seed=3, turns_per_item=0)
    assert sum(s.per_stratum.values()) == 20 and set(s.per_stratum.values()) == {5}
    assert draw_sample(t, 20, "condition", seed=3, turns_per_item=0) == s
    assert draw_sample(t, 20, "condition", seed=4, turns_per_item=0).record_ids != s.record_ids
    steered = {c: {t.get(r).item_id for r in s.record_ids if t.get(r).condition == c}
               for c in CONDITION_NAMES.values()}
    # one seeded item order for every stratum: the conditions of a steering run are audited on the same items
    assert steered["none"] == steered["diff_means|L14|a0.8"] == steered["random|L14|a0.8"]
    # a stratum smaller than its share gives all it has, the rest goes to the others
    s2 = draw_sample(t, 60, "condition", seed=0, turns_per_item=0)
    assert s2.per_stratum["probe"] == 12 and sum(s2.per_stratum.values()) == 60


def _per_item(t, s, by="condition"):
    return Counter((t.get(r).stratum(by), t.get(r).item_id) for r in s.record_ids)


def test_sample_takes_at_most_one_turn_per_item_and_stratum_by_default(run):
    """The probe stratum holds 3 turns of each of its 4 items; the default draw takes one of each, spreads the
    audit over items, and gives the rest of the probe's share to the other strata."""
    t = load_run_table(run)
    for n, by in ((20, "condition"), (60, "condition"), (24, "decoding"), (40, "condition+decoding")):
        s = draw_sample(t, n, by, seed=1)
        assert max(_per_item(t, s, by).values()) == 1, (n, by)
        assert s.turns_per_item == 1
    s = draw_sample(t, 60, "condition", seed=0)
    assert s.per_stratum["probe"] == 4 and sum(s.per_stratum.values()) == 52  # 4 + 3 x 16: every item once
    # a larger limit takes every item's first turn before any item's second
    s2 = draw_sample(t, 20, "condition", seed=0, turns_per_item=2)
    probe = Counter(t.get(r).item_id for r in s2.record_ids if t.get(r).condition == "probe")
    assert s2.per_stratum["probe"] == 5 and sorted(probe.values()) == [1, 1, 1, 2]  # all 4 items before a repeat
    with pytest.raises(UsageError, match="turns_per_item="):
        draw_sample(t, 10, "condition", turns_per_item=-1)


def test_old_samples_without_a_limit_are_reused(run):
    """A sample.json written before the per-item limit (whole items) keeps its labels: it is reused, and reads
    as codebook v1."""
    t = load_run_table(run)
    s, _ = load_or_draw(run, t, 20, "condition", 0, turns_per_item=0)
    rec = read_json(run / "audit" / "sample.json")
    for k in ("turns_per_item", "codebook_version"):
        rec.pop(k)
    (run / "audit" / "sample.json").write_text(json.dumps(rec))
    old, drawn = load_or_draw(run, t, 20, "condition", 0)
    assert not drawn and old.record_ids == s.record_ids and old.sample_id == s.sample_id
    assert old.turns_per_item is None and old.codebook_version == "v1"


def test_sample_recorded_reused_and_refused(run):
    t = load_run_table(run)
    s, drawn = load_or_draw(run, t, 20, "condition", 0)
    assert drawn
    rec = read_json(run / "audit" / "sample.json")
    assert rec["record_ids"] == list(s.record_ids) and rec["labels_sha256"] == t.labels_sha256
    assert rec["judges"] == ["hand-D", "hybrid:test"] and rec["seed"] == 0 and rec["by"] == "condition"
    again, drawn = load_or_draw(run, t, 20, "condition", 0)
    assert not drawn and again == s
    with pytest.raises(UsageError, match="redraw=True"):
        load_or_draw(run, t, 24, "condition", 0)
    new, drawn = load_or_draw(run, t, 24, "decoding", 0, redraw=True)
    assert drawn and new.by == "decoding" and new.sample_id != s.sample_id
    with pytest.raises(UsageError, match="stratum"):
        draw_sample(t, 10, "model")


def test_condition_by_decoding_separates_greedy_and_sampled_probe_turns(run):
    """A steering run's probe turns are one condition ("probe"); crossed with decoding, greedy and sampled probe
    turns get their own strata (so greedy-vs-sampled is audited beside the steered conditions)."""
    t = load_run_table(run)
    strata = t.strata("condition+decoding")
    probe = {k: len(v) for k, v in strata.items() if k.startswith("probe ")}
    assert probe == {"probe greedy": 4, "probe T1": 8}
    assert len(strata["none greedy"]) == 16
    s = draw_sample(t, 24, "condition+decoding", seed=0)
    assert set(s.per_stratum) == set(strata) and sum(s.per_stratum.values()) == 24
    assert {t.get(r).stratum("condition+decoding") for r in s.record_ids} == set(strata)


def test_steered_items_of_a_fixed_split_get_their_answers_from_split_answers(run):
    """Held-out items of a committed split are answered under <steer dir>/split_answers/, not in the run's own
    assistant.jsonl: the table must read them there, or every steered turn of those items is skipped."""
    before = load_run_table(run)
    steered = {r.item_id for r in before.rows if r.condition != "probe"}
    probe_items = {r.item_id for r in before.rows if r.condition == "probe"}
    moved = sorted(steered - probe_items)[:5]
    lines = (run / "assistant.jsonl").read_text().splitlines()
    keep = [x for x in lines if json.loads(x)["item_id"] not in moved]
    (run / "assistant.jsonl").write_text("\n".join(keep) + "\n")
    assert load_run_table(run).skipped > before.skipped  # without the split answers those turns are lost
    (run / "steering" / "split_answers").mkdir()
    (run / "steering" / "split_answers" / "assistant.jsonl").write_text(
        "\n".join(x for x in lines if json.loads(x)["item_id"] in moved) + "\n")
    after = load_run_table(run)
    assert len(after) == len(before) and after.skipped == before.skipped
    assert "steering/split_answers/assistant.jsonl" in after.sources
