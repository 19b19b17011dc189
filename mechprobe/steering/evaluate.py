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
5. Damage to the model's own distribution: mean NLL of the *unsteered* greedy turn under the *steered*
   model (:func:`steered_nll`), and a paired exact McNemar test of each condition against alpha 0 on
   the same held-out items (:func:`paired_vs_base`).

With ``select_on_train`` (the config field) the (layer, alpha) is chosen by :func:`select_on_train` on train items
only.

Every function here takes its vector already in alpha units (:func:`~mechprobe.steering.vector.in_alpha_units`,
as the experiment builds it), so ``alpha * vector`` is what is added (``steer(..., unit="raw")``): the same
added norm as ``steer(model, raw_vector, alpha)`` in the config's unit.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mechprobe.lm import chat
from mechprobe.lm.forward import kv_kw, logits_kept
from mechprobe.lm.generation import decode, generate, input_device, left_pad
from mechprobe.lm.models import LoadedModel
from mechprobe.records import AssistantRecord
from mechprobe.splits import split_of
from mechprobe.stats import paired_outcomes, wilson
from mechprobe.steering.degenerate import is_degenerate
from mechprobe.steering.vector import SteeringVector, steer
from mechprobe.turns.scoring import score
from mechprobe.turns.stock_turns import template_kind


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
    token_ids: list[int] | None = field(default=None)  # the generated tokens (None in rows of older versions)
    nll_base_text: float | None = None  # NLL of the alpha-0 turn of this item under this condition's model


def steered(model: Any, vector: SteeringVector, alpha: float, positions: str
            ) -> contextlib.AbstractContextManager[None]:
    """:func:`~mechprobe.steering.intervene.steer` for a vector already in alpha units (:func:`in_alpha_units`, as
    the experiment builds every kind): ``alpha * vector`` is added, so the added norm is the one
    ``steer(model, raw_vector, alpha, unit=...)`` adds in the config's unit. Every steered forward here goes
    through this one call."""
    return steer(model, vector, alpha, positions, unit="raw")


def _engine_generate(engine: Any, prompts: list[list[int]], vector: SteeringVector | None, alpha: float,
                     positions: str, **kw: Any) -> list[Any]:
    """Greedy rows on a generation engine with steering (the llama.cpp engine's control vectors)."""
    steer_arg = None
    if vector is not None and alpha != 0:
        steer_arg = (vector.scaled(alpha), vector.layer, positions)
    return engine.decode_batch(prompts, temperatures=0.0, steer=steer_arg, **kw)


def steered_user_turns(lm: LoadedModel, assistants: Sequence[AssistantRecord], vector: SteeringVector | None,
                       alpha: float, positions: str, max_new_tokens: int, batch_size: int = 16,
                       system: str | None = None, engine: Any = None,
                       nll: Callable[..., list[float | None]] | None = None) -> list[SteeredTurn]:
    """Greedy user turns under steering (``vector=None`` or ``alpha=0``: unsteered).

    ``engine``: a generation engine with a ``steer`` argument (``--engine llamacpp``: rows decoded together,
    the vector added by llama.cpp's control vectors at the same residual index and positions); the NLLs
    stay on the HF model ``lm``. ``nll(prompts, continuations)``: the unsteered NLL scorer (default
    :func:`turn_nll` on ``lm``; an :class:`NllScorer` shares each prompt's prefix across conditions).
    """
    tok = lm.tokenizer
    stops = chat.stop_token_ids(tok, lm.model)
    pps = [chat.build_probe_prompt(tok, a.prompt, a.response, system=system, history=a.messages or None)
           for a in assistants]
    out: list[SteeredTurn] = []
    if engine is not None:
        batch_size = max(batch_size, len(pps))  # the engine groups rows itself
    for i in range(0, len(pps), batch_size):
        chunk = pps[i:i + batch_size]
        prompts = [p.input_ids for p in chunk]
        if engine is not None:
            gens = _engine_generate(engine, prompts, vector, alpha, positions, stop_ids=stops,
                                    max_new_tokens=max_new_tokens)
        elif vector is not None and alpha != 0:
            with steered(lm.model, vector, alpha, positions):
                gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens,
                                pad_id=tok.pad_token_id)
        else:
            gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens, pad_id=tok.pad_token_id)
        nlls = (nll or (lambda p, c: turn_nll(lm, p, c)))(prompts, [g.token_ids for g in gens])
        for a, g, n_ll in zip(assistants[i:i + batch_size], gens, nlls):
            raw, text = decode(tok, g)
            out.append(SteeredTurn(a.item_id, vector.kind if vector is not None else "none", alpha,
                                   vector.layer if vector is not None else -1, positions, raw, text,
                                   g.stop_reason, n_ll, list(g.token_ids)))
    return out


