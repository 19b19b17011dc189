"""The user-role boundary, derived from the tokenizer's own chat template.

The probe prompt is the model's own rendering of ``[system?, *history, user, assistant]`` followed by
exactly what the template writes before a *user* message's content (the user-role header), so the
model's next tokens are its guess at the user's next turn. Hand-written per-family templates drift
from what a model was trained on, so nothing here knows any family: we render the conversation with
one more user message whose content is a sentinel string and cut just before the sentinel.

Why cut in *token* space (with offsets) rather than tokenising the cut text: tokenising a prefix can
differ from the same text in context (SentencePiece templates such as Mistral's ``[INST] `` end with a
space that merges into the next word). Cutting the in-context tokenisation means the prompt is always
a true prefix of what the model sees in training-like conversations, and the boundary token is the
last header token that does not touch the user's content.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from mechprobe.errors import UsageError, UserError

SENTINEL = "MECHPROBEsentinelQ"
SENTINEL_2 = "MECHPROBEsentinelR"


class ChatTemplateError(UserError, ValueError):
    """The tokenizer cannot render the probe (no template, or one that drops the response)."""


@dataclass(frozen=True)
class ProbePrompt:
    """A tokenised probe prompt.

    ``boundary_index`` is the index of the last token of the user-role header (always the last
    token of ``input_ids``); ``assistant_span`` is the [start, end) token span of the assistant's
    response; ``header_text`` is the user-role header as the template writes it.

    Attributes:
        input_ids: token ids of the conversation followed by the user-role header (one BOS at most).
        boundary_index: ``len(input_ids) - 1``, the position whose residual is cached and steered.
        assistant_span: ``(start, end)`` token indices of the response in ``input_ids`` (both clamped to
            ``boundary_index``; ``(b, b)`` when there is no response to locate).
        text: ``tokenizer.decode(input_ids)``.
        header_text: the template's user-role header (:func:`user_header`).

    Example:
        >>> from mechprobe import ProbePrompt
        >>> pp = ProbePrompt(input_ids=[1, 7, 8, 9, 2, 5], boundary_index=5, assistant_span=(2, 4),
        ...                  text="...", header_text="<|im_start|>user\\n")
        >>> pp.input_ids[pp.boundary_index] == pp.input_ids[-1]
        True
    """

    input_ids: list[int]
    boundary_index: int
    assistant_span: tuple[int, int]
    text: str
    header_text: str


def conversation_messages(prompt: str, response: str | None, system: str | None,
                          history: list[dict[str, str]] | None) -> list[dict[str, str]]:
    """The message list of one turn: optional system message, earlier ``history``, the user ``prompt`` and,
    when given, the assistant ``response``. Public because perturbed conversations (``mechprobe.turns``) build
    their headed prompts from the same list the probe renders."""
    msgs: list[dict[str, str]] = []
    if system is not None:
        msgs.append({"role": "system", "content": system})
    msgs.extend(history or [])
    msgs.append({"role": "user", "content": prompt})
    if response is not None:
        msgs.append({"role": "assistant", "content": response})
    return msgs


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render with the tokenizer's template; a clear error when there is none."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "this tokenizer")
        raise ChatTemplateError(
            f"{name} has no chat template (a base model?). The user-turn probe needs the model's own "
            "role headers: use an instruct/chat model, or pass a template explicitly "
            "(chat_template=FILE.jinja / load_model(..., chat_template=...))."
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raise_exception() in templates, e.g. "roles must alternate"
        raise ChatTemplateError(f"the chat template refused the conversation: {e}") from e


def _adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_sp = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_sp) > len(without) and with_sp[0] == bos


def tokenize_rendered(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Tokenise template-rendered text without a second BOS.

    Templates that write ``{{ bos_token }}`` already contain it; tokenising with special tokens would
    add another one (a classic silent bug: Llama-3 and Gemma then see ``<bos><bos>``). We tokenise
    without special tokens and prepend BOS only when the tokenizer would add one and the text lacks it.
    Returns ids and character offsets (None for slow tokenizers).
    """
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):
        enc = tokenizer(text, add_special_tokens=False)
        offsets = None
    ids = list(enc["input_ids"])
    if _adds_bos(tokenizer) and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
        if offsets is not None:
            offsets = [(0, 0)] + offsets
    return ids, offsets


