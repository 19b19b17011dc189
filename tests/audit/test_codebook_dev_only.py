"""The codebook's worked examples come from the dev split only: no test-split turn is quoted in it.

Why: the LLM judges' prompts carry the codebook, and judges are scored on the test split of the labelled turns
(reports/labelled_turns); a test turn shown with its label in the prompt would be scored against its own answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mechprobe.audit import codebook_text

REPO = Path(__file__).resolve().parents[2]
TURNS = REPO / "reports" / "labelled_turns" / "turns.jsonl"
WINDOW = 40  # characters: long enough to be a quotation, short enough to catch a quoted fragment


def _norm(s: str) -> str:
    """Whitespace collapsed; the codebook writes a newline inside a quoted turn as a literal backslash-n."""
    return re.sub(r"\s+", " ", s.replace("\\n", " ")).strip()


def _turns() -> list[dict]:
    return [json.loads(line) for line in TURNS.read_text(encoding="utf-8").splitlines() if line.strip()]


def quoted_test_turns(codebook: str, turns: list[dict]) -> list[str]:
    """Test-split turns with text in the codebook that no dev-split turn also has.

    A short turn counts whole, a longer one by any WINDOW-character piece. Text that a dev turn also contains is
    not counted: the models repeat stock phrases ("It looks like there was a typo in the previous ...",
    "<|im_start|>" loops) in both splits, and quoting a dev turn that shares them is what the codebook should do.
    """
    book = _norm(codebook)
    dev = "\0".join(_norm(t["turn"]) for t in turns if t["split"] == "dev")
    hits = []
    for t in turns:
        if t["split"] != "test":
            continue
        text = _norm(t["turn"])
        pieces = [text] if len(text) <= WINDOW else [text[i:i + WINDOW] for i in range(len(text) - WINDOW + 1)]
        if any(p and p in book and p not in dev for p in pieces):
            hits.append(t["turn_id"])
    return hits


def test_no_test_split_turn_is_quoted_in_the_codebook():
    turns = _turns()
    assert {t["split"] for t in turns} == {"dev", "test"} and len(turns) > 700
    hits = quoted_test_turns(codebook_text(), turns)
    assert not hits, f"test-split turns quoted in the codebook: {hits}; use dev-split turns as worked examples"


def test_the_check_catches_a_quoted_test_fragment():
    turns = _turns()
    dev = "\0".join(_norm(t["turn"]) for t in turns if t["split"] == "dev")
    t = next(t for t in turns if t["split"] == "test" and len(t["turn"]) > 120 and _norm(t["turn"])[10:90] not in dev)
    planted = codebook_text() + f'\n- "{t["turn"][10:90]} …" → `new_query`\n'
    assert t["turn_id"] not in quoted_test_turns(codebook_text(), turns)
    assert t["turn_id"] in quoted_test_turns(planted, turns)
    short = next(t for t in turns if t["split"] == "test" and t["turn"] == "continue<|im_end|>")
    assert short["turn_id"] in quoted_test_turns('- "continue<|im_end|>" → `generic_followup`', turns)


def test_every_worked_example_is_a_dev_split_turn():
    """Each quoted example (its pieces between "…") is found in some dev-split turn."""
    text = codebook_text()
    body = text[text.index("## Boundaries"):]
    examples = re.findall(r'^- "(.*?)"\s+(?:\(|→)', body, flags=re.M | re.S)
    assert len(examples) >= 30
    dev = [_norm(t["turn"]) for t in _turns() if t["split"] == "dev"]
    for ex in examples:
        pieces = [p.strip() for p in _norm(ex).split("…") if p.strip()]
        assert any(all(p in d for p in pieces) for d in dev), ex[:80]