@torch.inference_mode()
def turn_nll(lm: LoadedModel, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
             batch_size: int = 8) -> list[float | None]:
    """Mean per-token negative log-likelihood of each continuation under the *unsteered* model.

    In chunks of ``batch_size``, with the LM head run on the continuation's positions only: full logits of
    96 probe prompts x ~370 tokens x Qwen's 152k vocabulary are ~22 GB in fp32 (that killed a 1.5B steering
    run by OOM), while the positions needed are the last few dozen.
    """
    out: list[float | None] = []
    for s in range(0, len(prompts), batch_size):
        out += _turn_nll_chunk(lm, prompts[s:s + batch_size], continuations[s:s + batch_size])
    return out


def _last_logits(model: Any, keep: int, **inputs: Any) -> torch.Tensor:
    """Logits of the last ``keep`` positions only (transformers' ``logits_to_keep``: the LM head skips the rest)."""

    return logits_kept(model, keep, **inputs).logits[:, -keep:]


def _turn_nll_chunk(lm: LoadedModel, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
                    ) -> list[float | None]:
    full = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    dev = next(lm.model.parameters()).device
    ids, mask, pos = left_pad(full, lm.tokenizer.pad_token_id, dev)
    keep = max((len(c) for c in continuations), default=0) + 1
    keep = min(keep, ids.shape[1])
    logp = torch.log_softmax(_last_logits(lm.model, keep, input_ids=ids, attention_mask=mask,
                                          position_ids=pos).float(), -1)
    out: list[float | None] = []
    for i, c in enumerate(continuations):
        if not c:
            out.append(None)
            continue
        tgt = torch.tensor(list(c), device=dev)
        rows = torch.arange(keep - len(c) - 1, keep - 1, device=dev)  # positions t-len(c)-1 .. t-2 of the row
        out.append(float(-logp[i, rows, tgt].mean()))
    return out


def summarize(turns: Sequence[SteeredTurn], labels: dict[str, str], key: str,
              truncated: Collection[str] = ()) -> dict[str, Any]:
    """Follow-up rate with CI, label distribution, degeneration and fluency for one (kind, alpha).

    ``truncated``: item ids to leave out (items whose assistant answer hit the token cap; the caller passes an
    empty set to keep them). ``n_truncated_excluded`` says how many turns were left out.
    """
    n_all = len(turns)
    turns = [t for t in turns if t.item_id not in truncated]
    n = len(turns)
    genuine = sum(labels.get(f"{key}|{t.item_id}") == "genuine_followup" for t in turns)
    dist = Counter(labels.get(f"{key}|{t.item_id}", "missing") for t in turns)
    degen = sum(is_degenerate(t.text) or labels.get(f"{key}|{t.item_id}") == "empty_or_degenerate" for t in turns)
    nlls = [t.nll for t in turns if t.nll is not None]
    # Stock turns ("I see, I can now calculate ..."; :mod:`mechprobe.turns.stock_turns`): their share, and the
    # genuine count under the strict reading that does not count them as follow-ups.
    stock = {t.item_id for t in turns if template_kind(t.text) is not None}
    genuine_stock = sum(labels.get(f"{key}|{t.item_id}") == "genuine_followup" for t in turns if t.item_id in stock)
    return {"n": n, "genuine": genuine, "template": len(stock), "template_rate": len(stock) / n if n else 0.0,
            "genuine_strict": genuine - genuine_stock,
            "followup_rate_strict": (genuine - genuine_stock) / n if n else 0.0, "followup_rate": genuine / n if n else 0.0, "ci": list(wilson(genuine, n)),
            "degenerate": degen, "degenerate_rate": degen / n if n else 0.0,
            "degenerate_ci": list(wilson(degen, n)), "mean_nll": sum(nlls) / len(nlls) if nlls else None,
            "labels": dict(dist), "n_truncated_excluded": n_all - n}