def ids_up_to(tokenizer: Any, text: str, cut: int) -> list[int]:
    """Token ids of ``text`` in context, keeping only tokens that end at or before char ``cut``.

    Public because the hybrid judge (``mechprobe.judges.hybrid``) cuts its prompts at a header the same way the
    probe does, so both see identical prefix tokens."""
    ids, offsets = tokenize_rendered(tokenizer, text)
    if offsets is None:  # slow tokenizer: tokenise the prefix and insist it is an in-context prefix
        pre, _ = tokenize_rendered(tokenizer, text[:cut])
        if ids[: len(pre)] != pre:
            raise ChatTemplateError("slow tokenizer: the header does not tokenise as a prefix; use a fast tokenizer")
        return pre
    keep = 0
    for i, (_, end) in enumerate(offsets):
        if end <= cut:
            keep = i + 1
        else:
            break
    return ids[:keep]


def build_probe_prompt(
    tokenizer: Any,
    prompt: str,
    response: str,
    *,
    system: str | None = None,
    history: list[dict[str, str]] | None = None,
) -> ProbePrompt:
    """The probe prompt: the conversation plus the template's user-role header, tokenised.

    ``system=None`` keeps the template's default system prompt (SmolLM2, Qwen write one); pass a
    string to override it. ``history`` is prior turns for multi-turn datasets.

    Args:
        tokenizer: an HF tokenizer with a chat template (a fast tokenizer gives exact offsets).
        prompt: the user query.
        response: the assistant's answer; it must appear verbatim (after ``strip()``) in the rendering.
        system: system prompt; None (default) keeps the template's own default.
        history: earlier turns as ``{"role", "content"}`` dicts, before ``prompt``; None (default) = none.

    Returns:
        A :class:`ProbePrompt` whose ``input_ids`` end with the user-role header, so ``boundary_index`` is
        the last position, and whose ``assistant_span`` locates the response.

    Raises:
        UsageError: ``prompt`` or ``response`` is not a string (a ``ValueError``).
        ChatTemplateError: no chat template, a template that refuses the conversation, renders the user
            message twice, or drops/rewrites the response.

    Example:
        >>> from mechprobe import build_probe_prompt, load_model
        >>> lm = load_model("smollm2-135m-instruct", device="cpu")                     # doctest: +SKIP
        >>> pp = build_probe_prompt(lm.tokenizer, "What is 12 * 7?", "12 * 7 = 84.")    # doctest: +SKIP
        >>> pp.text.endswith("<|im_start|>user\\n"), pp.boundary_index == len(pp.input_ids) - 1  # doctest: +SKIP
        (True, True)
    """
    for arg, value, what in (("prompt", prompt, "the user query"), ("response", response, "the assistant's answer")):
        if not isinstance(value, str):  # None used to fail deep inside as an AttributeError naming nothing
            raise UsageError(f"build_probe_prompt: {arg} must be a string ({what}), got {type(value).__name__}")
    msgs = conversation_messages(prompt, response, system, history)
    full = render(tokenizer, msgs + [{"role": "user", "content": SENTINEL}])
    if full.count(SENTINEL) != 1:
        raise ChatTemplateError("the chat template rendered the user message more than once")
    cut = full.index(SENTINEL)
    prefix_text = full[:cut]
    ids = ids_up_to(tokenizer, full, cut)
    if not ids:
        raise ChatTemplateError("the probe prompt tokenised to nothing")

    resp = response.strip()
    r_start = prefix_text.rfind(resp) if resp else -1
    if resp and r_start < 0:
        raise ChatTemplateError(
            "the chat template dropped or rewrote the assistant response when a user turn follows it "
            "(e.g. templates that strip reasoning from earlier turns); pass the response without those parts"
        )
    r_end = r_start + len(resp)
    _, offsets = tokenize_rendered(tokenizer, prefix_text)
    if offsets is not None and resp:
        inside = [i for i, (s, e) in enumerate(offsets) if e > r_start and s < r_end and e > s]
        span = (inside[0], inside[-1] + 1) if inside else (len(ids) - 1, len(ids) - 1)
    else:
        span = (len(ids) - 1, len(ids) - 1)
    # Never let the span run past the tokens we keep.
    span = (min(span[0], len(ids) - 1), min(span[1], len(ids) - 1))
    return ProbePrompt(input_ids=ids, boundary_index=len(ids) - 1, assistant_span=span,
                       text=tokenizer.decode(ids), header_text=user_header(tokenizer))


