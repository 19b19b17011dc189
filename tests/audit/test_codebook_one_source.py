"""The codebook is one text: the audit sheet shows it and every LLM judge prompt is cut from it."""

from mechprobe.audit.codebook import CORE_SECTIONS, codebook_core, codebook_text
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.llm import LOCAL_SYSTEM_PROMPT, PROMPT_VERSION, SYSTEM_PROMPT, build_messages
from mechprobe.judges.local import LocalJudge
from mechprobe.taxonomy import LABELS


def test_remote_judge_prompt_carries_the_whole_codebook_verbatim():
    text = codebook_text()
    assert text.strip() and text in SYSTEM_PROMPT
    assert all(label in text for label in LABELS)
    assert "codebook" in PROMPT_VERSION  # verdicts cached under the old prompt are not reused


def test_local_judge_prompt_carries_the_codebook_rules_verbatim():
    text, core = codebook_text(), codebook_core()
    assert core in LOCAL_SYSTEM_PROMPT and "### 3." not in LOCAL_SYSTEM_PROMPT  # rules, not worked examples
    for part in core.split("\n\n## "):
        assert part.lstrip("# ") in text  # every section is cut from the one file, word for word
    assert all(f"## {name}" in core for name in CORE_SECTIONS)
    assert len(core) < len(text) / 2


def test_every_llm_judge_message_starts_from_that_prompt():
    inp = JudgeInput(record_id="r", prompt="What is 2+2?", response="4.", raw_text="Why is it 4?")
    assert codebook_text() in build_messages(inp)[0]["content"]
    local = object.__new__(LocalJudge)  # no model: only the prompt is under test
    local.examples = []
    msgs = local.messages(inp)
    assert msgs[0] == {"role": "system", "content": LOCAL_SYSTEM_PROMPT} and "Why is it 4?" in msgs[-1]["content"]