def genuine_by_item(turns: Sequence[SteeredTurn], labels: dict[str, str], key: str,
                    truncated: Collection[str] = ()) -> dict[str, bool]:
    """Per held-out item: was this condition's greedy turn a genuine follow-up (the pairing for McNemar).
    Items in ``truncated`` (their assistant answer hit the token cap) are left out."""
    return {t.item_id: labels.get(f"{key}|{t.item_id}") == "genuine_followup" for t in turns
            if t.item_id not in truncated}


def paired_vs_base(cond: dict[str, bool], base: dict[str, bool]) -> dict[str, Any]:
    """Exact McNemar test of a condition against alpha 0 on the items both have.

    ``b`` = items genuine only under the condition (steering helped), ``c`` = genuine only at alpha 0
    (steering hurt). Paired because both conditions see the same items, so item difficulty cancels
    and the test is far more sensitive than comparing two Wilson intervals.
    """
    t = paired_outcomes(base, cond)  # A = alpha 0, B = the condition: only_b is "b", only_a is "c"
    return {"n_paired": t.n, "b": t.only_b, "c": t.only_a, "p": t.p}


@torch.inference_mode()
def steered_nll(lm: LoadedModel, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                vector: SteeringVector | None, alpha: float, positions: str, batch_size: int = 16
                ) -> list[float | None]:
    """Mean per-token NLL of each continuation under the model *with the vector on* (teacher forcing).

    Why: a steered model that still assigns the unsteered greedy turn a likelihood close to the unsteered
    model's has been nudged, not broken; a rising NLL measures damage to the model's own distribution
    independently of what the steered model happens to generate. Positions match generation exactly:
    the prompt is one prefill call (its last position is the boundary) and the continuation one call on
    the prompt's KV cache (every position a generated token), which is what :func:`steer` tells apart.
    ``vector=None`` or ``alpha=0`` gives the unsteered model's NLL (equal to :func:`turn_nll`).
    """
    from transformers import DynamicCache  # lazy: slow import, model paths only

    model, pad = lm.model, lm.tokenizer.pad_token_id
    dev = input_device(model)
    out: list[float | None] = []
    for s in range(0, len(prompts), batch_size):
        ps, cs = prompts[s:s + batch_size], [list(c) for c in continuations[s:s + batch_size]]
        ctx = steered(model, vector, alpha, positions) if vector is not None and alpha != 0 else contextlib.nullcontext()
        with ctx:
            ids, mask, pos = left_pad(ps, pad, dev)
            kv = DynamicCache()
            # Only the boundary's logits are needed: the full [batch, prompt, vocab] tensor is GBs on a 152k vocab.
            first_logits = _last_logits(model, 1, input_ids=ids, attention_mask=mask, position_ids=pos,
                                        **kv_kw(model, kv), use_cache=True)
            lp_first = torch.log_softmax(first_logits[:, -1].float(), -1)
            width = max((len(c) for c in cs), default=0) - 1
            lp_rest = None
            if width > 0:  # inputs c[0..len-2] predict c[1..len-1]; rows right-padded (pads are never attended)
                cids = torch.full((len(cs), width), pad, dtype=ids.dtype, device=dev)
                cmask = torch.zeros((len(cs), width), dtype=mask.dtype, device=dev)
                for r, c in enumerate(cs):
                    n = len(c) - 1
                    if n > 0:
                        cids[r, :n] = torch.tensor(c[:-1], dtype=ids.dtype, device=dev)
                        cmask[r, :n] = 1
                cpos = pos[:, -1:] + 1 + torch.arange(width, device=dev)[None]
                rest = model(input_ids=cids, attention_mask=torch.cat([mask, cmask], 1), position_ids=cpos,
                             **kv_kw(model, kv), use_cache=True)
                lp_rest = torch.log_softmax(rest.logits.float(), -1)
        for r, c in enumerate(cs):
            if not c:
                out.append(None)
                continue
            terms = [lp_first[r, c[0]]] + [lp_rest[r, j, c[j + 1]] for j in range(len(c) - 1)]
            out.append(float(-torch.stack(terms).mean()))
    return out


