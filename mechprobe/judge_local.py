"""The local LLM judge: a chat model in-process, its verdict a constrained choice over the taxonomy.

``--judge local:MODEL`` (an embedded name such as ``qwen2.5-coder-1.5b-instruct``, a HF directory or
a ``.gguf`` file). Same system prompt, taxonomy and user message as ``openai:MODEL``
(:func:`mechprobe.judge_llm.build_messages`); the difference is how the answer is read:

* **constrained choice, no free generation.** After the chat template's assistant header and the
  fixed answer prefix :data:`ANSWER_PREFIX` (``{"label": "``), every taxonomy label is scored as a
  continuation (sum of the log-probabilities of its tokens). Normalised over the labels this gives
  per-label probabilities (kept in ``labels.jsonl``); the verdict is the most probable label. A
  free-running small model wanders off-format; a choice is always a valid label;
* **shared prefixes.** The system prompt and taxonomy (and any few-shot examples) are computed once
  per run, each conversation once for all its user turns (KV-cache reuse); per turn only the
  generated turn and the label continuations are run, the eight labels as one batch. Which prefix
  to reuse is decided on token ids (longest common prefix), so the scored token sequence is exactly
  the tokenisation of the whole prompt: the same as an unshared run, and as the server path
  (``python -m mechprobe.server`` answers a ``response_format`` with a label enum by the same
  choice), up to float rounding;
* **calibration.** An optional additive log-bias per label (fitted on the *dev* split of the hand
  labels, never test) corrects a small model's label priors; it is part of the judge's name;
* **few-shot.** Optional examples come only from the dev split of ``tests/fixtures/hand_labels.jsonl``.

Verdicts are cached on disk like the ``openai:`` judge's (key: judge name, weights, dtype,
conversation, raw turn), so a re-run or a resumed run costs nothing for turns already judged.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .judge import JudgeInput
from .models import kv_kw, logits_kept, out_cache
from .records import LabelRecord
from .taxonomy import LABELS, TAXONOMY_VERSION, is_genuine

CHOICE_VERSION = "choice-v1"
ANSWER_PREFIX = '{"label": "'
DEFAULT_LOCAL_MODEL = "qwen2.5-coder-1.5b-instruct"
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hand_labels.jsonl"

KV = list[tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------- KV helpers


def _kv_of(cache: Any) -> KV:
    """(keys, values) per layer from a transformers cache object (v5 ``layers`` or older tuples)."""
    if hasattr(cache, "layers"):
        return [(lay.keys, lay.values) for lay in cache.layers]
    return [(k, v) for k, v in cache]  # legacy tuple-of-tuples


def _cache_of(kv: KV, repeat: int = 1) -> Any:
    """A fresh DynamicCache holding ``kv`` (batch row repeated ``repeat`` times); ``kv`` is not mutated."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        if repeat > 1:
            k, v = k.expand(repeat, *k.shape[1:]), v.expand(repeat, *v.shape[1:])
        cache.update(k, v, i)
    return cache


def _crop(kv: KV, n: int) -> KV:
    return [(k[:, :, :n], v[:, :, :n]) for k, v in kv]


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
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
            n = min(_lcp(kept_ids, ids), len(ids) - 1)
            if n > best_n:
                best_n, best_kv = n, kv
        if best_kv is not None:
            best_kv = _crop(best_kv, best_n)
        return best_n, best_kv

    @torch.inference_mode()
    def _run(self, ids: Sequence[int], count: str) -> tuple[KV, torch.Tensor]:
        """KV of all of ``ids`` and the log-softmax at its last position."""
        n, kv = self._best(ids)
        cache = _cache_of(kv) if kv is not None else None
        x = torch.tensor([list(ids[n:])], device=self.device)
        out = logits_kept(self.model, 1, input_ids=x, **kv_kw(self.model, cache), use_cache=True)
        self.stats[count] += len(ids) - n
        return _kv_of(out_cache(out)), torch.log_softmax(out.logits[0, -1].float(), -1)

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
            res = self.model(input_ids=x, **kv_kw(self.model, _cache_of(kv, repeat=b)), use_cache=True)
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
    from . import chat

    text = chat.render(tokenizer, messages, add_generation_prompt=True) + ANSWER_PREFIX
    ids, _ = chat.tokenize_rendered(tokenizer, text)
    return text, ids


def few_shot_rows(k: int, path: str | Path = FIXTURE) -> list[dict[str, Any]]:
    """``k`` examples from the *dev* split of the hand labels, one label at a time in taxonomy order.

    Only dev rows, so test-split agreement stays a held-out measurement. Within a label, the first
    dev row whose turn is short (examples lengthen every prompt) is taken.
    """
    if k <= 0:
        return []
    from .io import read_jsonl

    rows = [r for r in read_jsonl(path) if r.get("split") == "dev"]
    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: len(r["response"]) + len(r["raw_text"])):
        by_label.setdefault(r["label"], []).append(r)
    out: list[dict[str, Any]] = []
    depth = 0
    while len(out) < k and any(len(v) > depth for v in by_label.values()):
        for lab in LABELS:
            if len(out) < k and len(by_label.get(lab, [])) > depth:
                out.append(by_label[lab][depth])
        depth += 1
    return out


