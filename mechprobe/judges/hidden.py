"""The hidden-state judge: a logistic head per reading over a reader model's residual stream, read where the
reader has just seen [query, answer, next user turn] and been asked whether the turn is a genuine follow-up.

``--judge hidden:MODEL`` (MODEL: the reader the weights were fit with).

Why: the text-fit judge sees the turn through rules, lexical cues and sentence-embedding similarities, and on the
Qwen models' turns it stays below kappa 0.6 on the strict reading: whether a turn refers to something *only the
answer* contains, in the user's voice, is a reading-comprehension question. A language model that has read the
three texts represents that question internally; a linear head on its residual stream, fit on the blind labels'
train items and chosen on dev items (:mod:`mechprobe.judges.hidden_fit`), asks it. The reader runs one prefill
per turn and no generation.

What is read, per layer: the residual at the prompt's last token (after the chat template's assistant header,
where the reader would answer) and the mean residual over the turn's own tokens, concatenated. Why both: the last
token has attended to everything, the turn mean keeps what the turn itself says. From ``hidden-v7`` on (weights with
``"features": "answer-contrast"``) the rows also hold their difference from the same prompt read with the answer
hidden (:func:`judge_features`): a second, shorter prefill per turn.

Labels: P(genuine) of the head >= its threshold (the subject model's own where the fit calibrated one,
:func:`head_threshold`, read from :attr:`JudgeInput.subject`) -> ``genuine_followup``; otherwise the offline rules' label, an
offline ``genuine_followup`` becoming ``generic_followup`` (as the text-fit judge).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mechprobe.errors import UsageError
from mechprobe.judges.base import JudgeInput, load_judge_model
from mechprobe.judges.hidden_kinds import FEATURE_KINDS, HIDDEN_ANSWER, answer_hidden, feature_kind
from mechprobe.judges.offline import OfflineJudge
from mechprobe.lm.forward import get_blocks, kv_kw
from mechprobe.lm.generation import batches_by_length, input_device, left_pad
from mechprobe.lm.kv import KV, assemble, continuation_inputs, reuse_problem, take_row
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import GENUINE, is_genuine

__all__ = ["HiddenStateJudge", "ReaderPrompt", "reader_prompt", "hidden_features", "judge_features", "answer_hidden",
           "feature_kind", "with_feature_kind", "hidden_head_proba", "check_weights", "load_weights", "weights_digest",
           "head_threshold", "WEIGHTS_FORMAT", "HEADS", "QUESTION", "MAX_ANSWER_TOKENS", "HIDDEN_ANSWER",
           "FEATURE_KINDS"]

WEIGHTS_FORMAT = "mechprobe-hidden-judge-v1"
HEADS = ("lenient", "strict")
MAX_ANSWER_TOKENS = 512  # the study's answer cap: longer answers keep their first and last halves
QUESTION = ("Read the conversation below. Then say whether the NEXT USER TURN is a genuine follow-up: a coherent "
            "reply written in the user's voice that reacts to something only the assistant's answer contains (not a "
            "new unrelated request, not the question asked again, not the assistant continuing, not a plan or an "
            "empty or garbled text).")
EMPTY_TURN = "(empty)"


@dataclass(frozen=True)
class ReaderPrompt:
    """Token ids the reader prefills and where the turn sits in them (``[start, end)``, unpadded)."""

    ids: list[int]
    turn_span: tuple[int, int]


def _clip_answer(tok: Any, answer: str, max_tokens: int) -> str:
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return answer
    half = max_tokens // 2
    return tok.decode(ids[:half]) + " [...] " + tok.decode(ids[-half:])


def reader_prompt(tok: Any, inp: JudgeInput, max_answer_tokens: int = MAX_ANSWER_TOKENS) -> ReaderPrompt:
    """The reader's prompt for one turn: the question, the query, the (clipped) answer and the turn as written,
    in the reader's chat template as one user message, ending where the reader would answer.

    The turn is tokenised on its own between the rendered text before and after it, so its span is exact; the
    same pieces give the same ids at fit time and at judging time.
    """
    turn = inp.raw_text if inp.raw_text is not None else (inp.text or "")
    turn = turn if turn.strip() else EMPTY_TURN
    marker = "\x00TURN\x00"
    body = (f"{QUESTION}\n\n### USER QUERY\n{inp.prompt}\n\n### ASSISTANT ANSWER\n"
            f"{_clip_answer(tok, inp.response, max_answer_tokens)}\n\n### NEXT USER TURN\n{marker}\n\n"
            "Is the next user turn a genuine follow-up to the answer? Answer yes or no.")
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True)
    else:
        text = body + "\nAnswer:"
    pre, post = text.split(marker)
    a = tok(pre, add_special_tokens=False)["input_ids"]
    t = tok(turn, add_special_tokens=False)["input_ids"] or tok(EMPTY_TURN, add_special_tokens=False)["input_ids"]
    b = tok(post, add_special_tokens=False)["input_ids"]
    return ReaderPrompt(list(a) + list(t) + list(b), (len(a), len(a) + len(t)))


def hidden_features(lm: Any, inputs: Sequence[JudgeInput], layers: Sequence[int], *, batch_size: int = 8,
                    token_budget: int = 8192, progress: bool = False,
                    on_batch: Callable[[list[str], dict[int, np.ndarray]], None] | None = None,
                    share_prefix: bool = True) -> dict[int, np.ndarray]:
    """Per residual index in ``layers``, one row per input: [last-token residual, mean residual over the turn]
    (float32, ``2 x d_model`` columns), in ``inputs`` order.

    Args:
        lm: the reader (:class:`~mechprobe.lm.models.LoadedModel`).
        inputs: the turns.
        layers: residual indices (0 = embeddings, i = output of block i-1), as the activation cache counts them.
        batch_size, token_budget: rows per forward, and padded tokens per forward at most.
        progress: a progress bar over turns.
        on_batch: called after each batch with its record ids and rows (a caller that stores features as they
            come loses nothing to an interruption).
        share_prefix: read each conversation once for all its turns (default): the reader's prompt is the
            question, the query and the answer, then the turn, so the turns of one answer (greedy and samples,
            the arms of a study) share everything before the turn; its keys and values are computed once and
            each turn prefills only itself and the closing question. The same numbers up to floating-point
            rounding (tested against ``share_prefix=False``).
    Returns:
        ``{layer: array [len(inputs), 2 * d_model]}``.
    """
    prompts = [reader_prompt(lm.tokenizer, i) for i in inputs]
    out: dict[int, list[np.ndarray | None]] = {r: [None] * len(inputs) for r in layers}
    bar = tqdm(total=len(inputs), desc="reader hidden states", unit="turn", disable=not progress)
    batches: Iterable[tuple[list[int], list[tuple[int, KV]] | None]]
    if share_prefix and max(layers, default=0) > 0 and reuse_problem(lm.model) is None:
        batches = _prefix_batches(lm.model, prompts, max(layers), batch_size, token_budget)
    else:
        batches = [(b, None) for b in batches_by_length([len(p.ids) for p in prompts], batch_size, token_budget)]
    for batch, kvs in batches:
        if kvs is None:
            got = _residuals(lm.model, [prompts[i].ids for i in batch], [prompts[i].turn_span for i in batch],
                             list(layers))
        else:
            got = _tail_residuals(lm.model, [prompts[i] for i in batch], kvs, list(layers))
        rows = {r: got[r].cpu().numpy() for r in layers}
        for r in layers:
            for j, i in enumerate(batch):
                out[r][i] = rows[r][j]
        if on_batch is not None:
            on_batch([inputs[i].record_id for i in batch], rows)
        bar.update(len(batch))
    bar.close()
    return {r: np.stack([x for x in v if x is not None]) if inputs else np.zeros((0, 0), np.float32)
            for r, v in out.items()}


def with_feature_kind(w: dict[str, Any], kind: str) -> dict[str, Any]:
    """Weights ``w`` fit on rows of ``kind``, saying so: a ``"turn"`` fit stays as it is (no ``features`` key, as
    hidden-v1..v6), any other kind is written into the weights and their digest (a judge then reads those rows).

    Example:
        >>> with_feature_kind({"layer": 1}, "turn")
        {'layer': 1}
    """
    if kind == "turn":
        return w
    out = {**w, "features": kind}
    return {**out, "weights_sha256": weights_digest(out)}


def judge_features(lm: Any, inputs: Sequence[JudgeInput], layers: Sequence[int], kind: str = "turn",
                   **kw: Any) -> dict[int, np.ndarray]:
    """The rows a head of feature kind ``kind`` reads, per residual index in ``layers``.

    ``"turn"``: :func:`hidden_features` (``2 x d_model`` columns). ``"answer-contrast"``: those rows and those rows
    minus the rows of the same turns read with the answer hidden (:func:`answer_hidden`), ``4 x d_model`` columns.
    Why the difference: a turn that reacts to the answer is read differently once the answer is gone, while a turn
    that fits any answer (a new request, a generic thanks) reads the same; the labellers' strict reading asks
    exactly that. The answer-hidden prompt is shorter (no answer), so it adds less than a second full read.

    Args:
        lm, inputs, layers: as :func:`hidden_features`.
        kind: one of :data:`FEATURE_KINDS`.
        **kw: passed to :func:`hidden_features` (batch_size, token_budget, progress, share_prefix).
    Returns:
        ``{layer: array [len(inputs), columns]}``.
    Raises:
        UsageError: an unknown kind.
    """
    if kind not in FEATURE_KINDS:
        raise UsageError(f"hidden-judge features {kind!r}: use one of {', '.join(FEATURE_KINDS)}")
    a = hidden_features(lm, inputs, layers, **kw)
    if kind == "turn":
        return a
    n = hidden_features(lm, [answer_hidden(i) for i in inputs], layers, **kw)
    return {r: np.concatenate([a[r], a[r] - n[r]], axis=1) for r in layers}


def _prefix_batches(model: Any, prompts: Sequence[ReaderPrompt], deepest: int, batch_size: int, token_budget: int
                    ) -> Iterator[tuple[list[int], list[tuple[int, KV]]]]:
    """Turn batches that continue shared conversation prefixes: per batch its turn indices and, per turn, its
    prefix's (length, KV). Prefixes (everything before the turn) are grouped, computed a batch of groups at a
    time (only the blocks below ``deepest`` run), and their turns follow before the next group batch."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p.ids[:p.turn_span[0]]), []).append(i)
    keys = list(groups)
    for gb in batches_by_length([len(k) for k in keys], batch_size, token_budget):
        kvs = _prefix_kv(model, [list(keys[g]) for g in gb], deepest)
        rows = [(i, j) for j, g in enumerate(gb) for i in groups[keys[g]]]
        tails = [len(prompts[i].ids) - prompts[i].turn_span[0] for i, _ in rows]
        for tb in batches_by_length(tails, batch_size, token_budget):
            yield [rows[t][0] for t in tb], [(len(keys[gb[rows[t][1]]]), kvs[rows[t][1]]) for t in tb]