class NllScorer:
    """Teacher-forced NLLs of continuations, the unsteered prompt prefix computed once per item.

    Why: every condition of a steering run scores ~35-token turns after the same ~260-token probe prompt,
    and re-running that prompt per condition made the NLLs the dominant cost of a 1.5B run (py-spy: 2.4 s
    per item in fp32, most of the held-out stage). The prompt minus its last token (the boundary) is never
    steered at ``boundary+generated`` (the default) nor at alpha 0, so its keys/values are kept per item;
    each score is then one batched forward of ``[boundary] + continuation[:-1]`` on those prefixes
    (left-padded into one cache, the continuation right-padded: the layout of :func:`steered_nll`), every
    position of which is steered exactly as in generation (the boundary and the generated tokens). Rows are
    batched because a one-row forward of ~40 tokens is bound by reading the weights, not by arithmetic.
    Other ``positions``, and models with sliding-window layers, fall back to :func:`steered_nll`. Equal to
    :func:`steered_nll` / :func:`turn_nll` up to float summation order (tests: 1e-4 in fp32). ``max_items``
    bounds memory (a 260-token prefix of Qwen 1.5B is ~7.5 MB in bf16).
    """

    SHARED = ("boundary+generated",)

    def __init__(self, lm: LoadedModel, max_items: int = 512, batch_size: int = 16) -> None:
        self.lm, self.max_items, self.batch_size = lm, max_items, batch_size
        self._kv: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
        cfg = getattr(lm.model, "config", None)
        types = getattr(cfg, "layer_types", None) or getattr(getattr(cfg, "text_config", None), "layer_types", None)
        self.shareable = not any("sliding" in str(t) for t in (types or []))

    @staticmethod
    def _tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if hasattr(cache, "layers"):  # transformers >= 4.56
            return [(la.keys, la.values) for la in cache.layers]
        return list(zip(cache.key_cache, cache.value_cache))

    def _prefixes(self, keys: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each key's unpadded keys/values: kept ones reused, the rest computed (batched, left-padded) and kept."""
        from transformers import DynamicCache  # lazy: slow import, model paths only

        got = {k: self._kv[k] for k in keys if k in self._kv}
        need = list(dict.fromkeys(k for k in keys if k not in got))
        model, pad = self.lm.model, self.lm.tokenizer.pad_token_id
        dev = input_device(model)
        for s in range(0, len(need), self.batch_size):
            chunk = need[s:s + self.batch_size]
            ids, mask, pos = left_pad([list(k) for k in chunk], pad, dev)
            kv = DynamicCache()
            _last_logits(model, 1, input_ids=ids, attention_mask=mask, position_ids=pos, **kv_kw(model, kv),
                         use_cache=True)
            width = ids.shape[1]
            for r, k in enumerate(chunk):
                while len(self._kv) >= self.max_items:
                    self._kv.pop(next(iter(self._kv)))  # oldest first: conditions sweep items in one order
                off = width - len(k)
                got[k] = self._kv[k] = [(kk[r:r + 1, :, off:].clone(), vv[r:r + 1, :, off:].clone())
                                        for kk, vv in self._tensors(kv)]
        return got

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                 vector: SteeringVector | None = None, alpha: float = 0.0,
                 positions: str = "boundary+generated") -> list[float | None]:
        steered = vector is not None and alpha != 0
        if (steered and positions not in self.SHARED) or not self.shareable or any(len(p) < 2 for p in prompts):
            return steered_nll(self.lm, prompts, continuations, vector, alpha, positions)
        out: list[float | None] = []
        for s in range(0, len(prompts), self.batch_size):
            out += self._chunk([list(p) for p in prompts[s:s + self.batch_size]],
                               [list(c) for c in continuations[s:s + self.batch_size]], vector if steered else None,
                               alpha, positions)
        return out

    def _chunk(self, ps: list[list[int]], cs: list[list[int]], vector: SteeringVector | None, alpha: float,
               positions: str) -> list[float | None]:
        from transformers import DynamicCache  # lazy: slow import, model paths only

        rows = [r for r, c in enumerate(cs) if c]
        if not rows:
            return [None] * len(cs)
        keys = [tuple(ps[r][:-1]) for r in rows]
        pre = self._prefixes(keys)
        model, pad = self.lm.model, self.lm.tokenizer.pad_token_id
        dev = input_device(model)
        lens = [len(k) for k in keys]
        width_p, width_c = max(lens), max(len(cs[r]) for r in rows)
        kv = DynamicCache()
        for layer in range(len(pre[keys[0]])):
            ks, vs = [], []
            for k, n in zip(keys, lens):
                kk, vv = pre[k][layer]
                ks.append(torch.nn.functional.pad(kk, (0, 0, width_p - n, 0)))  # left-pad the sequence dim
                vs.append(torch.nn.functional.pad(vv, (0, 0, width_p - n, 0)))
            kv.update(torch.cat(ks), torch.cat(vs), layer)
        ids = torch.full((len(rows), width_c), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(rows), width_p + width_c), dtype=torch.long, device=dev)
        for i, (r, n) in enumerate(zip(rows, lens)):
            feed = [ps[r][-1]] + cs[r][:-1]
            ids[i, :len(feed)] = torch.tensor(feed, device=dev)
            mask[i, width_p - n:width_p + len(feed)] = 1
        pos = torch.tensor(lens, device=dev)[:, None] + torch.arange(width_c, device=dev)[None]
        ctx = steered(model, vector, alpha, positions) if vector is not None else contextlib.nullcontext()
        with ctx:
            logits = _last_logits(model, width_c, input_ids=ids, attention_mask=mask, position_ids=pos,
                                  **kv_kw(model, kv), use_cache=True)
        got: dict[int, float] = {}
        for i, r in enumerate(rows):
            n = len(cs[r])
            lp = torch.log_softmax(logits[i, :n].float(), -1)
            got[r] = float(-lp[torch.arange(n, device=lp.device), torch.tensor(cs[r], device=lp.device)].mean())
        return [got.get(r) for r in range(len(cs))]


