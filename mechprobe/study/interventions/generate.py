"""User turns after fixed conversations, for every arm: greedy, sampled, answer removed, steered.

Why one function for every arm: the arms must differ *only* in their intervention. Each arm reads the same
committed conversations (query + the base model's complete answer), builds the probe prompt the same way
(:func:`mechprobe.lm.chat.build_probe_prompt`, ending at the user-role header), decodes with the same caps and
stop tokens, and writes the same row format with full texts. The answer-removed arm differs only in its prompt
(the user header right after the query, :func:`mechprobe.turns.perturb.variant_prompt` ``no_response``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from mechprobe.lm import chat
from mechprobe.lm.generation import batches_by_length, decode, generate, left_pad
from mechprobe.lm.models import LoadedModel
from mechprobe.lm.prefix import PrefixStore
from mechprobe.records import AssistantRecord
from mechprobe.steering.vector import SteeringVector, steer
from mechprobe.turns.perturb import variant_prompt, variant_record

__all__ = ["arm_prompt", "user_turns", "arm_row_seed", "stimuli", "reading_states", "boundary_norms", "STIMULUS_KINDS"]


def arm_row_seed(seed: int, arm: str, item_id: str) -> int:
    """A sampled row's seed from the plan's seed, the arm and the item: any row can be regenerated alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}|{arm}|{item_id}".encode()).digest()[:4], "little")


def arm_prompt(lm: LoadedModel, a: AssistantRecord, kind: str) -> chat.ProbePrompt:
    """The probe prompt of conversation ``a`` under an arm of ``kind`` (``no_response``: the answer removed)."""
    if kind == "no_response":
        return variant_prompt(lm.tokenizer, variant_record(lm.tokenizer, a, "no_response"), "no_response")
    return chat.build_probe_prompt(lm.tokenizer, a.prompt, a.response, history=a.messages or None)


def user_turns(lm: LoadedModel, convs: Sequence[AssistantRecord], *, arm: str, kind: str, max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0, vector: SteeringVector | None = None, alpha: float = 0.0,
               positions: str = "boundary+generated", batch_size: int = 16, progress: bool = True,
               done: set[str] | None = None, prefix_store: PrefixStore | None = None) -> Any:
    """Yield one row per conversation (``dict`` with the query, the answer, the turn and how it was made).

    Args:
        lm: the base model.
        convs: the fixed conversations.
        arm: the arm's name (recorded, and part of a sampled row's seed).
        kind: ``"decode"``, ``"no_response"`` or ``"steer"``.
        max_new_tokens: the user turn's token cap.
        temperature: 0 = greedy.
        seed: the plan's seed.
        vector, alpha, positions: for ``steer``: the vector, alpha in the package's ``resid`` unit (the added
            vector's norm is alpha x ``vector.metadata["resid_norm"]``, the layer's mean boundary residual norm;
            the study's vectors are also built with that norm, so ``raw`` would add the same) and where it is
            added.
        batch_size: rows per decode call.
        progress: a tqdm bar.
        done: item ids already written (resume): skipped.
        prefix_store: a :class:`~mechprobe.lm.prefix.PrefixStore` holding the conversations up to the boundary:
            every arm then prefills only the boundary, so an arm costs its decoding alone. Steering at the boundary
            and after is compatible (the boundary is computed inside the arm); the answer-removed arm's prompts
            are other conversations and are prefilled whole.
    Yields:
        rows in batch order; the caller appends each to its JSONL file at once, so a kill loses one batch.
    """
    done = done or set()
    todo = [a for a in convs if a.item_id not in done]
    prompts = [arm_prompt(lm, a, kind) for a in todo]
    store = prefix_store if kind != "no_response" else None
    if store is not None and prompts:
        store.build(prompts, pad_id=lm.tokenizer.pad_token_id or 0)
    bar = tqdm(total=len(todo), desc=f"user turns [{arm}]", unit="turn", disable=not progress)
    for idx in batches_by_length([len(p.input_ids) for p in prompts], batch_size):
        sel = [todo[i] for i in idx]
        pps = [prompts[i] for i in idx]
        seeds = [arm_row_seed(seed, arm, a.item_id) if temperature > 0 else None for a in sel]
        kw = dict(max_new_tokens=max_new_tokens, temperatures=temperature, seeds=seeds, prefix_store=store)
        if kind == "steer" and vector is not None and alpha != 0:
            with steer(lm.model, vector, alpha, positions, unit="resid"):
                gens = generate(lm, pps, **kw)
        else:
            gens = generate(lm, pps, **kw)
        for a, pp, g, s in zip(sel, pps, gens, seeds):
            raw, text = decode(lm.tokenizer, g)
            yield {"item_id": a.item_id, "dataset": a.dataset, "arm": arm, "query": a.prompt, "answer": a.response,
                   "shown_answer": "" if kind == "no_response" else a.response, "turn": text, "raw_turn": raw,
                   "stop_reason": g.stop_reason, "n_tokens": len(g.token_ids), "temperature": temperature,
                   "seed": s, "alpha": alpha if kind == "steer" else None,
                   "layer": vector.layer if (kind == "steer" and vector is not None) else None,
                   "vector": ("random" if vector.kind == "random" else vector.metadata.get("construction", vector.kind))
                   if (kind == "steer" and vector is not None) else None,
                   "n_prompt_tokens": len(pp.input_ids)}
            bar.update(1)
    bar.close()