@torch.inference_mode()
def _prefix_kv(model: Any, prefixes: list[list[int]], deepest: int) -> list[KV]:
    """Each prefix's keys and values in the blocks below residual ``deepest`` (one left-padded forward that stops
    there; the blocks above it are never read)."""
    blocks = get_blocks(model)
    dev = input_device(model)
    from transformers import DynamicCache  # lazy: slow import, model paths only

    ids, mask, pos = left_pad(prefixes, 0, dev)
    cache = DynamicCache()
    h = blocks[deepest - 1].register_forward_hook(_stop)
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
              **kv_kw(model, cache))
    except _Enough:
        pass
    finally:
        h.remove()
    return [take_row(cache, r, mask[r].nonzero().flatten())[:deepest] for r in range(len(prefixes))]


def _stop(_m: Any, _i: Any, _o: Any) -> None:
    raise _Enough


@torch.inference_mode()
def _tail_residuals(model: Any, prompts: list[ReaderPrompt], kvs: list[tuple[int, KV]], layers: list[int]
                    ) -> dict[int, torch.Tensor]:
    """:func:`_residuals` of whole prompts, computing only each prompt's tail (the turn and the closing question)
    on its reused prefix: the tails are right-aligned after their prefixes (``continuation_inputs``), so every
    row's last position is its prompt's last token."""
    blocks = get_blocks(model)
    dev = input_device(model)
    cache, width = assemble([kv for _, kv in kvs], [n for n, _ in kvs], dev)
    tails = [p.ids[n:] for p, (n, _) in zip(prompts, kvs)]
    ids, mask, pos = continuation_inputs(tails, [n for n, _ in kvs], width, 0, dev)
    t = ids.shape[1]
    seen: dict[int, torch.Tensor] = {}
    deepest = max(layers)

    def keep(r: int) -> Callable[..., None]:
        def hook(_m: Any, _i: Any, out: Any) -> None:
            seen[r] = out if isinstance(out, torch.Tensor) else out[0]
            if r == deepest:
                raise _Enough
        return hook

    handles = [(model.get_input_embeddings() if r == 0 else blocks[r - 1]).register_forward_hook(keep(r))
               for r in layers]
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
              **kv_kw(model, cache))
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    ar = torch.arange(t, device=dev)
    s = torch.tensor([t - len(x) + (p.turn_span[0] - n) for x, p, (n, _) in zip(tails, prompts, kvs)], device=dev)
    e = torch.tensor([t - len(x) + (p.turn_span[1] - n) for x, p, (n, _) in zip(tails, prompts, kvs)], device=dev)
    m = ((ar[None] >= s[:, None]) & (ar[None] < e[:, None])).float()
    out = {}
    for r in layers:
        h = seen[r].float()
        out[r] = torch.cat([h[:, -1], torch.einsum("btd,bt->bd", h, m) / m.sum(1, keepdim=True)], dim=-1)
    return out


