"""Numbers far past float range (a small model repeating one digit) must not stop the offline judge.

Why: one user turn or answer holding a run of 309+ digits made ``float`` overflow (and past 4300 digits
``int`` refuse the string); the judge died on that row, nothing was saved and every re-run died there again.
"""

from __future__ import annotations

import pytest

from mechprobe.judges.base import JudgeInput
from mechprobe.judges.offline import OfflineJudge, content_tokens, salient

HUGE = ["7" * 320, "1" * 400, "9" * 5000, "1" * 310 + ".5", "1,000" + ",000" * 120]


@pytest.mark.parametrize("digits", HUGE, ids=lambda d: f"{len(d)}chars")
def test_salient_and_tokens_take_huge_numbers(digits):
    s = salient(f"The answer is {digits} apples.")
    assert len(s.numbers) == 1
    (n,) = s.numbers
    assert n.replace(".", "").isdigit() and len(n) >= 300  # kept exactly, not rounded to a float
    assert n in s.strong  # a long number is specific, never "chance"
    assert content_tokens(f"so {digits}") == [n]


def test_huge_numbers_keep_their_identity():
    """Two different huge numbers stay different; the same number written with commas stays the same."""
    a, b = salient("1" * 400).numbers, salient("1" * 399 + "2").numbers
    assert a != b
    assert salient("1" + ",000" * 120).numbers == salient("1" + "000" * 120).numbers


@pytest.mark.parametrize("where", ["turn", "response", "prompt"])
def test_offline_judge_labels_a_row_with_a_huge_number(where):
    text = {"prompt": "How many clips did Natalia sell?", "response": "She sold 72 clips.",
            "turn": "Why 72?"}
    text[where] = text[where] + " " + "7" * 320 + " " + "3" * 5000
    inputs = [JudgeInput(record_id="r0", prompt=text["prompt"], response=text["response"], raw_text=text["turn"]),
              JudgeInput(record_id="r1", prompt="Q?", response="A.", raw_text="Why 72?")]
    got = list(OfflineJudge(embed=False).label_many(inputs))
    assert [r.record_id for r in got] == ["r0", "r1"]
    assert all(r.label for r in got)


def test_small_numbers_normalise_as_before():
    assert salient("1,200 and 3.50 and 3.0 and 45%").numbers == {"1200", "3.5", "3", "45"}