def choose_setting(rows: Sequence[dict[str, Any]], max_degenerate: float) -> tuple[dict[str, Any], bool]:
    """The (layer, alpha) row with the highest follow-up rate among rows with degeneration <= the cap.

    Ties go to less degeneration, then the smaller |alpha| (the gentler push), then the lower layer.
    Returns ``(row, cap_met)``; when no row meets the cap, the least degenerate row (then smallest
    |alpha|) is returned with ``cap_met = False`` so the caller can say so rather than silently pick noise.
    """
    if not rows:
        raise ValueError("choose_setting needs at least one swept setting")
    ok = [r for r in rows if r["degenerate_rate"] <= max_degenerate]
    if ok:
        return max(ok, key=lambda r: (r["followup_rate"], -r["degenerate_rate"], -abs(r["alpha"]), -r["layer"])), True
    return min(rows, key=lambda r: (r["degenerate_rate"], abs(r["alpha"]), -r["followup_rate"], r["layer"])), False


SettingRunner = Callable[[Sequence[AssistantRecord], int, float], dict[str, Any]]


def select_on_train(run_setting: SettingRunner, items: Sequence[AssistantRecord], layers: Sequence[int],
                    alphas: Sequence[float], max_degenerate: float, stop_at_break: bool = True,
                    train_ids: Collection[str] | None = None) -> dict[str, Any]:
    """Sweep layers x alphas on *train* items and choose one setting (:func:`choose_setting`).

    ``run_setting(items, layer, alpha)`` generates, judges and summarises one setting (see
    :func:`summarize`). Held-out items are refused here, not filtered: a selection that ever saw a
    held-out item would make the held-out numbers optimistic, so passing one is a bug in the caller.

    ``stop_at_break``: at each layer the alphas of one sign run from small to large |alpha|, and once a
    setting's degeneration exceeds ``max_degenerate`` the larger ones of that sign are skipped (listed in
    ``skipped``). Why: such settings cannot be chosen, and a push that already broke the text breaks it
    more when doubled (the 1.5B sweep: every layer past its first broken alpha stayed broken or worse), so
    they cost a quarter of the sweep's time to show what the first broken row shows.

    ``train_ids``: the train pool of a fixed split file (default: the hash split, :func:`split_of`).
    """
    bad = [x.item_id for x in items
           if (x.item_id not in train_ids if train_ids is not None else split_of(x.item_id) != "train")]
    if bad:
        raise ValueError(f"selection must use train items only; got held-out items {bad[:5]}")
    if not items:
        raise ValueError("no train items to select on")
    steered = sorted({float(x) for x in alphas if x != 0})
    if not steered or not layers:
        raise ValueError("selection needs at least one layer and one nonzero alpha")
    rows, skipped = [], []
    for la in layers:
        for sign in (1, -1):
            broke_at = None
            for al in sorted((x for x in steered if x * sign > 0), key=abs):
                if broke_at is not None:
                    skipped.append({"layer": int(la), "alpha": al, "broke_at": broke_at})
                    continue
                row = {"layer": int(la), "alpha": al, **run_setting(items, int(la), al)}
                rows.append(row)
                if stop_at_break and row["degenerate_rate"] > max_degenerate:
                    broke_at = al
    rows.sort(key=lambda r: (layers.index(r["layer"]), r["alpha"]))
    chosen, cap_met = choose_setting(rows, max_degenerate)
    return {"items": [x.item_id for x in items], "layers": [int(x) for x in layers], "alphas": steered,
            "max_degenerate": max_degenerate, "sweep": rows, "skipped": skipped,
            "chosen": {"layer": chosen["layer"], "alpha": chosen["alpha"]}, "cap_met": cap_met}


