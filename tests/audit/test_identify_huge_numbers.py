"""The identification distractor builder takes numbers of any length (a small model repeating one digit).

Why: a 320-digit number overflowed the float the builder compared values with, and past 4300 digits Python
refused the integer conversion, so one such answer stopped the whole identification sheet.
"""

from __future__ import annotations

import re

import pytest

from mechprobe.audit.identify import choose_distractor, perturb_numbers


def _skeleton(text: str) -> str:
    return re.sub(r"\d+(?:,\d{3})*(?:\.\d+)?", "#", text)


@pytest.mark.parametrize("number", ["7" * 320, "1" * 5000, "4" * 400 + ".25", "1" + ",000" * 150],
                         ids=["320", "5000", "decimal", "commas"])
def test_perturb_changes_a_huge_number_and_keeps_its_shape(number):
    answer = f"So 12 * 7 = 84 and the total is {number} apples."
    out = perturb_numbers(answer, "She buys 12 pens at $7 each.", "gsm8k-3")
    assert out is not None and out != answer
    assert _skeleton(out) == _skeleton(answer)
    new = re.findall(r"\d+(?:,\d{3})*(?:\.\d+)?", out)[-1]
    assert new != number
    assert len(new) == len(number)  # same digit count, same decimal places, same separators
    assert ("," in new) == ("," in number) and ("." in new) == ("." in number)
    assert perturb_numbers(answer, "She buys 12 pens at $7 each.", "gsm8k-3") == out  # deterministic


def test_choose_distractor_takes_a_huge_only_number():
    d = choose_distractor("The answer is " + "9" * 4400 + ".", [], "k")
    assert d is not None and d.kind == "perturbed" and d.text != "The answer is " + "9" * 4400 + "."


def test_small_numbers_perturb_as_before():
    assert perturb_numbers("12 * 7 = 84, so she pays $84.", "She buys 12 pens at $7 each.", "gsm8k-3") == \
        "12 * 7 = 107, so she pays $107."
