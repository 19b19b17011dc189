"""Evaluate steering vectors on the user-turn probe: greedy follow-up rate vs alpha, with controls.

The protocol (what ``experiments/steer.py`` runs):

1. Items are split by a hash of their id into a *train* half (vectors are built and the layer is
   chosen here) and a *held-out* half (the only place final numbers come from).
2. Vectors: difference of means of boundary states (genuine minus not) over train rows; controls are a
   random vector of equal norm and the negated vector, at the same alphas.
3. For each (vector, alpha): greedy user turns on held-out items with the vector added at the chosen
   positions, judged by the same judge as the cache labels. Reported: follow-up rate (Wilson 95% CI),
   label distribution, degeneration rate, and fluency (mean per-token NLL of the steered turn under the
   unsteered model, i.e. log-perplexity).
4. Side effect: task accuracy of the assistant turn with the vector left on at every position.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import chat
from .generation import decode, generate, left_pad
from .models import LoadedModel
from .records import AssistantRecord
from .stats import wilson
from .steering import SteeringVector, steer


def split_of(item_id: str, held_out_fraction: float = 0.5) -> str:
    """Deterministic item split: the same item is always train or held-out, across runs and machines."""
    h = int(hashlib.sha256(item_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < held_out_fraction else "train"




@dataclass
class SteeredTurn:
    item_id: str
    kind: str
    alpha: float
    layer: int
    positions: str
    raw_text: str
    text: str
    stop_reason: str
    nll: float | None


def steered_user_turns(lm: LoadedModel, assistants: Sequence[AssistantRecord], vector: SteeringVector | None,
                       alpha: float, positions: str, max_new_tokens: int, batch_size: int = 16,
                       system: str | None = None) -> list[SteeredTurn]:
    """Greedy user turns under steering (``vector=None`` or ``alpha=0``: unsteered)."""
    tok = lm.tokenizer
    stops = chat.stop_token_ids(tok, lm.model)
    pps = [chat.build_probe_prompt(tok, a.prompt, a.response, system=system, history=a.messages or None)
           for a in assistants]
    out: list[SteeredTurn] = []
    for i in range(0, len(pps), batch_size):
        chunk = pps[i:i + batch_size]
        prompts = [p.input_ids for p in chunk]
        if vector is not None and alpha != 0:
            with steer(lm.model, vector, alpha, positions):
                gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens,
                                pad_id=tok.pad_token_id)
        else:
            gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens, pad_id=tok.pad_token_id)
        nlls = turn_nll(lm, prompts, [g.token_ids for g in gens])
        for a, g, nll in zip(assistants[i:i + batch_size], gens, nlls):
            raw, text = decode(tok, g)
            out.append(SteeredTurn(a.item_id, vector.kind if vector is not None else "none", alpha,
                                   vector.layer if vector is not None else -1, positions, raw, text,
                                   g.stop_reason, nll))
    return out


@torch.inference_mode()
def turn_nll(lm: LoadedModel, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
             ) -> list[float | None]:
    """Mean per-token negative log-likelihood of each continuation under the *unsteered* model."""
    full = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    dev = next(lm.model.parameters()).device
    ids, mask, pos = left_pad(full, lm.tokenizer.pad_token_id, dev)
    logp = torch.log_softmax(lm.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float(), -1)
    out: list[float | None] = []
    t = ids.shape[1]
    for i, c in enumerate(continuations):
        if not c:
            out.append(None)
            continue
        tgt = torch.tensor(list(c), device=dev)
        rows = torch.arange(t - len(c) - 1, t - 1, device=dev)
        out.append(float(-logp[i, rows, tgt].mean()))
    return out


def is_degenerate(text: str) -> bool:
    """Empty, or a repetition loop: few distinct tokens, or one 3-gram covering much of the turn."""
    words = text.split()
    if not words:
        return True
    if len(words) >= 8 and len(set(words)) / len(words) < 0.35:
        return True
    grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
    return bool(grams) and len(words) >= 12 and grams.most_common(1)[0][1] * 3 / len(words) > 0.5


def summarize(turns: Sequence[SteeredTurn], labels: dict[str, str], key: str) -> dict[str, Any]:
    """Follow-up rate with CI, label distribution, degeneration and fluency for one (kind, alpha)."""
    n = len(turns)
    genuine = sum(labels.get(f"{key}|{t.item_id}") == "genuine_followup" for t in turns)
    dist = Counter(labels.get(f"{key}|{t.item_id}", "missing") for t in turns)
    degen = sum(is_degenerate(t.text) or labels.get(f"{key}|{t.item_id}") == "empty_or_degenerate" for t in turns)
    nlls = [t.nll for t in turns if t.nll is not None]
    return {"n": n, "genuine": genuine, "followup_rate": genuine / n if n else 0.0, "ci": list(wilson(genuine, n)),
            "degenerate_rate": degen / n if n else 0.0, "mean_nll": sum(nlls) / len(nlls) if nlls else None,
            "labels": dict(dist)}


def assistant_accuracy(lm: LoadedModel, items: Sequence[AssistantRecord], vector: SteeringVector | None,
                       alpha: float, max_new_tokens: int, batch_size: int = 16,
                       system: str | None = None) -> float | None:
    """Task accuracy of the assistant turn with the vector on at every position (leak check).
    ``system`` must be the run's system prompt, so the unsteered accuracy is the run's own."""
    from .scoring import score

    scored = [a for a in items if a.gold is not None]
    if not scored:
        return None
    tok = lm.tokenizer
    stops = chat.assistant_stop_token_ids(tok, lm.model)
    correct = 0.0
    for i in range(0, len(scored), batch_size):
        chunk = scored[i:i + batch_size]
        prompts = [chat.build_assistant_prompt(tok, a.prompt, system=system, history=a.messages or None)
                   for a in chunk]
        if vector is not None and alpha != 0:
            with steer(lm.model, vector, alpha, "all"):
                gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens,
                                pad_id=tok.pad_token_id)
        else:
            gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens, pad_id=tok.pad_token_id)
        for a, g in zip(chunk, gens):
            meta = {"scorer": "gsm8k"} if a.dataset == "builtin" else {}
            correct += score(a.dataset, decode(tok, g)[1], a.gold, meta)[0] or 0.0
    return correct / len(scored)