def assistant_accuracy(lm: LoadedModel, items: Sequence[AssistantRecord], vector: SteeringVector | None,
                       alpha: float, max_new_tokens: int, batch_size: int = 16,
                       system: str | None = None, engine: Any = None) -> float | None:
    """Task accuracy of the assistant turn with the vector on at every position (leak check).
    ``system`` must be the run's system prompt, so the unsteered accuracy is the run's own."""

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
        if engine is not None:
            gens = _engine_generate(engine, prompts, vector, alpha, "all", stop_ids=stops,
                                    max_new_tokens=max_new_tokens)
        elif vector is not None and alpha != 0:
            with steered(lm.model, vector, alpha, "all"):
                gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens,
                                pad_id=tok.pad_token_id)
        else:
            gens = generate(lm.model, prompts, stop_ids=stops, max_new_tokens=max_new_tokens, pad_id=tok.pad_token_id)
        for a, g in zip(chunk, gens):
            meta = {"scorer": "gsm8k"} if a.dataset == "builtin" else {}
            correct += score(a.dataset, decode(tok, g)[1], a.gold, meta)[0] or 0.0
    return correct / len(scored)


def hand_label_table(rows: Sequence[dict[str, Any]], label_keys: Sequence[str], base: str = "none"
                     ) -> list[dict[str, Any]]:
    """Genuine rate per steering condition and labelling, with the exact McNemar test against ``base``.

    ``rows`` hold ``item_id``, ``condition`` and one label per key in ``label_keys`` (a model-written labeller's or a
    judge's), as in ``tests/fixtures/hand_labels_steer_q15.jsonl``. Why a separate table: the judge that
    chose and scored the steering setting is not an independent witness of what steering did to the turns.
    """
    out = []
    for key in label_keys:
        by: dict[str, dict[str, bool]] = {}
        for r in rows:
            by.setdefault(r["condition"], {})[r["item_id"]] = r[key] == "genuine_followup"
        if base not in by:
            raise ValueError(f"no rows of the base condition {base!r}")
        for cond, got in by.items():
            k = sum(got.values())
            lo, hi = wilson(k, len(got))
            row = {"labels": key, "condition": cond, "n": len(got), "genuine": k, "rate": k / max(len(got), 1),
                   "ci": (lo, hi)}
            if cond != base:
                row |= paired_vs_base(got, by[base])
            out.append(row)
    return out
