"""The local LLM judge: a chat model in-process, its verdict a constrained choice over the taxonomy.

``--judge local:MODEL`` (an embedded name such as ``qwen2.5-coder-1.5b-instruct``, a HF directory or
a ``.gguf`` file). Same system prompt, taxonomy and user message as ``openai:MODEL``
(:func:`mechprobe.judges.llm.build_messages`); the difference is how the answer is read:

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
  (``mechprobe serve`` answers a ``response_format`` with a label enum by the same
  choice), up to float rounding;
* **calibration.** An optional additive log-bias per label (fitted on the *dev* split of the
  model-written labels, never test) corrects a small model's label priors; it is part of the judge's name;
* **few-shot.** Optional examples come only from the dev split of the model-written label fixture, shipped with
  the package as ``mechprobe/data/judge_examples_dev.jsonl`` (so a wheel install has them).

Verdicts are cached on disk like the ``openai:`` judge's (key: judge name, weights, dtype,
conversation, raw turn), so a re-run or a resumed run costs nothing for turns already judged.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from mechprobe.io import read_jsonl
from mechprobe.judges.base import JudgeInput, inputs_from_rows, load_judge_model
from mechprobe.judges.llm import (
    LOCAL_PROMPT_VERSION,
    LOCAL_SYSTEM_PROMPT,
    JudgeCache,
    build_messages,
    default_cache_dir,
    render_user_message_parts,
)
from mechprobe.lm import chat
from mechprobe.lm.choice import ANSWER_PREFIX, ChoiceScorer, normalise, prompt_ids
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import LABELS, TAXONOMY_VERSION, is_genuine

CHOICE_VERSION = "choice-v1"
DEFAULT_LOCAL_MODEL = "qwen2.5-coder-1.5b-instruct"
# The dev rows of the model-written label fixture, read as package data: only dev rows, so test-split agreement
# stays a held-out measurement.
EXAMPLES = Path(str(resources.files("mechprobe") / "data" / "judge_examples_dev.jsonl"))


def few_shot_rows(k: int, path: str | Path = EXAMPLES) -> list[dict[str, Any]]:
    """``k`` examples from the *dev* split of the model-written labels, one label at a time in taxonomy order.

    Only dev rows, so test-split agreement stays a held-out measurement. Within a label, the first
    dev row whose turn is short (examples lengthen every prompt) is taken.
    """
    if k <= 0:
        return []
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
    :class:`~mechprobe.lm.models.LoadedModel` (tests, the server). ``cache_dir=False`` disables the
    verdict cache.

    Args:
        model: judge model: an embedded name (default ``"qwen2.5-coder-1.5b-instruct"``), a HF directory or a
            ``.gguf`` file; ignored when ``loaded`` is given.
        dtype: load dtype; None (default) = bf16 on a GPU or a CPU with native bf16, else fp32.
        device: load device; None (default) = CUDA when visible, else CPU.
        few_shot: number of dev-split model-written-label examples put before each turn (default 0).
        bias: label -> additive log-bias (calibration fitted on dev); None (default) = no bias. Unknown
            labels raise ValueError.
        cache_dir: verdict cache directory; None/True (default) = the shared judge cache, False = none.
        loaded: an already loaded :class:`~mechprobe.lm.models.LoadedModel` to score with; None (default).

    Attributes:
        name: ``"local:<model>@<prompt version>+choice-v1"`` plus ``+fs<k>`` (few-shot) and ``+cal<hash>``
            (bias) when used.
        stats: counters ``judged``, ``cache_hits``, ``seconds``.

    Example:
        >>> from mechprobe import JudgeInput, LocalJudge
        >>> judge = LocalJudge("qwen2.5-coder-1.5b-instruct", device="cpu")            # doctest: +SKIP
        >>> inp = JudgeInput(record_id="r1", prompt="What is 12 * 7?", response="84.", raw_text="Why 84?")
        >>> rec = judge.label(inp)                                                     # doctest: +SKIP
        >>> rec.label in rec.probs, abs(sum(rec.probs.values()) - 1) < 1e-3            # doctest: +SKIP
        (True, True)
    """

    def __init__(self, model: str = DEFAULT_LOCAL_MODEL, *, dtype: str | torch.dtype | None = None,
                 device: str | None = None, few_shot: int = 0, bias: dict[str, float] | None = None,
                 cache_dir: str | Path | bool | None = None, loaded: Any = None):
        loaded = load_judge_model(model, dtype, device, loaded)
        self.lm = loaded
        self.model_name = loaded.name
        unknown = sorted(set(bias or {}) - set(LABELS))
        if unknown:
            raise ValueError(f"bias names labels not in the taxonomy: {unknown}")
        self.bias = [float((bias or {}).get(lab, 0.0)) for lab in LABELS]
        self.examples = few_shot_rows(few_shot)
        tag = f"{LOCAL_PROMPT_VERSION}+{CHOICE_VERSION}"
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

        msgs = build_messages(inp, structured=True, system=LOCAL_SYSTEM_PROMPT)
        shots: list[dict[str, str]] = []
        for ex_inp, ex in zip(inputs_from_rows(self.examples), self.examples):
            shots.append(build_messages(ex_inp, structured=True)[1])
            shots.append({"role": "assistant", "content": json.dumps({"label": ex["label"]})})
        return msgs[:1] + shots + msgs[1:]

    def public_config(self) -> dict[str, Any]:
        return {"model": self.model_name, "weight_hash": self.lm.weight_hash, "dtype": str(self.lm.dtype),
                "prompt_version": LOCAL_PROMPT_VERSION, "choice_version": CHOICE_VERSION,
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

        msgs = self.messages(inp)
        text, ids = prompt_ids(self.lm.tokenizer, msgs)
        conv_part, turn_part = render_user_message_parts(inp)
        tok = self.lm.tokenizer

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
