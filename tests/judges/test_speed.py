"""Judge timing: every timed turn is labelled, the warm-up is not timed, and judges are built without their
verdict cache (a cached verdict costs nothing, so a timing with the cache on measures the cache)."""

from __future__ import annotations

from pathlib import Path

from mechprobe.judges import speed
from mechprobe.judges.base import JudgeInput
from mechprobe.records import LabelRecord


class _Counting:
    def __init__(self):
        self.seen = []

    def label_many(self, inputs):
        for inp in inputs:
            self.seen.append(inp.record_id)
            yield LabelRecord(record_id=inp.record_id, label="new_query", genuine=False, rationale="", judge="c")


def test_speed_times_all_but_the_warm_up_turn_and_names_the_cpu():
    judges = {}
    inputs = [JudgeInput(f"r{i}", "q", "a", "t") for i in range(4)]
    rows = speed.measure_speed(["a", "b"], inputs, make=lambda s: judges.setdefault(s, _Counting()), note="x")
    assert [r["judge"] for r in rows] == ["a", "b"] and all(r["turns"] == 3 for r in rows)
    assert judges["a"].seen == ["r0", "r1", "r2", "r3"]
    assert rows[0]["cpu"] == speed.cpu_description() and " cores" in rows[0]["cpu"] and rows[0]["note"] == "x"


def test_judges_are_timed_without_their_verdict_cache(monkeypatch):
    built = []
    monkeypatch.setattr(speed, "make_judge", lambda spec, **kw: built.append((spec, kw)) or _Counting())
    speed.measure_speed(["hybrid-voice:m"], [JudgeInput("r0", "q", "a", "t"), JudgeInput("r1", "q", "a", "t")])
    assert built == [("hybrid-voice:m", {"cache_dir": False})]


def _answers(n_answers, per_answer):
    return [JudgeInput(f"a{a}t{t}", f"q{a}", f"answer {a}", f"turn {t}") for a in range(n_answers)
            for t in range(per_answer)]


def test_one_turn_per_answer_times_distinct_answers_after_a_warm_up_of_its_own():
    got = speed.speed_sample(_answers(10, 4), 5)
    assert len(got) == 6 and speed.answers_in(got) == 6
    assert (got[0].prompt, got[0].response) not in {(t.prompt, t.response) for t in got[1:]}


def test_whole_answers_keep_every_turn_of_an_answer_together():
    got = speed.speed_sample(_answers(10, 4), 6, whole_answers=True)
    timed = got[1:]
    assert len(timed) == 8 and speed.answers_in(timed) == 2  # two whole answers reach 6 timed turns
    assert (got[0].prompt, got[0].response) not in {(t.prompt, t.response) for t in timed}


def test_a_short_pool_gives_what_it_has():
    assert speed.speed_sample([], 5) == []
    assert len(speed.speed_sample(_answers(3, 1), 10)) == 3


def test_a_mistyped_speed_source_is_refused_before_any_work(tmp_path, monkeypatch):
    import pytest

    from mechprobe.errors import UsageError
    from mechprobe.judges import judge_eval

    def no_features(*a, **kw):
        raise AssertionError("features computed before the speed source was checked")
    monkeypatch.setattr(judge_eval, "cached_features", no_features)
    root = Path(__file__).resolve().parents[2]
    cfg = judge_eval.JudgeEvalConfig(root=str(root), out=str(tmp_path / "out"), speed_turns=5,
                                     speed_source="judge_fresh_test_v99")
    with pytest.raises(UsageError, match="speed_source='judge_fresh_test_v99' holds no labelled turn"):
        judge_eval.run_judge_eval(cfg)
    assert not (tmp_path / "out").exists()


def test_a_timing_note_says_what_was_timed(monkeypatch):
    monkeypatch.setattr(speed, "make_judge", lambda spec, **kw: _Counting())
    rows = speed.time_turns(["j"], _answers(10, 4), 6, whole_answers=True, where="turns of set-x")
    assert rows[0]["turns"] == 8 and rows[0]["note"].startswith("8 turns of set-x (2 answers, every turn of each)")
    one = speed.time_turns(["j"], _answers(10, 4), 6)[0]["note"]
    assert one.startswith("6 turns (6 answers, one turn each) after 1 warm-up")
