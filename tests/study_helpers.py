"""Shared helpers for the study tests: a tiny ChatML tokenizer and synthetic run directories."""

from __future__ import annotations

from pathlib import Path

from mechprobe.io import JsonlStore, write_json
from mechprobe.records import AssistantRecord, LabelRecord, UserTurnRecord, make_record_id

CHATML = ("{% if messages|length == 0 or messages[0]['role'] != 'system' %}<|im_start|>system\nyou are tiny"
          "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("you are tiny system user assistant the answer is a b c d e f g h one two three four five six seven "
         "eight nine ten what why how Does does that make sense ? . , ! 1 2 3 4 5 6 7 8 9 0 cats dogs eat fish "
         "bones sum of and then so plus equals").split()


def make_chatml_tokenizer(directory: Path, *, template: str = CHATML, words: list[str] | None = None,
                          eos_token: str = "<|endoftext|>"):
    """A word-level tokenizer (< 128 ids, so a tiny random model can read it) with ChatML special tokens and a
    template that adds a default system prompt (``template``: the tiny one here, or e.g. Qwen2.5's); saved and
    reloaded as a fast tokenizer (offsets work)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(dict.fromkeys(WORDS if words is None else words)))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token=eos_token,
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = template
    tok.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def assistant(item: str, dataset: str = "gsm8k", prompt: str = "what is one plus two ?",
              response: str = "the answer is 3 . one plus two equals three", score: float | None = 1.0,
              stop_reason: str = "end_of_turn") -> AssistantRecord:
    return AssistantRecord(item_id=item, dataset=dataset, prompt=prompt, response=response, stop_reason=stop_reason,
                           n_tokens=10, score=score, extracted=None, gold="3")


def write_synthetic_run(run: Path, dataset: str, items: dict[str, dict], *, judge: str = "offline-test",
                        labels_file: str = "labels_offline.jsonl", variant: str = "full",
                        model: str = "tiny-model", config: dict | None = None) -> Path:
    """A run directory as the study writes it, from ``items``: ``{item_id: {"score": s, "stop": reason,
    "turns": [(decoding, temperature, label, user_stop_reason), ...]}}``. Nothing is generated."""
    store_a = JsonlStore(run / "assistant.jsonl", key="item_id")
    store_u = JsonlStore(run / "user_turns.jsonl", key="record_id")
    store_l = JsonlStore(run / labels_file, key="record_id")
    for iid, spec in items.items():
        store_a.append(assistant(iid, dataset, score=spec.get("score"),
                                 stop_reason=spec.get("stop", "end_of_turn")).to_dict())
        counts: dict[float, int] = {}
        for dec, temp, label, stop in spec["turns"]:
            k = counts.get(temp, 0)
            counts[temp] = k + 1
            rid = make_record_id(iid, dec, temp, k if dec == "sample" else 0, variant)
            store_u.append(UserTurnRecord(record_id=rid, item_id=iid, dataset=dataset, decoding=dec, temperature=temp,
                                          sample_index=k if dec == "sample" else 0, seed=None, raw_text="x", text="x",
                                          stop_reason=stop, prompt_ids=[1, 2], boundary_index=1, assistant_span=(0, 1),
                                          variant=variant).to_dict())
            store_l.append(LabelRecord(record_id=rid, label=label, genuine=label == "genuine_followup",
                                       rationale="synthetic", judge=judge).to_dict())
    write_json(run / "manifest.json", {"identity": {"model": model, "config": config or {}},
                                       "config": {"model": model, "dataset": dataset, **(config or {})}})
    return run
