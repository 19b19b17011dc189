"""Unit tests of the offline judge's rules on crafted turns (one or more per label, plus rule order).

These examples were written by hand to exercise each rule; they are not real generated turns and
are not the evaluation data (that is the model-written label fixture, split dev/test).
"""

from __future__ import annotations

import pytest

from mechprobe.judges.base import JudgeInput
from mechprobe.judges.offline import (
    OfflineJudge,
    content_tokens,
    embeddings_available,
    salient,
    split_roles,
    strip_special,
)
from mechprobe.taxonomy import GENUINE, LABELS

P = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?")
R = ("In May, Natalia sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips in April and May. "
     "The answer is 72.")
POEM_P = "Write a short poem about the ocean."
DISC_P = ("Discuss the causes of the French Revolution and compare them with the causes of the American "
          "Revolution, giving examples from primary sources of the period.")
DISC_R = ("The French Revolution grew out of fiscal crisis, bread prices and Enlightenment ideas, while the "
          "American Revolution turned on taxation without representation. Pamphlets such as Common Sense "
          "show the colonial argument.")
POEM_R = ("Waves of silver kiss the shore,\nWhispers of the deep implore,\nSeagulls dance on salty breeze,\n"
          "The ocean hums its melodies.")

CASES = [
    # (prompt, response, raw user turn, expected label, rule id)
    (P, R, "<|im_end|>", "empty_or_degenerate", "R1"),
    (P, R, "  \n<|im_end|>", "empty_or_degenerate", "R1"),
    (P, R, "...?!<|im_end|>", "empty_or_degenerate", "R1"),
    (P, R, "<|im_start|>assistant\nThe answer is 72.<|im_end|>", "assistant_continuation", "R2"),
    (P, R, "<start_of_turn>model\nSure, 72.", "assistant_continuation", "R2"),
    (P, R, "<|start|>assistant<|channel|>analysis<|message|>We need to check", "assistant_continuation", "R2"),
    (P, R, "<think>Let me reconsider the May numbers", "assistant_continuation", "R2"),
    (P, R, "assistant\nThe total is 72 clips.", "assistant_continuation", "R2"),
    (P, R, "the the the the the the the the the the the the the the", "empty_or_degenerate", "R3"),
    (P, R, "How many clips? How many clips? How many clips? How many clips? How many clips?",
     "empty_or_degenerate", "R3"),
    (P, R, "xkcdq zzvbn qwrtp mnbvc lkjhg", "empty_or_degenerate", "R3"),
    (P, R, "As an AI language model, I cannot sell clips.", "identity_leakage", "R4"),
    (P, R, "I'm SmolLM, a helpful AI assistant.", "identity_leakage", "R4"),
    (P, R, "Hello! How can I assist you today?", "identity_leakage", "R4"),
    (P, R, "I was trained by Hugging Face on lots of text.", "identity_leakage", "R4"),
    (P, R, "We need to compute the total number of clips.", "meta_planning", "R5"),
    (P, R, "Let's break this down step by step.", "meta_planning", "R5"),
    (P, R, "The user wants to know how many clips Natalia sold.", "meta_planning", "R5"),
    (P, R, "To solve this, first find the clips sold in May.", "meta_planning", "R5"),
    (P, R, P, "prompt_restatement", "R6"),
    (P, R, "How many clips did Natalia sell altogether in April and May?", "prompt_restatement", "R6"),
    (POEM_P, POEM_R, "Write a short poem about the ocean.", "prompt_restatement", "R6"),
    # v3: asking one part of a long query again is a restatement too
    (DISC_P, DISC_R, "What were the causes of the French Revolution?", "prompt_restatement", "R6"),
    (P, R, "Step 1: In April she sold 48 clips. Step 2: In May she sold 24.", "assistant_continuation", "R7"),
    (P, R, "Certainly! In April she sold 48 clips.", "assistant_continuation", "R7"),
    (P, R, "In April she sold 48 clips and in May 24 clips, so the total is 72 clips. Therefore the answer "
           "is 72.", "assistant_continuation", "R7"),
    (P, R, "48 / 2 = 24 and 48 + 24 = 72 and 72 - 0 = 72", "assistant_continuation", "R7"),
    (P, R, "She sold 72 clips in total. I hope this helps!", "assistant_continuation", "R7"),
    # v3: a short declarative copy of the response's wording; a verbal worked equation
    (POEM_P, POEM_R, "The ocean hums its melodies.", "assistant_continuation", "R7"),
    (P, R, "48 divided by 2 is 24, so in May she sold 24 clips.", "assistant_continuation", "R7"),
    (P, R, "Why did you divide 48 by 2 to get 24?", GENUINE, "R8"),
    (P, R, "Wait, isn't 48 + 24 = 72 wrong? I got 70.", GENUINE, "R8"),
    (P, R, "So she sold 24 clips in May?", GENUINE, "R8"),
    (P, R, "Why did you halve the number for May?", GENUINE, "R8"),
    (POEM_P, POEM_R, "Can you make it shorter and add a title?", GENUINE, "R8"),
    (POEM_P, POEM_R, "Why do the seagulls dance in the second line?", GENUINE, "R8"),
    (P, R, "Of course, but why is it 24 and not 25?", GENUINE, "R8"),
    (P, R, "Thanks!", "generic_followup", "R9"),
    (P, R, "Can you explain more?", "generic_followup", "R9"),
    (P, R, "Thank you, that was really helpful!", "generic_followup", "R9"),
    (POEM_P, POEM_R, "I love it, thanks!", "generic_followup", "R9"),
    (P, R, "What is the capital of France?", "new_query", "R10"),
    (P, R, "John has 5 apples and buys 3 more at the market. How many apples does John have now?",
     "new_query", "R10"),
    (P, R, "How many clips did Natalia sell in June?", "new_query", "R10"),
    (POEM_P, POEM_R, "Now write a haiku about mountains in winter.", "new_query", "R10"),
    (POEM_P, POEM_R, "Are you an AI?", "new_query", "R10"),
    # one short word shared with the response is not enough grounding
    (POEM_P, POEM_R, "What color is silver?", "new_query", "R10"),
    # v3: a new name turns the query's words into a new question
    (DISC_P, DISC_R, "What were the causes of the Russian Revolution?", "new_query", "R10"),
    # v3: "the number of ..." is a noun phrase, not a pointer at the answer; "what does X mean" about a
    # term the response never used asks something new
    (P, R, "What is the number of apples in a basket of fruit?", "new_query", "R10"),
    (P, R, "What does photosynthesis mean?", "new_query", "R10"),
    # v3: ungrounded text that neither asks nor requests anything
    (P, R, "The purple elephant drove quietly across the frozen library yesterday afternoon.",
     "empty_or_degenerate", "R10a"),
    # a long first-person turn is the user's own situation, not a written-out answer
    (P, R, "I'm a teacher and my students often struggle with word problems like this one, and I have been "
           "looking for a better way to explain fractions such as half to them in class every single week "
           "without confusing anyone or making them feel bad about maths in general", "new_query", "R10"),
]


