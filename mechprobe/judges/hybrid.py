"""The hybrid judge: the offline rules for form, a local model's likelihood ratio for grounding.

``--judge hybrid:MODEL`` (an embedded name such as ``qwen2.5-coder-1.5b-instruct``, a HF directory
or a ``.gguf``). Why this split: measured on the model-written labels, the offline rules agree with the
labellers on the *form* of a turn (empty, word salad, an opened assistant header, a restated
query) but not on *grounding*, the one property the label is about; and a 1.5B model asked to apply
the taxonomy (``local:``) or narrow yes/no questions answers at chance or says yes to everything
(``docs/judge_agreement.md``). What a small model does measure well is likelihood. So:

* the offline judge labels every turn; its form labels (empty, degenerate, identity, meta,
  restatement, assistant continuation) stand;
* a turn it calls ``genuine_followup``, ``generic_followup`` or ``new_query`` (or ungrounded
  filler) is a *candidate*: the model scores the turn's own text as the next user message twice,
  after the real conversation and after the same query with a contentless answer
  (:data:`NULL_RESPONSE`). The mean per-token log-ratio is the **grounding PMI**: how much the
  assistant's actual answer makes this turn more likely. A reaction to the answer needs the answer;
  a new problem, a drift or a generic "thanks" does not;
* candidate → ``genuine_followup`` when the PMI is at least :attr:`HybridJudge.threshold` (the model
  alone finds it grounded), or when the offline rules call it genuine and the PMI is at least
  :attr:`HybridJudge.veto` (the model does not contradict them). An offline ``genuine_followup`` below
  the veto becomes ``new_query`` (a new problem that merely reuses a number of the answer: the offline
  rules' main error on held-out turns); other candidates keep their offline label. Both numbers were
  chosen on the dev split of the model-written labels (a 7 x 7 grid, mean binary κ against both labellers),
  never on test.

Cost: only candidates run the model; per turn two forwards over the turn's tokens, with each item's
two conversation prefixes computed once for all its turns (KV reuse by token-id prefix). ``probs``
in ``labels.jsonl`` hold ``genuine_followup`` = sigmoid((PMI - threshold) / scale) for candidates and 0
for form labels (an AUROC or a calibration plot reads it) and ``pmi`` itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mechprobe.judges.base import JudgeInput, load_judge_model
from mechprobe.judges.llm import JudgeCache, default_cache_dir
from mechprobe.judges.local import DEFAULT_LOCAL_MODEL
from mechprobe.judges.offline import OfflineJudge, split_roles
from mechprobe.lm import chat
from mechprobe.lm.choice import ChoiceScorer, cache_of, crop_kv
from mechprobe.lm.forward import kv_kw
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import GENUINE, is_genuine

HYBRID_VERSION = "hybrid-v1"
HYBRID_V2 = "hybrid-v2"  # + the voice check (``--judge hybrid-voice:MODEL``)
NULL_RESPONSE = "Sure, I can help with that."
CANDIDATES = frozenset({GENUINE, "generic_followup", "new_query"})
# Chosen on the dev split of tests/fixtures/hand_labels.jsonl (docs/judge_agreement.md); test untouched.
DEFAULT_THRESHOLD = 0.3
DEFAULT_VETO = 0.0
SCALE = 0.1  # log-ratio units per logit of the reported P(genuine); only shapes probs, not labels
DEFAULT_POOL_MB = 1024.0  # kept conversation prefixes: ~0.5 GB for 96 GSM8K items on the 1.5B judge (bf16)
DEFAULT_VOICE = 0.1  # chosen on the dev splits of both 1.5B fixtures (docs/judge_agreement.md); hybrid-voice: only


@torch.inference_mode()
def turn_logprob(store: ChoiceScorer, tokenizer: Any, conv: list[dict[str, str]], turn: str,
                 slot: str) -> tuple[float, int]:
    """(summed log-probability, token count) of ``turn`` as the next *user* message after ``conv``.

    The prefix (conversation + the template's own user header) is kept under ``slot`` so the item's
    other turns reuse it; the turn's tokens are those of the whole rendering after the header
    (tokenised in context, so a merge across the boundary cannot shift them).
    """

    pre_text = chat.render(tokenizer, conv) + chat.user_header(tokenizer)
    full = pre_text + turn
    ids, _ = chat.tokenize_rendered(tokenizer, full)
    pre = chat.ids_up_to(tokenizer, full, len(pre_text))
    if len(ids) <= len(pre):
        return 0.0, 0
    store.remember(slot, pre)
    n, kv = store._best(ids)
    n = min(n, len(pre) - 1)
    if kv is not None:
        kv = crop_kv(kv, n)
    x = torch.tensor([ids[n:]], device=next(store.model.parameters()).device)
    out = store.model(input_ids=x, **kv_kw(store.model, cache_of(kv) if kv is not None and n > 0 else None),
                      use_cache=True)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    idx = torch.arange(len(pre) - 1 - n, len(ids) - 1 - n)
    tgt = torch.tensor(ids[len(pre):])
    store.stats["turn_tokens"] += len(ids) - n
    return float(logp[idx, tgt].sum()), len(ids) - len(pre)


@torch.inference_mode()
def turn_logprobs(store: ChoiceScorer, tokenizer: Any, conv: list[dict[str, str]], turns: Sequence[str],
                  slot: str, max_rows: int = 16, header: str | None = None) -> list[tuple[float, int]]:
    """:func:`turn_logprob` for several turns after the same conversation, run as right-padded batches.

    Why: on a CPU a forward of a 1.5B model over a few dozen tokens costs about one read of its weights
    whatever the batch, so the turns of one conversation (greedy + samples, 5-17 in the study) scored together
    cost about as much as one. Every row continues the same kept prefix (its KV repeated), so positions need
    no mask: padding sits after each row's real tokens, where causal attention cannot see it. Turns whose
    in-context tokenisation cuts the prefix differently run alone through :func:`turn_logprob`. Same values
    as one turn at a time up to float summation order (tested: fp32 to 1e-4; in bf16 the batch shape can move
    a log-probability by a bf16 rounding step).
    """

    pre_text = chat.render(tokenizer, conv) + (chat.user_header(tokenizer) if header is None else header)
    out: list[tuple[float, int] | None] = [None] * len(turns)
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for i, turn in enumerate(turns):
        full = pre_text + turn
        ids, _ = chat.tokenize_rendered(tokenizer, full)
        pre = chat.ids_up_to(tokenizer, full, len(pre_text))
        if len(ids) <= len(pre):
            out[i] = (0.0, 0)
            continue
        if ids[:len(pre)] != list(pre):
            if header is not None:  # turn_logprob knows only the user header
                raise ValueError("turn tokenised across the header boundary; score it alone with the user header")
            out[i] = turn_logprob(store, tokenizer, conv, turn, slot)
            continue
        groups.setdefault(tuple(pre), []).append((i, list(ids)))
    dev = next(store.model.parameters()).device
    for pre_t, rows in groups.items():
        pre = list(pre_t)
        store.remember(slot, pre)
        n = len(pre) - 1  # the last prefix token runs with the turn: its logits predict the turn's first token
        kv = crop_kv(store._kept[slot][1], n) if n > 0 else None
        for s in range(0, len(rows), max_rows):
            chunk = rows[s:s + max_rows]
            width = max(len(ids) - n for _, ids in chunk)
            x = torch.tensor([ids[n:] + [ids[-1]] * (width - (len(ids) - n)) for _, ids in chunk], device=dev)
            res = store.model(input_ids=x, **kv_kw(store.model, cache_of(kv, repeat=len(chunk)) if kv else None),
                              use_cache=True)
            logp = torch.log_softmax(res.logits.float(), -1)
            for r, (i, ids) in enumerate(chunk):
                k = len(ids) - len(pre)
                tgt = torch.tensor(ids[len(pre):], device=logp.device)
                out[i] = (float(logp[r, torch.arange(k, device=logp.device), tgt].sum()), k)
                store.stats["turn_tokens"] += len(ids) - n
    return [o if o is not None else (0.0, 0) for o in out]


def grounding_pmi_many(store: ChoiceScorer, tokenizer: Any, inp: JudgeInput, texts: Sequence[str],
                       memo: dict[str, tuple[float, int]] | None = None) -> list[float]:
    """:func:`grounding_pmi` of several turns after the same conversation (batched: :func:`turn_logprobs`).

    ``memo`` (text -> log p(turn | real conversation, user header), tokens) receives the "real" half, which
    :func:`voice_scores` needs again for the same turns after the same conversation."""
    conv = inp.conversation()
    real = turn_logprobs(store, tokenizer, conv, texts, "real")
    if memo is not None:
        memo.update(zip(texts, real))
    null = conv[:-1] + [{"role": "assistant", "content": NULL_RESPONSE}]
    nul = turn_logprobs(store, tokenizer, null, texts, "null")
    return [(lr - ln) / max(n, 1) for (lr, n), (ln, _) in zip(real, nul)]


def assistant_header(tokenizer: Any, conv: list[dict[str, str]]) -> str:
    """The text the template puts before a new *assistant* turn after ``conv`` (its generation prompt).

    Read from the template itself (render with and without ``add_generation_prompt`` after a placeholder user
    turn), so no per-family strings: ``<|im_start|>assistant\n`` for ChatML, ``<start_of_turn>model\n`` for Gemma.
    """

    probe = conv + [{"role": "user", "content": "x"}]
    a, b = chat.render(tokenizer, probe), chat.render(tokenizer, probe, add_generation_prompt=True)
    if not b.startswith(a) or a == b:
        raise ValueError("the chat template has no generation prompt to read the assistant header from")
    return b[len(a):]


def voice_scores(store: ChoiceScorer, tokenizer: Any, inp: JudgeInput, texts: Sequence[str],
                 memo: dict[str, tuple[float, int]] | None = None) -> list[float]:
    """Per turn, mean per-token log p(turn as the next *user* message) - log p(turn as the next *assistant*
    message), both after the real conversation: the **voice** margin.

    Why: the grounding PMI cannot tell a user who challenges the answer's numbers from an assistant that
    re-solves the problem with them; both need the answer. Whether the model finds the text likelier in the
    user's slot than in the assistant's is exactly the voice question (model-written labels, docs/judge_agreement.md:
    AUROC 0.98 genuine vs assistant_continuation on the 1.5B fixture, 0.82 on steered turns).
    """
    conv = inp.conversation()
    memo = memo or {}
    # The user-slot half is grounding_pmi_many's "real" half: reuse it (one of the four turn passes a genuine
    # candidate costs; the judge is compute-bound in exactly these forwards, per py-spy).
    need = [t for t in dict.fromkeys(texts) if t not in memo]
    got = dict(zip(need, turn_logprobs(store, tokenizer, conv, need, "real"))) if need else {}
    user = [memo[t] if t in memo else got[t] for t in texts]
    asst = turn_logprobs(store, tokenizer, conv, texts, "assistant", header=assistant_header(tokenizer, conv))
    return [(lu - la) / max(n, 1) for (lu, n), (la, _) in zip(user, asst)]


def grounding_pmi(store: ChoiceScorer, tokenizer: Any, inp: JudgeInput, text: str) -> float:
    """Mean per-token log p(turn | query, real answer) - log p(turn | query, contentless answer)."""
    conv = inp.conversation()
    lp_real, n = turn_logprob(store, tokenizer, conv, text, "real")
    null = conv[:-1] + [{"role": "assistant", "content": NULL_RESPONSE}]
    lp_null, _ = turn_logprob(store, tokenizer, null, text, "null")
    return (lp_real - lp_null) / max(n, 1)


class HybridJudge:
    """Offline form rules + a local model's grounding PMI (see the module docstring).

    Args:
        model: scoring model: an embedded name (default ``"qwen2.5-coder-1.5b-instruct"``), a HF directory or a
            ``.gguf`` file; ignored when ``loaded`` is given.
        dtype: load dtype; None (default) = bf16 on a GPU or a CPU with native bf16, else fp32.
        device: load device; None (default) = CUDA when visible, else CPU.
        threshold: PMI (mean per-token log-ratio, nats) at or above which a candidate is
            ``genuine_followup``; None (default) = 0.3, chosen on the dev split.
        veto: PMI below which an offline ``genuine_followup`` becomes ``new_query``; None (default) = 0.0.
        cache_dir: PMI cache directory; None/True (default) = the shared judge cache, False = none.
        loaded: an already loaded :class:`~mechprobe.lm.models.LoadedModel`; None (default).
        embed: the inner :class:`OfflineJudge`'s ``embed`` switch (None: embedding variant when installed).
        voice: minimum voice score (user-slot minus assistant-slot log-probability of the turn) for a
            ``genuine_followup``; lower becomes ``assistant_continuation``. None (default) = no voice check
            (``hybrid-voice:`` uses 0.1).
        pool_mb: memory for kept conversation KV prefixes, in MiB (default 1024).

    Attributes:
        name: ``"hybrid:<model>@hybrid-v1+<offline name>"`` (``hybrid-v2+voice<v>`` with ``voice``), plus
            ``+t<threshold>`` / ``+v<veto>`` when not the defaults.
        threshold, veto, voice: the decision numbers above.
        stats: counters ``judged``, ``model_runs``, ``cache_hits``, ``seconds``.

    Example:
        >>> from mechprobe import HybridJudge, JudgeInput
        >>> judge = HybridJudge("qwen2.5-coder-1.5b-instruct", voice=0.1)             # doctest: +SKIP
        >>> inp = JudgeInput(record_id="r1", prompt="What is 12 * 7?", response="84.", raw_text="Why 84?")
        >>> rec = judge.label(inp)                                                     # doctest: +SKIP
        >>> rec.probs["genuine_followup"]                  # sigmoid((PMI - threshold) / 0.1)  # doctest: +SKIP
    """

    def __init__(self, model: str = DEFAULT_LOCAL_MODEL, *, dtype: str | torch.dtype | None = None,
                 device: str | None = None, threshold: float | None = None, veto: float | None = None,
                 cache_dir: str | Path | bool | None = None, loaded: Any = None, embed: bool | None = None,
                 voice: float | None = None, pool_mb: float = DEFAULT_POOL_MB):
        loaded = load_judge_model(model, dtype, device, loaded)
        self.lm = loaded
        self.model_name = loaded.name
        self.offline = OfflineJudge(embed=embed)
        self.threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        self.veto = DEFAULT_VETO if veto is None else float(veto)
        if not (math.isfinite(self.threshold) and math.isfinite(self.veto)):
            raise ValueError(f"threshold and veto must be finite numbers, got {threshold!r}, {veto!r}")
        tag = ("" if threshold is None else f"+t{self.threshold:g}") + ("" if veto is None else f"+v{self.veto:g}")
        self.voice = None if voice is None else float(voice)
        if self.voice is not None and not math.isfinite(self.voice):
            raise ValueError(f"voice must be a finite number, got {voice!r}")
        version = HYBRID_VERSION if self.voice is None else f"{HYBRID_V2}+voice{self.voice:g}"
        self.name = f"hybrid:{self.model_name}@{version}+{self.offline.name}{tag}"
        # its KV prefix store; conversations judged again in a later call (steering conditions, study variants)
        # take their prefixes from the pool instead of a new prefill
        self.store = ChoiceScorer(loaded.model, loaded.tokenizer, ["x"], pool_bytes=int(pool_mb * 2**20))
        if cache_dir is False:
            self.cache: Any = None
        else:
            self.cache = JudgeCache(default_cache_dir() if cache_dir in (None, True) else Path(str(cache_dir)))
        self.stats = {"judged": 0, "model_runs": 0, "cache_hits": 0, "seconds": 0.0}

    def public_config(self) -> dict[str, Any]:
        return {"model": self.model_name, "weight_hash": self.lm.weight_hash, "dtype": str(self.lm.dtype),
                "version": HYBRID_VERSION, "offline": self.offline.name, "null_response": NULL_RESPONSE,
                "threshold": self.threshold, "veto": self.veto, "voice": self.voice,
                "cache": str(self.cache.root) if self.cache else None}

    def _key(self, inp: JudgeInput, text: str) -> str:
        # Keyed on what the PMI depends on (not the threshold): a re-tuned threshold reuses every forward.
        payload = {"pmi": HYBRID_VERSION, "model": self.model_name, "weights": self.lm.weight_hash,
                   "dtype": str(self.lm.dtype), "null": NULL_RESPONSE, "conversation": inp.conversation(),
                   "turn": text}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def pmi(self, inp: JudgeInput, text: str) -> float:
        if self.cache is not None:
            hit = self.cache.get(self._key(inp, text))
            if hit is not None and isinstance(hit.get("pmi"), (int, float)):
                self.stats["cache_hits"] += 1
                return float(hit["pmi"])
        t0 = time.perf_counter()
        v = grounding_pmi(self.store, self.lm.tokenizer, inp, text)
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["model_runs"] += 1
        if self.cache is not None:
            self.cache.put(self._key(inp, text), {"pmi": v})
        return v

    def _cached_many(self, keys: Sequence[str], field: str, inputs: Sequence[JudgeInput], texts: Sequence[str],
                     compute: Callable[..., list[float]], count_runs: bool = False) -> list[float]:
        """Per turn of one conversation: the cached ``field`` value, else ``compute`` on the misses in one batch."""
        out: list[float | None] = [None] * len(keys)
        if self.cache is not None:
            for i, k in enumerate(keys):
                hit = self.cache.get(k)
                if hit is not None and isinstance(hit.get(field), (int, float)):
                    self.stats["cache_hits"] += 1
                    out[i] = float(hit[field])
        todo = [i for i, v in enumerate(out) if v is None]
        if todo:
            t0 = time.perf_counter()
            vals = compute(self.store, self.lm.tokenizer, inputs[todo[0]], [texts[i] for i in todo])
            self.stats["seconds"] += time.perf_counter() - t0
            if count_runs:
                self.stats["model_runs"] += len(todo)
            for i, v in zip(todo, vals):
                out[i] = v
                if self.cache is not None:
                    self.cache.put(keys[i], {field: v})
        return [float(v) for v in out]  # type: ignore[arg-type]

    def pmi_many(self, inputs: Sequence[JudgeInput], texts: Sequence[str],
                 memo: dict[str, tuple[float, int]] | None = None) -> list[float]:
        """:meth:`pmi` for turns of one conversation: cached values first, the rest in one batch."""
        keys = [self._key(inp, text) for inp, text in zip(inputs, texts)]
        return self._cached_many(keys, "pmi", inputs, texts, partial(grounding_pmi_many, memo=memo), count_runs=True)

    def voice_many(self, inputs: Sequence[JudgeInput], texts: Sequence[str],
                   memo: dict[str, tuple[float, int]] | None = None) -> list[float]:
        """:func:`voice_scores` of turns of one conversation, through the judge's cache (``memo``: the grounding
        pass's user-slot log-probs of these turns, reused)."""
        keys = [self._key(inp, text) + ":voice" for inp, text in zip(inputs, texts)]
        return self._cached_many(keys, "voice", inputs, texts, partial(voice_scores, memo=memo))

    def decide(self, offline: LabelRecord, pmi: float | None) -> tuple[str, float]:
        """(label, P(genuine)) from the offline verdict and the PMI (None: not a candidate)."""
        if pmi is None:
            return offline.label, 0.0
        p = 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, (pmi - self.threshold) / SCALE))))
        if pmi >= self.threshold or (offline.label == GENUINE and pmi >= self.veto):
            return GENUINE, max(p, 0.5)
        return ("new_query" if offline.label == GENUINE else offline.label), p

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        """Offline verdicts first (fast), then candidates grouped by conversation, yielded as judged."""

        offline = {r.record_id: r for r in self.offline.label_many(list(inputs))}
        order: dict[str, list[JudgeInput]] = {}
        for inp in inputs:
            order.setdefault(json.dumps(inp.conversation(), sort_keys=True, ensure_ascii=False), []).append(inp)
        for group in order.values():
            texts = {inp.record_id: split_roles(inp.raw_text)[0].text for inp in group}
            cands = [inp for inp in group if (offline[inp.record_id].label in CANDIDATES
                                              or offline[inp.record_id].rationale.startswith("R10a"))
                     and bool(texts[inp.record_id].strip())]
            memo: dict[str, tuple[float, int]] = {}  # this conversation's user-slot turn log-probs
            pmis = self.pmi_many(cands, [texts[i.record_id] for i in cands], memo) if cands else []
            by_id = {inp.record_id: v for inp, v in zip(cands, pmis)}
            decided = {inp.record_id: self.decide(offline[inp.record_id], by_id.get(inp.record_id)) for inp in group}
            voices: dict[str, float] = {}
            if self.voice is not None:
                gen = [inp for inp in group if decided[inp.record_id][0] == GENUINE]
                if gen:
                    voices = dict(zip([i.record_id for i in gen],
                                      self.voice_many(gen, [texts[i.record_id] for i in gen], memo)))
            for inp in group:
                off = offline[inp.record_id]
                pmi = by_id.get(inp.record_id)
                label, p = decided[inp.record_id]
                v = voices.get(inp.record_id)
                if v is not None and v < self.voice:  # type: ignore[operator]
                    label, p = "assistant_continuation", min(p, 0.49)
                why = f"offline {off.label} ({off.rationale.split(':', 1)[0]})"
                if pmi is not None:
                    why += f"; grounding PMI {pmi:+.3f} (threshold {self.threshold:g}, veto {self.veto:g})"
                if v is not None:
                    why += f"; voice {v:+.3f} (user minus assistant, min {self.voice:g})"
                self.stats["judged"] += 1
                probs = {GENUINE: round(p, 6)} | ({"pmi": round(pmi, 6)} if pmi is not None else {}) \
                    | ({"voice": round(v, 6)} if v is not None else {})
                yield LabelRecord(record_id=inp.record_id, label=label, genuine=is_genuine(label), rationale=why,
                                  judge=self.name, probs=probs)
            # Pool only the real conversation: the null and assistant slots share all but a few tokens with it,
            # so they rebuild from it in one short forward (as they did the first time), at a third of the memory.
            self.store.forget("real", pool=True)
            for slot in ("null", "assistant"):
                self.store.forget(slot)

    def label(self, inp: JudgeInput) -> LabelRecord:
        return next(self.label_many([inp]))
