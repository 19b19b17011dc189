"""The codebook's worked examples come from a dev pool that no evaluated set draws from, and no evaluated turn's
text appears in the codebook.

Why: the LLM judges' prompts carry the codebook, judges are scored on the test split of the labelled turns
(``reports/labelled_turns``), and the findings rest on audited and re-labelled turns; a turn of any of those shown
with its label in the codebook would be scored against its own answer, and labellers who read the codebook would
label it from the example. So:

- the **evaluated turns** are the labelled set's test split, every turn of a re-labelled set
  (``reports/relabel_v2/*/evidence.jsonl``) and every turn imported from an audited run (``source`` ``run:...``);
- the **dev pool** is every other turn (dev split, from a committed fixture, in no re-labelled set); its ids and the
  turn each worked example quotes are recorded in ``mechprobe/audit/codebook_pool.json``;
- the guard normalises whitespace (and the codebook's literal ``\\n``), quotes of every kind and ellipses (``…`` and
  ``...`` split a quotation into pieces), and fails on any WINDOW-character stretch of an evaluated turn found in
  the codebook (a shorter turn counts whole), with no exemption. Stretches made only of special tokens are too
  short to count (fewer than 8 other characters).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mechprobe.audit import codebook_text

REPO = Path(__file__).resolve().parents[2]
TURNS = REPO / "reports" / "labelled_turns" / "turns.jsonl"
POOL = REPO / "mechprobe" / "audit" / "codebook_pool.json"
WINDOW = 32  # characters (about six words): a quoted fragment of an evaluated turn is caught
MIN_TEXT = 8  # a stretch needs this many characters besides special tokens to count
_QUOTES = str.maketrans({"“": '"', "”": '"', "‘": "'", "’": "'", "`": "'", "«": '"', "»": '"'})
_TOKEN = re.compile(r"<\|[a-z_]+\|>")


def norm(s: str) -> str:
    """Lower case, quotes of every kind dropped, the codebook's literal ``\\n`` and all whitespace one space,
    ellipses (``…``, ``...``) a NUL that splits the text into pieces."""
    s = s.replace("\\n", " ").translate(_QUOTES).replace('"', "").replace("'", "")
    s = s.replace("...", "\0").replace("…", "\0")
    return re.sub(r"[ \t\r\n]+", " ", s).strip().lower()


def _pieces(text: str) -> list[str]:
    return [p.strip() for p in norm(text).split("\0") if p.strip()]


def _windows(text: str) -> set[str]:
    out = set()
    for p in _pieces(text):
        ws = [p] if len(p) <= WINDOW else [p[i:i + WINDOW] for i in range(len(p) - WINDOW + 1)]
        out |= {w for w in ws if len(_TOKEN.sub("", w).strip()) >= MIN_TEXT}
    return out


def _turns() -> list[dict]:
    return [json.loads(line) for line in TURNS.read_text(encoding="utf-8").splitlines() if line.strip()]


def _relabelled() -> set[str]:
    ids: set[str] = set()
    for p in sorted((REPO / "reports" / "relabel_v2").glob("*/evidence.jsonl")):
        ids |= {json.loads(x)["turn_id"] for x in p.read_text(encoding="utf-8").splitlines() if x.strip()}
    return ids


def evaluated(turns: list[dict]) -> list[dict]:
    """Turns some evaluated set draws from: the test split, re-labelled turns, turns of audited runs."""
    rel = _relabelled()
    return [t for t in turns if t["split"] == "test" or t["turn_id"] in rel or str(t["source"]).startswith("run:")]


def dev_pool(turns: list[dict]) -> list[dict]:
    """Every turn no evaluated set draws from: the codebook's worked examples come from these only."""
    bad = {t["turn_id"] for t in evaluated(turns)}
    return [t for t in turns if t["turn_id"] not in bad]


def leaked(codebook: str, turns: list[dict]) -> list[str]:
    """Evaluated turns with a WINDOW-character stretch (or, if shorter, all) of their text in ``codebook``."""
    book = norm(codebook)
    return [t["turn_id"] for t in evaluated(turns) if any(w in book for w in _windows(t["turn"]))]


