"""The stock-turn detector: narrow (questions are never templates) and it finds the steered template."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mechprobe.turns.stock_turns import template_kind, template_share

FIX = Path(__file__).parents[1] / "fixtures" / "hand_labels_steer2_q15.jsonl"


@pytest.mark.parametrize("text,kind", [
    ("I see, I can now calculate the total cost for the year. Thank you for your help.<|im_end|>", "ack_plan"),
    ("I see. Now, I can calculate the number of pieces Poppy's mom places. Let's do that.", "ack_plan"),
    ("Thank you for your help. Could you please provide the final answer?<|im_end|>", "final_answer_request"),
    ("I see, I can now calculate the total number of pets: 3 * 6 = 18 pets. Is that correct?", None),
    ("I see that the cost of the fifth glass is $1.08. Is there a way to calculate the sixth?", None),
    ("I see, I got it. Thank you for your help.<|im_end|>", None),
    ("What if we assume there are 3 bolts of blue fiber?", None),
    ("The final answer is 240.", None),
    ("", None),
])
def test_template_kind(text, kind):
    assert template_kind(text) == kind


def test_steered_turns_carry_the_template_and_unsteered_ones_do_not():
    rows = [json.loads(line) for line in FIX.read_text().splitlines() if line.strip()]
    by = Counter((r["condition"], template_kind(r["raw_text"]) is not None) for r in rows)
    assert by[("none", True)] == 0 and by[("random", True)] == 0
    assert by[("diff_means", True)] >= 12  # 19 of 48 when written
    k, n = template_share(r["raw_text"] for r in rows if r["condition"] == "diff_means")
    assert n == 48 and 0.25 <= k / n <= 0.5