def build_headed_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> ProbePrompt:
    """``messages`` (no assistant turn at the end, possibly none at all) followed by the user-role header.

    For the perturbation controls of the study (:mod:`mechprobe.turns.perturb`): ``no_response`` is the query
    followed directly by the user header, ``no_conversation`` is the header after nothing but the system
    prompt the template adds itself. Same sentinel cut as :func:`build_probe_prompt`, so the header is the
    template's own. Templates that insist on alternating roles refuse two user turns in a row: that is a
    :class:`ChatTemplateError` naming the variant's cause, not a guessed rendering.
    """
    try:
        full = render(tokenizer, list(messages) + [{"role": "user", "content": SENTINEL}])
    except ChatTemplateError as e:
        raise ChatTemplateError(f"cannot put a user header right after {'the query' if messages else 'nothing'}: "
                                f"{e}") from e
    if full.count(SENTINEL) != 1:
        raise ChatTemplateError("the chat template rendered the user message more than once")
    ids = ids_up_to(tokenizer, full, full.index(SENTINEL))
    if not ids:
        raise ChatTemplateError("the probe prompt tokenised to nothing")
    end = len(ids) - 1
    return ProbePrompt(input_ids=ids, boundary_index=end, assistant_span=(end, end), text=tokenizer.decode(ids),
                       header_text=user_header(tokenizer))


def build_assistant_prompt(tokenizer: Any, prompt: str, *, system: str | None = None,
                           history: list[dict[str, str]] | None = None) -> list[int]:
    """Token ids for generating the assistant turn (template with ``add_generation_prompt=True``)."""
    text = render(tokenizer, conversation_messages(prompt, None, system, history), add_generation_prompt=True)
    ids, _ = tokenize_rendered(tokenizer, text)
    return ids


def user_header(tokenizer: Any) -> str:
    """The text the template writes before a user message's content, after a finished assistant turn.

    Derived by diffing a conversation rendered with and without one more user message. Where the
    template renders the final assistant turn differently from a non-final one (harmony writes
    ``<|return|>`` vs ``<|end|>``), the assistant's end-of-turn token is located and skipped.

    Args:
        tokenizer: an HF tokenizer with a chat template.

    Returns:
        The header text (``str``), e.g. ``"<|im_start|>user\\n"`` for ChatML (SmolLM2, Qwen),
        ``"<start_of_turn>user\\n"`` for Gemma, ``"<|start_header_id|>user<|end_header_id|>\\n\\n"`` for Llama-3.

    Raises:
        ChatTemplateError: the tokenizer has no chat template (a base model) or the template refuses.

    Example:
        >>> from mechprobe import load_model, user_header
        >>> lm = load_model("smollm2-135m-instruct", device="cpu")     # doctest: +SKIP
        >>> user_header(lm.tokenizer)                                  # doctest: +SKIP
        '<|im_start|>user\\n'
    """
    a, b = "Hello there.", "General Kenobi."
    base_msgs = [{"role": "user", "content": a}, {"role": "assistant", "content": b}]
    base = render(tokenizer, base_msgs)
    full = render(tokenizer, base_msgs + [{"role": "user", "content": SENTINEL}])
    cut = full.index(SENTINEL)
    if full.startswith(base):
        return full[len(base):cut]
    # Otherwise (harmony renders a final assistant turn with <|return|>, a non-final one with <|end|>):
    # the text between b's content and the sentinel is the assistant end-of-turn token followed by
    # the header; drop that first token and the separator whitespace after it.
    b_end = full.rindex(b, 0, cut) + len(b)
    ids, offsets = tokenize_rendered(tokenizer, full)
    if offsets is not None:
        for s, e in offsets:
            if s >= b_end and e > s and full[s:e].strip():
                return full[e:cut].lstrip()
    return full[b_end:cut]