class _Enough(Exception):
    """Raised by the hook of the deepest residual read: the blocks after it cannot change what was read."""


@torch.inference_mode()
def _residuals(model: Any, ids: list[list[int]], spans: list[tuple[int, int]], layers: list[int],
               stop_early: bool = True) -> dict[int, torch.Tensor]:
    """One left-padded forward: per residual index ``r`` (0 = embeddings, r = output of block r-1, before the final
    norm) the rows [last token, mean over the span], float32. Hooks come off whatever happens.

    ``stop_early``: the forward stops at the deepest residual read. Why: the judge reads one middle layer, so the
    blocks above it are wasted work (half the reader's cost at layer 12 of 24); what is read is the same tensor
    either way (tested)."""
    blocks = get_blocks(model)
    t = max(len(x) for x in ids)
    pad = [t - len(x) for x in ids]
    dev = next(model.parameters()).device
    input_ids = torch.tensor([[0] * k + x for k, x in zip(pad, ids)], device=dev)
    mask = torch.tensor([[0] * k + [1] * len(x) for k, x in zip(pad, ids)], device=dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    seen: dict[int, torch.Tensor] = {}

    def keep(r: int) -> Callable[..., None]:
        def hook(_m: Any, _i: Any, out: Any) -> None:
            seen[r] = out if isinstance(out, torch.Tensor) else out[0]  # transformers 5 blocks return a Tensor
            if stop_early and r == deepest:
                raise _Enough
        return hook

    deepest = max(layers)

    handles = [(model.get_input_embeddings() if r == 0 else blocks[r - 1]).register_forward_hook(keep(r))
               for r in layers]
    try:
        model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    ar = torch.arange(t, device=dev)
    s = torch.tensor([k + a for k, (a, _) in zip(pad, spans)], device=dev)
    e = torch.tensor([k + b for k, (_, b) in zip(pad, spans)], device=dev)
    m = ((ar[None] >= s[:, None]) & (ar[None] < e[:, None])).float()
    out = {}
    for r in layers:
        h = seen[r].float()
        out[r] = torch.cat([h[:, -1], torch.einsum("btd,bt->bd", h, m) / m.sum(1, keepdim=True)], dim=-1)
    return out


def weights_digest(w: dict[str, Any]) -> str:
    """SHA-256 of the numbers that decide a label; a file edited after the fit no longer matches it."""
    core = {k: w.get(k) for k in ("reader", "layer", "mean", "scale", "heads")}
    if "features" in w:  # hidden-v1..v6 have no such key: their digests stay what they were
        core["features"] = w["features"]
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _finite_list(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(isinstance(x, (int, float)) and math.isfinite(x) for x in v)


def check_weights(w: Any, where: str) -> dict[str, Any]:
    """Refuse a weights dict that would judge wrongly without failing (``where`` names the file)."""
    fix = "refit with the judges evaluate command, hidden=MODEL and fit_hidden=True (never edit the weights by hand)"
    if not isinstance(w, dict) or w.get("format") != WEIGHTS_FORMAT:
        raise UsageError(f"{where}: not a {WEIGHTS_FORMAT} file; {fix}")
    if not isinstance(w.get("reader"), str) or not isinstance(w.get("layer"), int):
        raise UsageError(f"{where}: 'reader' (a model name) and 'layer' (an int) are required; {fix}")
    if feature_kind(w) not in FEATURE_KINDS:
        raise UsageError(f"{where}: 'features' must be one of {', '.join(FEATURE_KINDS)}; {fix}")
    n = len(w.get("mean") or [])
    if not n or not _finite_list(w["mean"], n) or not _finite_list(w.get("scale"), n) or min(w["scale"]) <= 0:
        raise UsageError(f"{where}: 'mean' and 'scale' must hold the same number of finite values (scale > 0); {fix}")
    heads = w.get("heads")
    if not isinstance(heads, dict) or not heads or not set(heads) <= set(HEADS):
        raise UsageError(f"{where}: 'heads' must map {'/'.join(HEADS)} to a fitted head; {fix}")
    for name, h in heads.items():
        if not isinstance(h, dict) or not _finite_list(h.get("coef"), n):
            raise UsageError(f"{where}: head {name!r}: 'coef' must hold {n} finite numbers; {fix}")
        if not _finite_list([h.get("intercept"), h.get("threshold")], 2) or not 0 <= h["threshold"] <= 1:
            raise UsageError(f"{where}: head {name!r}: intercept and threshold (in [0, 1]) must be finite; {fix}")
        per = h.get("thresholds", {})
        if not isinstance(per, dict) or not _finite_list(list(per.values()), len(per)) \
                or not all(isinstance(k, str) and 0 <= v <= 1 for k, v in per.items()):
            raise UsageError(f"{where}: head {name!r}: 'thresholds' must map subject model names to thresholds in "
                             f"[0, 1]; {fix}")
    if w.get("weights_sha256") != weights_digest(w):
        raise UsageError(f"{where}: the weights do not match their weights_sha256 (edited after the fit); {fix}")
    return w


def weights_path(reader: str, root: str | Path | None = None) -> Path:
    """Where the package keeps the weights fit with ``reader`` (``mechprobe/data/hidden_judge_<reader>.json``)."""
    base = Path(root) if root is not None else Path(__file__).resolve().parents[1] / "data"
    return base / f"hidden_judge_{Path(reader).name.removesuffix('.gguf')}.json"


def load_weights(path: str | Path) -> dict[str, Any]:
    """The fitted weights at ``path``.

    Raises:
        UsageError: missing, not JSON, or not a valid weights file (:func:`check_weights`).
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"no hidden-judge weights at {p}; fit them with the judges evaluate command, hidden=MODEL "
                         "and fit_hidden=True")
    try:
        w = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}: not JSON ({e.msg}); refit the weights with the judges evaluate command") from None
    return check_weights(w, str(p))


def head_threshold(w: dict[str, Any], head: str, subject: str = "") -> float:
    """The decision threshold of ``head`` for a turn written by ``subject``: its per-subject threshold where the fit
    calibrated one for that model (``heads[head]['thresholds']``), else the head's global threshold.

    Why per subject model: positives are 2% of one model's turns and 12% of another's, and the probability at which
    a head's verdicts best match the labels differs with that rate; an unnamed or unknown subject gets the global
    threshold, chosen over all subject models.

    Example:
        >>> w = {"heads": {"strict": {"threshold": 0.5, "thresholds": {"m-a": 0.7}}}}
        >>> head_threshold(w, "strict", "m-a"), head_threshold(w, "strict", "m-b"), head_threshold(w, "strict")
        (0.7, 0.5, 0.5)
    """
    h = w["heads"][head]
    return float((h.get("thresholds") or {}).get(subject, h["threshold"]))


def hidden_head_proba(w: dict[str, Any], head: str, X: np.ndarray) -> np.ndarray:
    """P(genuine) of ``head`` for feature rows ``X`` (the fitted layer's rows of the weights' kind, :func:`judge_features`)."""
    h = w["heads"][head]
    z = (np.asarray(X, dtype=np.float64) - np.asarray(w["mean"])) / np.asarray(w["scale"])
    s = z @ np.asarray(h["coef"], dtype=np.float64) + float(h["intercept"])
    return 1.0 / (1.0 + np.exp(-np.clip(s, -500, 500)))


class HiddenStateJudge:
    """A linear head on a reader model's residual stream (see the module docstring).

    Args:
        model: the reader (an embedded name, a HF directory or a ``.gguf``); must be the one the weights were fit
            with.
        reading: which head decides, ``strict`` (default) or ``lenient``.
        weights: a weights JSON path; None (default) = the package's file for ``model``.
        dtype, device, loaded: as the other local judges (:func:`~mechprobe.judges.base.load_judge_model`).
        batch_size: turns per forward.

    Example:
        >>> judge = HiddenStateJudge("qwen2.5-coder-0.5b-instruct")                        # doctest: +SKIP
        >>> judge.label(JudgeInput("r1", "What is 12 * 7?", "84.", "Why 84 and not 74?")).genuine  # doctest: +SKIP
        True
    """

    def __init__(self, model: str, *, reading: str | None = None, weights: str | Path | None = None,
                 dtype: str | torch.dtype | None = None, device: str | None = None, loaded: Any = None,
                 batch_size: int = 8):
        path = Path(weights) if weights else weights_path(model)
        self.weights = load_weights(path)
        given = loaded.name if loaded is not None else Path(str(model)).name.removesuffix(".gguf")
        if given != self.weights["reader"]:
            raise UsageError(f"hidden:{model}: {path} was fit with reader {self.weights['reader']}; use "
                             f"judge=hidden:{self.weights['reader']} or refit with this reader")
        self.reading = reading or "strict"
        if self.reading not in self.weights["heads"]:
            raise UsageError(f"hidden: reading {self.reading!r} has no head in {path} (heads: "
                             f"{', '.join(sorted(self.weights['heads']))}); pass one of those")
        self.lm = load_judge_model(model, dtype, device, loaded)
        self.model_name = self.lm.name
        self.offline = OfflineJudge(embed=False)
        self.batch_size = batch_size
        self.threshold = float(self.weights["heads"][self.reading]["threshold"])
        self.per_subject = dict(self.weights["heads"][self.reading].get("thresholds") or {})
        self.name = f"hidden:{self.model_name}@{self.weights['version']}-{self.reading}+{self.offline.name}"

    def public_config(self) -> dict[str, Any]:
        return {"reader": self.model_name, "weight_hash": self.lm.weight_hash, "reading": self.reading,
                "layer": self.weights["layer"], "features": feature_kind(self.weights), "threshold": self.threshold,
                "thresholds": self.per_subject,
                "version": self.weights["version"],
                "weights_sha256": self.weights["weights_sha256"]}

    def probabilities(self, inputs: Sequence[JudgeInput]) -> list[float]:
        layer = int(self.weights["layer"])
        X = judge_features(self.lm, inputs, [layer], feature_kind(self.weights), batch_size=self.batch_size)[layer]
        return [float(p) for p in hidden_head_proba(self.weights, self.reading, X)]

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        inputs = list(inputs)
        if not inputs:
            return
        probs = self.probabilities(inputs)
        for inp, p, off in zip(inputs, probs, self.offline.label_many(inputs)):
            thr = head_threshold(self.weights, self.reading, inp.subject)
            label = GENUINE if p >= thr else ("generic_followup" if off.label == GENUINE else off.label)
            which = f"{inp.subject}'s " if inp.subject in self.per_subject else ""
            yield LabelRecord(record_id=inp.record_id, label=label, genuine=is_genuine(label), judge=self.name,
                              rationale=f"P(genuine, {self.reading}) {p:.3f} ({which}threshold {thr:.3f}); "
                                        f"offline {off.label}", probs={GENUINE: round(p, 6)})

    def label(self, inp: JudgeInput) -> LabelRecord:
        return next(self.label_many([inp]))
