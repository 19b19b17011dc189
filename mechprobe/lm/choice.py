"""Constrained choice over a fixed set of continuations with shared KV prefixes.

Used by the local judges and by the loopback server (a response_format label enum); it is generic
model machinery, so it lives with the models, below every judge.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from mechprobe.lm import chat
from mechprobe.lm.forward import kv_kw, logits_kept, out_cache

ANSWER_PREFIX = '{"label": "'
KV = list[tuple[torch.Tensor, torch.Tensor]]


def kv_of(cache: Any) -> KV:
    """(keys, values) per layer from a transformers cache object (v5 ``layers`` or older tuples)."""
    if hasattr(cache, "layers"):
        return [(lay.keys, lay.values) for lay in cache.layers]
    return [(k, v) for k, v in cache]  # legacy tuple-of-tuples


def cache_of(kv: KV, repeat: int = 1) -> Any:
    """A fresh DynamicCache holding ``kv`` (batch row repeated ``repeat`` times); ``kv`` is not mutated."""
    from transformers import DynamicCache  # lazy: slow import, model paths only

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        if repeat > 1:
            k, v = k.expand(repeat, *k.shape[1:]), v.expand(repeat, *v.shape[1:])
        cache.update(k, v, i)
    return cache


def crop_kv(kv: KV, n: int) -> KV:
    return [(k[:, :, :n], v[:, :, :n]) for k, v in kv]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChoiceScorer:
    """Score fixed choices as continuations of token prompts, reusing the KV of cached prefixes.

    ``remember(slot, ids)`` computes and keeps the KV of a prefix under a name (``"system"``,
    ``"item"``), itself reusing the best prefix already kept. ``score(ids)`` returns, per choice, the
    summed log-probability of the choice's tokens after ``ids``. Only the tokens after the longest
    kept prefix are run; the choices run as one right-padded batch (padding sits after every real
    token, so causal attention makes it invisible: no mask needed).

    ``pool_bytes`` > 0 keeps prefixes that :meth:`forget` is told to ``pool`` in a least-recently-used
    store of that many bytes, and :meth:`remember` of exactly the same ids takes them back instead of
    running them again. Why: a steering sweep or a study variant judges the *same* conversations once
    per condition; without the pool each call re-ran every conversation's prefill (py-spy: most of the
    held-out stage of ``steer.py``). Exact ids only, never a partial match, so a pooled prefix is the
    very tensors a fresh :meth:`remember` made the first time: verdicts do not depend on call order.
    """

    def __init__(self, model: Any, tokenizer: Any, choices: Sequence[str], pool_bytes: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.choices = list(choices)
        self.choice_ids = [list(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in self.choices]
        if any(not c for c in self.choice_ids):
            raise ValueError("a choice tokenises to nothing")
        self._kept: dict[str, tuple[list[int], KV]] = {}
        self.pool_bytes = int(pool_bytes)
        self._pool: OrderedDict[tuple[int, ...], tuple[KV, int]] = OrderedDict()
        self._pool_used = 0
        self.stats = {"prefix_tokens": 0, "turn_tokens": 0, "choice_tokens": 0, "pool_hits": 0}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _best(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """Longest usable prefix of ``ids`` among kept ones (leaving >= 1 token to run)."""
        best_n, best_kv = 0, None
        for kept_ids, kv in self._kept.values():
            n = min(common_prefix_len(kept_ids, ids), len(ids) - 1)
            if n > best_n:
                best_n, best_kv = n, kv
        if best_kv is not None:
            best_kv = crop_kv(best_kv, best_n)
        return best_n, best_kv

    @torch.inference_mode()
    def _run(self, ids: Sequence[int], count: str) -> tuple[KV, torch.Tensor]:
        """KV of all of ``ids`` and the log-softmax at its last position."""
        n, kv = self._best(ids)
        cache = cache_of(kv) if kv is not None else None
        x = torch.tensor([list(ids[n:])], device=self.device)
        out = logits_kept(self.model, 1, input_ids=x, **kv_kw(self.model, cache), use_cache=True)
        self.stats[count] += len(ids) - n
        return kv_of(out_cache(out)), torch.log_softmax(out.logits[0, -1].float(), -1)

    def remember(self, slot: str, ids: Sequence[int]) -> None:
        """Keep the KV of prefix ``ids`` under ``slot`` (replacing what the slot held)."""
        if slot in self._kept and self._kept[slot][0] == list(ids):
            return
        self._kept.pop(slot, None)
        hit = self._pool.get(tuple(ids))
        if hit is not None:
            self._pool.move_to_end(tuple(ids))
            self.stats["pool_hits"] += 1
            self._kept[slot] = (list(ids), hit[0])
            return
        kv, _ = self._run(ids, "prefix_tokens")
        self._kept[slot] = (list(ids), kv)

    def pooled(self, ids: Sequence[int]) -> KV | None:
        """The pooled KV of exactly ``ids`` (None when not pooled); leaves the pool's order alone.

        Why public: the activation cache of a run reads the conversations the judge already ran
        (:func:`mechprobe.activations.cache.cache_run` ``prefixes=``), so their prefill is not paid twice."""
        hit = self._pool.get(tuple(ids))
        return None if hit is None else hit[0]

    def clear_pool(self) -> None:
        """Drop every pooled prefix (frees their memory)."""
        self._pool.clear()
        self._pool_used = 0

    def forget(self, slot: str, pool: bool = False) -> None:
        """Drop ``slot``; with ``pool`` (and ``pool_bytes`` > 0) keep its prefix for a later exact
        :meth:`remember`, evicting the least recently used pooled prefixes beyond ``pool_bytes``."""
        got = self._kept.pop(slot, None)
        if not pool or got is None or self.pool_bytes <= 0:
            return
        key = tuple(got[0])
        if key in self._pool:
            self._pool.move_to_end(key)
            return
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in got[1])
        if size > self.pool_bytes:
            return
        self._pool[key] = (got[1], size)
        self._pool_used += size
        while self._pool_used > self.pool_bytes:
            _, (_, old) = self._pool.popitem(last=False)
            self._pool_used -= old

    @torch.inference_mode()
    def score(self, ids: Sequence[int]) -> list[float]:
        """Summed log-probability of each choice's tokens as the continuation of ``ids``."""
        kv, first = self._run(ids, "turn_tokens")
        out = [float(first[c[0]]) for c in self.choice_ids]
        longest = max(len(c) for c in self.choice_ids)
        if longest > 1:
            b = len(self.choice_ids)
            rows = [c[:-1] + [c[0]] * (longest - len(c)) for c in self.choice_ids]  # pad after real tokens
            x = torch.tensor(rows, device=self.device)
            res = self.model(input_ids=x, **kv_kw(self.model, cache_of(kv, repeat=b)), use_cache=True)
            logp = torch.log_softmax(res.logits.float(), -1)
            self.stats["choice_tokens"] += sum(len(c) - 1 for c in self.choice_ids)
            for r, c in enumerate(self.choice_ids):
                out[r] += float(sum(logp[r, j, c[j + 1]] for j in range(len(c) - 1)))
        return out


def normalise(scores: Sequence[float], bias: Sequence[float] | None = None) -> list[float]:
    """Softmax over (score + bias): the per-label probabilities, summing to 1."""
    z = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    m = max(z)
    e = [math.exp(v - m) for v in z]
    t = sum(e)
    return [v / t for v in e]


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The scored prompt: the chat template with the assistant header, then :data:`ANSWER_PREFIX`."""

    text = chat.render(tokenizer, messages, add_generation_prompt=True) + ANSWER_PREFIX
    ids, _ = chat.tokenize_rendered(tokenizer, text)
    return text, ids
