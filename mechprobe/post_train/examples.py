"""The SFT example and its loss mask: a conversation rendered with the model's own chat template, the next human
turn in the *user* role, and labels on that turn's content and end-of-turn token only.

The loss never covers the user-role header (the probe prompt supplies the header, so the model never has to
predict it) nor the conversation before it. Why the mask is found from renderings and not from per-family
markers: the same reasoning as :mod:`mechprobe.lm.chat` -- a hand-written "``<|im_start|>user``" rule breaks on
Gemma, Llama-3, Mistral. We render the conversation with a sentinel user message to find where the user content
starts (the probe's own cut), check that the full rendering has the real content at that character offset, and
map characters to tokens with the in-context offsets of the full rendering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mechprobe.lm import chat
from mechprobe.post_train.conversations import Conversation, PostTrainError

__all__ = ["IGNORE", "BuiltData", "TrainExample", "build_example", "build_examples"]

IGNORE = -100


@dataclass(frozen=True)
class TrainExample:
    """Token ids of one rendered conversation and its labels (``IGNORE`` outside the trained user turn).

    ``user_span`` is the [start, end) token span whose labels are kept: the user content plus its
    end-of-turn token.
    """

    conv_id: str
    input_ids: list[int]
    labels: list[int]
    user_span: tuple[int, int]


def build_example(tokenizer: Any, messages: Sequence[dict[str, str]], next_user: str, conv_id: str = "",
                  system: str | None = None) -> TrainExample:
    """Render ``messages + [user: next_user]`` and mask everything but the user turn's content and end token.

    Template-agnostic: the content's first character is where :mod:`mechprobe.lm.chat` cuts the probe prompt
    (render with a sentinel user message), checked against the full rendering; its tokens are the
    in-context tokens overlapping the content's characters, and the end-of-turn token is the first
    non-blank token after the content, which must be one of the template's user end-of-turn ids.
    """
    content = next_user.strip()
    if not content:
        raise PostTrainError(f"{conv_id}: empty next user turn")
    msgs = list(messages)
    if system is not None:
        msgs = [{"role": "system", "content": system}, *msgs]
    probe = chat.render(tokenizer, [*msgs, {"role": "user", "content": chat.SENTINEL}])
    if probe.count(chat.SENTINEL) != 1:
        raise PostTrainError("the chat template rendered the user message more than once")
    start = probe.index(chat.SENTINEL)
    full = chat.render(tokenizer, [*msgs, {"role": "user", "content": content}])
    if full[:start] != probe[:start] or full[start:start + len(content)] != content:
        raise PostTrainError(f"{conv_id}: the chat template rewrites the user content or the text before it "
                             "(the loss mask needs the content verbatim after the user-role header)")
    end = start + len(content)
    ids, offsets = chat.tokenize_rendered(tokenizer, full)
    if offsets is None:
        raise PostTrainError("the loss mask needs a fast tokenizer (character offsets)")
    inside = [i for i, (s, e) in enumerate(offsets) if e > start and s < end and e > s]
    if not inside:
        raise PostTrainError(f"{conv_id}: no token covers the user content")
    eot_ids = set(chat.user_end_of_turn_ids(tokenizer))
    after = next((i for i, (s, e) in enumerate(offsets) if s >= end and e > s and full[s:e].strip()), None)
    if after is None or ids[after] not in eot_ids:
        raise PostTrainError(f"{conv_id}: no user end-of-turn token after the content (expected one of "
                             f"{sorted(eot_ids)})")
    span = (inside[0], after + 1)
    labels = [IGNORE] * len(ids)
    labels[span[0]:span[1]] = ids[span[0]:span[1]]
    return TrainExample(conv_id=conv_id, input_ids=ids, labels=labels, user_span=span)


@dataclass
class BuiltData:
    examples: list[TrainExample]
    skipped: dict[str, int]


def build_examples(tokenizer: Any, convs: Sequence[Conversation], max_len: int, system: str | None = None
                   ) -> BuiltData:
    """Examples that fit ``max_len`` tokens; longer ones are skipped and counted, never truncated
    (cutting would change what the user turn responds to, or drop its end-of-turn token)."""
    out: list[TrainExample] = []
    skipped = {"too_long": 0, "template": 0}
    for c in convs:
        try:
            ex = build_example(tokenizer, c.messages, c.next_user, c.conv_id, system)
        except PostTrainError:
            skipped["template"] += 1
            continue
        if len(ex.input_ids) > max_len:
            skipped["too_long"] += 1
            continue
        out.append(ex)
    return BuiltData(out, skipped)