STIMULUS_KINDS: dict[str, str] = {
    "react": ("Below is a conversation between a user and an AI assistant. Write the user's next message: a short "
              "reply in the user's own voice that reacts to something specific in the assistant's answer (a step, "
              "number, claim or suggestion that only this answer contains): ask about it, question it, or build on "
              "it. Write only the user's message, nothing else."),
    "new": ("Below is a conversation between a user and an AI assistant. Write the user's next message: a short, "
            "new question on an unrelated topic, in the user's own voice, that ignores the assistant's answer. "
            "Write only the user's message, nothing else."),
}


def _transcript(a: AssistantRecord) -> str:
    return f"USER: {a.prompt}\n\nASSISTANT: {a.response}"


def stimuli(lm: LoadedModel, convs: Sequence[AssistantRecord], kind: str, *, max_new_tokens: int,
            batch_size: int = 16, progress: bool = True, done: set[str] | None = None) -> Any:
    """Yield a written user turn of ``kind`` (:data:`STIMULUS_KINDS`) per conversation, written by ``lm`` *as the
    assistant* following an instruction (RepE-style stimuli).

    Why: the model's own next user turns are almost never genuine under the strict reading, too few to contrast.
    Asked outright, it writes candidate follow-ups that react to the answer (``react``) and ones that ignore it
    (``new``) for the same conversation. Which of them really are genuine is decided by blind labellers, never by
    the instruction: the contrast uses the labels.
    """
    done = done or set()
    todo = [a for a in convs if a.item_id not in done]
    tok = lm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": STIMULUS_KINDS[kind] + "\n\n" + _transcript(a)}],
                                     tokenize=False, add_generation_prompt=True) for a in todo]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    bar = tqdm(total=len(todo), desc=f"stimuli [{kind}]", unit="turn", disable=not progress)
    for idx in batches_by_length([len(x) for x in ids], batch_size):
        gens = generate(lm, [ids[i] for i in idx], max_new_tokens=max_new_tokens)
        for i, g in zip(idx, gens):
            a = todo[i]
            _, text = decode(tok, g)
            yield {"item_id": a.item_id, "dataset": a.dataset, "stimulus": kind, "query": a.prompt,
                   "answer": a.response, "turn": text.strip().strip('"').strip(), "stop_reason": g.stop_reason}
            bar.update(1)
    bar.close()


@torch.inference_mode()
def reading_states(lm: LoadedModel, convs: Sequence[AssistantRecord], turns: Sequence[str], layers: Sequence[int],
                   batch_size: int = 8, progress: bool = True) -> dict[int, torch.Tensor]:
    """The model's mean residual over the tokens of a user turn while it *reads* that turn after the conversation.

    For each (conversation, turn): the probe prompt (ending at the user-role header) followed by the turn's
    tokens, one forward pass; the residual at index ``r`` (``hidden_states[r]``: ``r = 0`` embeddings, ``r = i``
    the output of block ``i - 1``) averaged over the turn's positions. Contrasting these states for labelled
    genuine and non-genuine turns is the CAA/RepE "reading contrast".

    Args:
        lm: the model.
        convs: one conversation per turn.
        turns: the user-turn texts.
        layers: residual indices to keep.
        batch_size: rows per forward.
        progress: a tqdm bar.
    Returns:
        ``{layer: [n_turns, d_model] float32}``.
    """
    tok = lm.tokenizer
    rows = []
    for a, t in zip(convs, turns):
        pp = chat.build_probe_prompt(tok, a.prompt, a.response, history=a.messages or None)
        ids = tok(t, add_special_tokens=False)["input_ids"] or [tok.pad_token_id or 0]
        rows.append((list(pp.input_ids), list(ids)))
    out: dict[int, list[torch.Tensor]] = {r: [None] * len(rows) for r in layers}  # type: ignore[list-item]
    dev = lm.model.get_input_embeddings().weight.device
    bar = tqdm(total=len(rows), desc="reading states", unit="turn", disable=not progress)
    for idx in batches_by_length([len(p) + len(c) for p, c in rows], batch_size):
        ids, mask, pos = left_pad([rows[i][0] + rows[i][1] for i in idx], tok.pad_token_id or 0, dev)
        n = ids.shape[1]
        hs = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True,
                      use_cache=False).hidden_states
        for j, i in enumerate(idx):
            k = len(rows[i][1])
            for r in layers:
                out[r][i] = hs[r][j, n - k:].float().mean(0).cpu()
        bar.update(len(idx))
    bar.close()
    return {r: torch.stack(v) for r, v in out.items()}


@torch.inference_mode()
def boundary_norms(lm: LoadedModel, convs: Sequence[AssistantRecord], layers: Sequence[int], batch_size: int = 8
                   ) -> dict[int, float]:
    """The mean residual norm at the user-role boundary at each residual index in ``layers`` over ``convs``.

    Why: the study's vectors get this norm, so alpha is a multiple of the layer's typical residual size (the
    package's unit) whatever the direction's raw size.
    """
    tok = lm.tokenizer
    prompts = [list(chat.build_probe_prompt(tok, a.prompt, a.response, history=a.messages or None).input_ids)
               for a in convs]
    dev = lm.model.get_input_embeddings().weight.device
    norms: dict[int, list[float]] = {r: [] for r in layers}
    for idx in batches_by_length([len(p) for p in prompts], batch_size):
        ids, mask, pos = left_pad([prompts[i] for i in idx], tok.pad_token_id or 0, dev)
        hs = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True,
                      use_cache=False).hidden_states
        for r in layers:
            norms[r].extend(float(x) for x in hs[r][:, -1].float().norm(dim=-1))
    return {r: sum(v) / len(v) for r, v in norms.items()}
