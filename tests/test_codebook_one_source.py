"""The codebook is one text: the audit sheet shows it and every LLM judge prompt carries it verbatim."""

from mechprobe.audit.codebook import codebook_text
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.llm import PROMPT_VERSION, SYSTEM_PROMPT, build_messages
from mechprobe.taxonomy import LABELS


def test_llm_judge_prompt_carries_the_codebook_verbatim():
    text = codebook_text()
    assert text.strip() and text in SYSTEM_PROMPT
    assert all(label in text for label in LABELS)
    assert "codebook" in PROMPT_VERSION  # verdicts cached under the old prompt are not reused


def test_every_llm_judge_message_starts_from_that_prompt():
    inp = JudgeInput(record_id="r", prompt="What is 2+2?", response="4.", raw_text="Why is it 4?")
    msgs = build_messages(inp)
    assert msgs[0]["role"] == "system" and codebook_text() in msgs[0]["content"]