def user_end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids that end a *user* turn: the first token the template writes after user content.

    This is ``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama-3, ``<end_of_turn>`` for Gemma,
    ``[/INST]`` for Mistral-style and ``<|end|>`` for harmony. Generation of the user turn stops there.
    """
    msgs = [{"role": "user", "content": SENTINEL}, {"role": "assistant", "content": SENTINEL_2}]
    t = render(tokenizer, msgs)
    start = t.index(SENTINEL) + len(SENTINEL)
    ids, offsets = tokenize_rendered(tokenizer, t)
    if offsets is None:
        after, _ = tokenize_rendered(tokenizer, t[start:])
        return after[:1]
    for i, (s, e) in enumerate(offsets):
        if s >= start and e > s:
            tok_text = t[s:e]
            if tok_text.strip():
                return [ids[i]]
    return []


def stop_token_ids(tokenizer: Any, model: Any = None) -> dict[int, str]:
    """All ids that end generation, each with its stop reason.

    The user end-of-turn token (``end_of_turn``) plus the tokenizer's and generation config's EOS
    ids (``eos``) — a model that ends its text with EOS instead of the user end-of-turn is visible.
    These are the stops of a *user* turn, what a probe prompt needs;
    :func:`mechprobe.lm.generation.generate` uses them by default for a ``LoadedModel``.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        model: the HF model, whose ``generation_config`` may name more EOS ids; None (default) = none.

    Returns:
        ``{token_id: "end_of_turn" | "eos"}``, the format :func:`~mechprobe.lm.generation.generate` takes.

    Example:
        >>> from mechprobe import load_model, stop_token_ids
        >>> lm = load_model("smollm2-135m-instruct")                     # doctest: +SKIP
        >>> stop_token_ids(lm.tokenizer, lm.model)                       # doctest: +SKIP
        {2: 'end_of_turn'}
    """
    out: dict[int, str] = {}
    eos: list[int] = []
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    gc = getattr(model, "generation_config", None)
    if gc is not None and gc.eos_token_id is not None:
        eos.extend([gc.eos_token_id] if isinstance(gc.eos_token_id, int) else list(gc.eos_token_id))
    for i in eos:
        out[int(i)] = "eos"
    for i in user_end_of_turn_ids(tokenizer):
        out[int(i)] = "end_of_turn"
    return out


def assistant_stop_token_ids(tokenizer: Any, model: Any = None) -> dict[int, str]:
    """Ids that end the *assistant* turn: the token after assistant content, plus EOS ids."""
    out = {i: r for i, r in stop_token_ids(tokenizer, model).items() if r == "eos"}
    msgs = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": SENTINEL}]
    t = render(tokenizer, msgs)
    start = t.index(SENTINEL) + len(SENTINEL)
    ids, offsets = tokenize_rendered(tokenizer, t)
    if offsets is not None:
        for i, (s, e) in enumerate(offsets):
            if s >= start and e > s and t[s:e].strip():
                out[int(ids[i])] = "end_of_turn"
                break
    return out


def template_hash(tokenizer: Any) -> str:
    return hashlib.sha256((getattr(tokenizer, "chat_template", None) or "").encode()).hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """Hash of the vocabulary and special tokens: changes whenever token ids would mean something else."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for k in sorted(vocab):
        h.update(f"{k}\t{vocab[k]}\n".encode())
    h.update(repr(sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    return h.hexdigest()
