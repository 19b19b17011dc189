"""Figure titles: every figure names the model, the judge, n, and whether its rates are judge only or corrected."""

from __future__ import annotations


def figure_title(model: str, judge: str, n: str, *details: str, corrected: bool = False) -> str:
    """``model · details · n · judge J · judge only|corrected``.

    Why one function: a figure travels without its results file, so its title alone must say whose labels
    it shows and how many items it rests on; "judge only" marks rates from model-written labels as they
    are, "corrected" rates adjusted with audit labels.
    """
    return " · ".join([model, *details, n, f"judge {judge}", "corrected" if corrected else "judge only"])