class LocalJudge:
    """Label user turns with a local chat model by constrained choice (see the module docstring).

    ``bias`` maps labels to additive log-biases (calibration fitted on dev); ``few_shot`` is the
    number of dev examples put before each turn; ``loaded`` is an already loaded
    :class:`~mechprobe.models.LoadedModel` (tests, the server). ``cache_dir=False`` disables the
    verdict cache.
    """

    def __init__(self, model: str = DEFAULT_LOCAL_MODEL, *, dtype: str | torch.dtype | None = None,
                 device: str | None = None, few_shot: int = 0, bias: dict[str, float] | None = None,
                 cache_dir: str | Path | bool | None = None, loaded: Any = None):
        from .judge_llm import PROMPT_VERSION, JudgeCache, default_cache_dir

        if loaded is None:
            from .models import default_device, load_model

            dev = torch.device(device) if device else default_device()
            # bf16 on CPU: the judge only prefills (compute-bound), and with AVX512-BF16 a bf16 1.5B
            # model prefilled 1.8x faster than fp32 here (docs/judge_agreement.md), at half the memory.
            loaded = load_model(model, device=dev, dtype=dtype or torch.bfloat16)
        self.lm = loaded
        self.model_name = loaded.name
        unknown = sorted(set(bias or {}) - set(LABELS))
        if unknown:
            raise ValueError(f"bias names labels not in the taxonomy: {unknown}")
        self.bias = [float((bias or {}).get(lab, 0.0)) for lab in LABELS]
        self.examples = few_shot_rows(few_shot)
        tag = f"{PROMPT_VERSION}+{CHOICE_VERSION}"
        if self.examples:
            tag += f"+fs{len(self.examples)}"
        if any(self.bias):
            tag += "+cal" + hashlib.sha256(json.dumps(self.bias).encode()).hexdigest()[:8]
        self.name = f"local:{self.model_name}@{tag}"
        self.scorer = ChoiceScorer(loaded.model, loaded.tokenizer, LABELS)
        if cache_dir is False:
            self.cache: Any = None
        else:
            self.cache = JudgeCache(default_cache_dir() if cache_dir in (None, True) else Path(str(cache_dir)))
        self.stats = {"judged": 0, "cache_hits": 0, "seconds": 0.0}

    # ------------------------------------------------------------------ prompt

    def messages(self, inp: JudgeInput) -> list[dict[str, str]]:
        """The ``openai:`` judge's messages, with few-shot turns between system and user when asked."""
        from .judge import inputs_from_rows
        from .judge_llm import build_messages

        msgs = build_messages(inp, structured=True)
        shots: list[dict[str, str]] = []
        for ex_inp, ex in zip(inputs_from_rows(self.examples), self.examples):
            shots.append(build_messages(ex_inp, structured=True)[1])
            shots.append({"role": "assistant", "content": json.dumps({"label": ex["label"]})})
        return msgs[:1] + shots + msgs[1:]

    def public_config(self) -> dict[str, Any]:
        from .judge_llm import PROMPT_VERSION

        return {"model": self.model_name, "weight_hash": self.lm.weight_hash, "dtype": str(self.lm.dtype),
                "prompt_version": PROMPT_VERSION, "choice_version": CHOICE_VERSION,
                "taxonomy": TAXONOMY_VERSION, "answer_prefix": ANSWER_PREFIX,
                "few_shot": [r["record_id"] for r in self.examples],
                "bias": dict(zip(LABELS, self.bias)), "cache": str(self.cache.root) if self.cache else None}

    def _key(self, inp: JudgeInput) -> str:
        payload = {"judge": self.name, "weights": self.lm.weight_hash, "dtype": str(self.lm.dtype),
                   "conversation": inp.conversation(), "user_turn": inp.raw_text,
                   "stop_reason": inp.stop_reason}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    # ------------------------------------------------------------------ scoring

    def _record(self, inp: JudgeInput, scores: list[float]) -> LabelRecord:
        probs = normalise(scores, self.bias)
        best = max(range(len(LABELS)), key=lambda i: probs[i])
        lab = LABELS[best]
        return LabelRecord(record_id=inp.record_id, label=lab, genuine=is_genuine(lab),
                           rationale=f"constrained choice, p={probs[best]:.3f}", judge=self.name,
                           probs={k: round(p, 6) for k, p in zip(LABELS, probs)})

    def scores(self, inp: JudgeInput) -> list[float]:
        """Raw summed log-probabilities per label (no bias), reusing the system and item prefixes."""
        from .judge_llm import render_user_message_parts

        msgs = self.messages(inp)
        text, ids = prompt_ids(self.lm.tokenizer, msgs)
        conv_part, turn_part = render_user_message_parts(inp)
        tok = self.lm.tokenizer
        from . import chat

        # Character cuts of the full prompt; the scorer then reuses them by token-id prefix, so a
        # cut that falls inside a token only costs a token or two of recomputation, never a change.
        user_at = text.rfind(conv_part + turn_part)
        turn_at = text.rfind(turn_part)
        if user_at > 0:
            self.scorer.remember("system", chat.tokenize_rendered(tok, text[:user_at])[0])
        if turn_at > 0:
            self.scorer.remember("item", chat.tokenize_rendered(tok, text[:turn_at])[0])
        return self.scorer.score(ids)

    def label(self, inp: JudgeInput) -> LabelRecord:
        if self.cache is not None:
            hit = self.cache.get(self._key(inp))
            if hit is not None and isinstance(hit.get("scores"), list) and len(hit["scores"]) == len(LABELS):
                self.stats["cache_hits"] += 1
                return self._record(inp, [float(s) for s in hit["scores"]])
        import time

        t0 = time.perf_counter()
        sc = self.scores(inp)
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["judged"] += 1
        if self.cache is not None:
            self.cache.put(self._key(inp), {"scores": sc, "labels": list(LABELS), "judge": self.name})
        return self._record(inp, sc)

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        """Turns grouped by conversation (each conversation computed once), yielded as judged."""
        order: dict[str, list[JudgeInput]] = {}
        for inp in inputs:
            key = json.dumps(inp.conversation(), sort_keys=True, ensure_ascii=False)
            order.setdefault(key, []).append(inp)
        for group in order.values():
            for inp in group:
                yield self.label(inp)
            self.scorer.forget("item")