def _inp(prompt: str, response: str, raw: str, rid: str = "r0", **kw) -> JudgeInput:
    return JudgeInput(record_id=rid, prompt=prompt, response=response, raw_text=raw, **kw)


@pytest.fixture(scope="module")
def lexical() -> OfflineJudge:
    return OfflineJudge(embed=False)


@pytest.mark.parametrize("prompt,response,raw,label,rule", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_crafted_turns(lexical, prompt, response, raw, label, rule):
    rec = lexical.label(_inp(prompt, response, raw))
    assert (rec.label, rec.rationale.split(":")[0]) == (label, rule), rec.rationale
    assert rec.genuine == (label == GENUINE)
    assert rec.judge == "offline-v3+lexical" and rec.error is None


def test_every_label_is_covered_by_a_crafted_case():
    assert {c[3] for c in CASES} == set(LABELS)


def test_rule_order_identity_beats_meta_and_continuation(lexical):
    # Both an identity phrase and planning/answer cues: R4 runs first.
    rec = lexical.label(_inp(P, R, "As an AI, we need to add 48 + 24 = 72. The answer is 72."))
    assert rec.label == "identity_leakage"
    # Header first beats everything that follows it.
    rec = lexical.label(_inp(P, R, "<|im_start|>assistant\nAs an AI, I think 72."))
    assert rec.label == "assistant_continuation"


def test_second_person_ai_question_is_not_identity_leakage(lexical):
    assert lexical.label(_inp(P, R, "Are you a language model?")).label != "identity_leakage"


def test_user_challenge_with_answer_words_is_not_continuation(lexical):
    # "the answer is" is a weak cue; addressing the assistant ("you") keeps it a user turn.
    rec = lexical.label(_inp(P, R, "I think the answer is 70, not 72. Did you add 48 and 24 correctly?"))
    assert rec.label == GENUINE, rec.rationale


def test_user_part_is_judged_when_a_header_follows(lexical):
    raw = "Why did you divide 48 by 2?<|im_start|>assistant\nBecause half of 48 is 24.<|im_end|>"
    rec = lexical.label(_inp(P, R, raw))
    assert rec.label == GENUINE
    assert "judged the user part only" in rec.rationale


def test_history_counts_as_query_context(lexical):
    # "Paris" appears in the response; it is grounding only if it is not already in the context.
    resp = "The Eiffel Tower in Paris was finished in 1889."
    turn = "Why was it built in Paris?"
    no_hist = lexical.label(_inp("When was the Eiffel Tower finished?", resp, turn))
    with_hist = lexical.label(_inp("When was the Eiffel Tower finished?", resp, turn,
                                   messages=(("user", "Tell me about Paris."), ("assistant", "Paris is in France."))))
    assert no_hist.label == GENUINE
    assert with_hist.label != GENUINE


def test_deterministic_and_batch_invariant(lexical):
    inputs = [_inp(p, r, t, rid=str(i)) for i, (p, r, t, _, _) in enumerate(CASES)]
    many = list(OfflineJudge(embed=False, batch_size=7).label_many(inputs))
    one_by_one = [lexical.label(i) for i in inputs]
    assert [m.to_dict() for m in many] == [o.to_dict() for o in one_by_one]
    assert [m.record_id for m in many] == [i.record_id for i in inputs]


def test_strip_and_split_roles():
    assert strip_special("<|im_start|>user\nHi<|im_end|>") == "user\nHi"
    segs = split_roles("Thanks!<|im_end|>\n<|im_start|>assistant\nYou're welcome.")
    assert [(s.role, s.text) for s in segs] == [("user", "Thanks!"), ("assistant", "You're welcome.")]
    segs = split_roles("<start_of_turn>model\nOk")
    assert [(s.role, s.text) for s in segs if s.text] == [("assistant", "Ok")]
    assert split_roles("[/INST] Sure")[1].role == "assistant"


def test_salience_and_content_tokens():
    s = salient("In May, Natalia sold 1,200 clips to Bob.")
    assert "1200" in s.numbers and "natalia" in s.terms and "bob" in s.terms
    assert "may" not in s.terms  # sentence-initial short word is not an entity
    assert content_tokens("Thanks, can you explain the answer?") == []


@pytest.mark.skipif(not embeddings_available(), reason="pip install 'mechprobe[embed]' for the embedding variant")
def test_embedding_variant_agrees_on_crafted_turns():
    judge = OfflineJudge(embed=True)
    assert judge.name == "offline-v3+minilm"
    inputs = [_inp(p, r, t, rid=str(i)) for i, (p, r, t, _, _) in enumerate(CASES)]
    got = [rec.label for rec in judge.label_many(inputs)]
    assert got == [c[3] for c in CASES]


def test_embedding_variant_refuses_without_package(monkeypatch):
    import mechprobe.judges.offline as jo

    monkeypatch.setattr(jo, "embeddings_available", lambda: False)
    with pytest.raises(ImportError, match="offline-lexical"):
        jo.OfflineJudge(embed=True)
    assert jo.OfflineJudge().variant == "lexical"


def test_docs_show_the_taxonomy_verbatim():
    from pathlib import Path

    from mechprobe.taxonomy import definitions_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "judging.md").read_text(encoding="utf-8")
    block = doc.split("<!-- taxonomy:start -->\n", 1)[1].split("\n<!-- taxonomy:end -->", 1)[0]
    assert block == definitions_markdown()