def examples(codebook: str) -> list[str]:
    """The quoted worked examples (``- "..." →`` or ``- "..." (``) of the sections after ``## Boundaries``."""
    body = codebook[codebook.index("## Boundaries"):]
    return re.findall(r'^- "(.*?)"\s+(?:\(|→)', body, flags=re.M | re.S)


def test_no_evaluated_turn_is_quoted_in_the_codebook():
    turns = _turns()
    assert {t["split"] for t in turns} == {"dev", "test"} and len(turns) > 700
    assert len(evaluated(turns)) > 400
    hits = leaked(codebook_text(), turns)
    assert not hits, f"evaluated turns quoted in the codebook: {hits}; take worked examples from the dev pool"


def test_the_guard_catches_fragments_split_quotes_and_short_turns():
    """A 31-character fragment, a quotation split by "…" (or "...") and re-quoted with curly quotes, and a short
    turn quoted whole are each caught; the guard exempts nothing, not even text a dev turn shares."""
    turns = _turns()
    book = codebook_text()
    t = next(t for t in evaluated(turns) if len(norm(t["turn"])) > 150 and "\0" not in norm(t["turn"]))
    text = t["turn"]
    assert t["turn_id"] not in leaked(book, turns)
    assert t["turn_id"] in leaked(book + f'\n- "{text[20:20 + WINDOW]}" → `new_query`\n', turns)
    split = f'\n- “{text[0:40]} … {text[100:140]}” → `new_query`\n'
    assert t["turn_id"] in leaked(book + split, turns)
    assert t["turn_id"] in leaked(book + split.replace("…", "..."), turns)
    short = next(t for t in evaluated(turns) if t["turn"] == "continue<|im_end|>")
    assert short["turn_id"] in leaked('- "continue<|im_end|>" → `generic_followup`', turns)
    dev_text = {norm(d["turn"]) for d in dev_pool(turns)}
    shared = next(t for t in evaluated(turns) if norm(t["turn"]) in dev_text and len(_windows(t["turn"])))
    assert shared["turn_id"] in leaked(f'- "{shared["turn"]}" → `x`', turns)  # no exemption for dev-shared text


def test_every_worked_example_is_a_recorded_dev_pool_turn():
    """Each quoted example (its pieces between ellipses) is in a dev-pool turn, and that turn is recorded."""
    turns = _turns()
    pool = dev_pool(turns)
    record = json.loads(POOL.read_text(encoding="utf-8"))
    assert record["pool"] == sorted(t["turn_id"] for t in pool), "codebook_pool.json's pool is not the rule's"
    recorded = {e["turn_id"] for e in record["examples"]}
    assert recorded <= set(record["pool"])
    exs = examples(codebook_text())
    assert len(exs) >= 30 and len(record["examples"]) >= len(exs)
    texts = {t["turn_id"]: norm(t["turn"]) for t in pool}
    for ex in exs:
        pieces = _pieces(ex)
        hits = [i for i, d in texts.items() if all(p in d for p in pieces)]
        assert hits, f"not a dev-pool turn: {ex[:80]}"
        assert set(hits) & recorded, f"its turn is not recorded in codebook_pool.json: {ex[:80]}"


def test_no_two_examples_of_one_turn_disagree():
    """The same turn quoted twice carries one lenient label (a strict reading may add to it, never contradict)."""
    text = codebook_text()
    body = text[text.index("## Boundaries"):]
    found = re.findall(r'^- "(.*?)"\s+(?:\([^)]*\)\s*)?→ `([a-z_]+)`', body, flags=re.M | re.S)
    by: dict[str, set[str]] = {}
    for ex, label in found:
        by.setdefault(" ".join(_pieces(ex)), set()).add(label)
    assert all(len(v) == 1 for v in by.values()), {k[:60]: v for k, v in by.items() if len(v) > 1}
