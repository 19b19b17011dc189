"""Batched, left-padded, KV-cached decoding with one RNG per row.

Why not ``model.generate``: with sampling, HF draws every row from one global RNG, so a row's text
depends on what else was in its batch and cannot be regenerated alone. Here each row owns a
``torch.Generator`` seeded from its record, so a row sampled in a batch of 16 is token-identical to
the same row sampled alone (given identical logits), and greedy rows are batch-invariant too.

Left padding is made exact by explicit ``position_ids = cumsum(mask) - 1``: without them a padded
row's positions are shifted by the pad count and its logits differ from the unpadded row's.
Forward hooks (activation capture, steering) see a prefill call with the whole prompt and then one
call per generated token; prompts here end at the user-role boundary, so in prefill the boundary is
always the last position of every row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mechprobe.errors import UsageError
from mechprobe.lm.chat import ProbePrompt, stop_token_ids, tokenize_rendered
from mechprobe.lm.forward import kv_kw, logits_kept, out_cache
from mechprobe.lm.kv import (
    KV,
    KVSource,
    active_interventions,
    assemble,
    continuation_inputs,
    forward_kind,
    reuse_problem,
    take_row,
)
from mechprobe.lm.models import LoadedModel


@dataclass
class Generation:
    """One decoded continuation, as :func:`generate` returns it.

    Attributes:
        token_ids: the new tokens, the stop token included when there was one.
        stop_reason: ``"end_of_turn"``, ``"eos"`` or ``"max_tokens"``.
        text: the cleaned text (no special tokens, no stop token) when :func:`generate` knew the tokenizer
            (it was given a :class:`~mechprobe.lm.models.LoadedModel`), else None.

    Example:
        >>> from mechprobe import Generation
        >>> g = Generation(token_ids=[42, 2], stop_reason="end_of_turn", text="Why 84?")
        >>> g.stop_reason, g.text
        ('end_of_turn', 'Why 84?')
    """

    token_ids: list[int]
    stop_reason: str  # "end_of_turn" | "eos" | "max_tokens"
    text: str | None = None


def input_device(model: Any) -> torch.device:
    """Where input ids must live (the embedding's device, also under accelerate's device_map)."""
    return model.get_input_embeddings().weight.device


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token lists; return ids, attention mask and matching position ids."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        ids[i, n - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, n - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def _make_generators(seeds: Sequence[int | None], device: torch.device) -> list[torch.Generator | None]:
    gens: list[torch.Generator | None] = []
    for s in seeds:
        if s is None:
            gens.append(None)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(int(s))
            gens.append(g)
    return gens


@torch.inference_mode()
def generate(
    model: Any,
    prompts: Sequence[Sequence[int] | ProbePrompt | str],
    *,
    stop_ids: dict[int, str] | None = None,
    max_new_tokens: int = 128,
    temperatures: float | Sequence[float] = 0.0,
    seeds: Sequence[int | None] | None = None,
    pad_id: int | None = None,
    top_p: float = 1.0,
    share_prefill: bool = True,
    drop_finished: bool = True,
    prefix_store: KVSource | None = None,
    keep_kv: KVSource | None = None,
) -> list[Generation]:
    """Decode a batch of prompts; temperature 0 is greedy (argmax), >0 samples with the row's seed.

    ``stop_ids`` maps token id -> stop reason. Given a :class:`~mechprobe.lm.models.LoadedModel`, it
    defaults to :func:`mechprobe.lm.chat.stop_token_ids` of the model's chat template: the token that ends a
    *user* turn plus the EOS ids, what a probe prompt (which ends at the user-role header) needs. The pad id
    then defaults to the tokenizer's, and each result carries its decoded ``text``.

    ``share_prefill``: rows with identical prompts (the greedy turn and the k samples of one item) are
    prefilled once and their KV cache rows copied, because on CPU the prompt's forward pass costs more
    than the whole user turn's decoding. The copied rows are the same numbers the duplicate rows would
    have computed, so outputs do not change (tested token for token); steering and capture hooks see
    a prefill of the unique prompts, still ending at the boundary in every row.

    ``drop_finished``: a row that has hit its stop token leaves the batch (its KV rows are dropped), so the
    remaining steps compute only the rows still decoding. Every row keeps its own positions, mask and
    RNG, so outputs do not change (tested token for token against ``drop_finished=False``).

    ``prefix_store`` (a :class:`~mechprobe.lm.prefix.PrefixStore`): each prompt continues from the longest
    stored prefix of its tokens (never the last token: the boundary is always computed here), so only the
    rest is prefilled; a prompt whose rest is longer than the store's ``max_tail`` first has its prefix up to
    (not including) the boundary computed and stored, for the next call. Same outputs up to floating-point
    rounding (fp32: tested token for token). Refused (:class:`UsageError`) while an intervention that edits
    positions before the boundary is active (``steer(..., positions="all")``), or when the store was made for
    other weights. ``keep_kv``: a store that receives every row's keys and values when the row ends (prompt +
    generated tokens but the last), so the next turn of that conversation continues from them; refused while
    any intervention is active (the generated positions would carry it).

    Runs under ``torch.inference_mode``. Hooks (activation capture, :func:`mechprobe.steering.vector.steer`)
    see one prefill call, whose last position is the boundary in every row, then one call per new token.
    With a ``prefix_store`` the prefill call holds only the tokens after each row's stored prefix (marked
    ``"continue"`` by :func:`mechprobe.lm.kv.call_kind`; the steering hooks read it), and a prefix computed
    for the store is a separate call marked ``"prefix"`` (no boundary in it).

    Args:
        model: a :class:`~mechprobe.lm.models.LoadedModel` or an HF causal LM (``nn.Module``); inputs go to its
            embedding's device.
        prompts: one per row (non-empty; left-padded here): token-id lists, :class:`~mechprobe.lm.chat.ProbePrompt`
            (from :func:`~mechprobe.lm.chat.build_probe_prompt`), or, with a ``LoadedModel``, already rendered
            text (tokenised as it stands).
        stop_ids: token id -> stop reason; a row stops after emitting one of them (the token is kept).
            ``{}`` decodes exactly ``max_new_tokens`` tokens. None (default): the chat template's user-turn stops
            (needs a ``LoadedModel``).
        max_new_tokens: cap on new tokens per row (default 128); a row that hits it gets ``"max_tokens"``.
        temperatures: one float for all rows or one per row; 0.0 (default) = greedy argmax.
        seeds: one seed per row (None = no generator); every row with temperature > 0 needs one.
            None (default) = no seeds, only valid for greedy rows.
        pad_id: id used for left padding (masked out, so its value does not matter); None (default) = the
            tokenizer's pad id with a ``LoadedModel``, else 0.
        top_p: nucleus sampling mass for sampled rows (default 1.0 = off).
        share_prefill: prefill identical prompts once and copy their KV rows (default True; same outputs).
        drop_finished: drop finished rows from the batch (default True; same outputs).
        prefix_store: reuse stored prefixes (:class:`~mechprobe.lm.prefix.PrefixStore`); None (default) = prefill
            every prompt whole.
        keep_kv: a :class:`~mechprobe.lm.prefix.PrefixStore` to receive each row's final keys and values (for a
            next turn); None (default) = keep nothing.

    Returns:
        ``list[Generation]`` in prompt order: ``token_ids`` (new tokens, the stop token included),
        ``stop_reason`` (the ``stop_ids`` value of the stop token, or ``"max_tokens"``) and, with a
        ``LoadedModel``, ``text`` (special tokens and the stop token removed).

    Raises:
        ValueError: ``prompts`` empty or not a list, an empty prompt, ``max_new_tokens`` not a positive integer,
            a negative or non-finite temperature, a temperature count that differs from the prompt count, or a
            sampled row without a seed.
        UsageError: ``stop_ids=None`` or a text prompt without a ``LoadedModel`` (no tokenizer to ask); a
            ``prefix_store`` with an intervention before the boundary active, or made for other weights.

    Example:
        >>> from mechprobe import generate, tiny_model
        >>> model = tiny_model("llama")
        >>> gens = generate(model, [[1, 2, 3], [4, 5]], stop_ids={}, max_new_tokens=4)
        >>> [(len(g.token_ids), g.stop_reason) for g in gens]
        [(4, 'max_tokens'), (4, 'max_tokens')]
        >>> again = generate(model, [[4, 5]], stop_ids={}, max_new_tokens=4)   # batch-invariant rows
        >>> again[0].token_ids == gens[1].token_ids
        True
        >>> gens = generate(model, [[1, 2, 3]] * 2, stop_ids={}, max_new_tokens=4,
        ...                 temperatures=[0.0, 1.0], seeds=[None, 7])
        >>> [len(g.token_ids) for g in gens]
        [4, 4]
        >>> from mechprobe import build_probe_prompt, load_model
        >>> lm = load_model("smollm2-135m-instruct")                                    # doctest: +SKIP
        >>> pp = build_probe_prompt(lm.tokenizer, "What is 12 * 7?", "12 * 7 = 84.")     # doctest: +SKIP
        >>> generate(lm, [pp], max_new_tokens=32)[0].text  # the model's next *user* turn  # doctest: +SKIP
    """
    from transformers import DynamicCache  # lazy: slow import, model paths only

    # Arguments first: max_new_tokens=0 used to return empty text and [] failed inside max() with no name.
    if prompts is None or isinstance(prompts, str | bytes | ProbePrompt) or not isinstance(prompts, Iterable):
        raise UsageError(f"prompts must be a list of prompts (token-id lists, ProbePrompts or rendered text), got "
                         f"{type(prompts).__name__}; wrap a single prompt in a list: generate(model, [prompt])")
    prompts = list(prompts)
    if not prompts:
        raise UsageError("prompts is empty: pass at least one prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    tok = None
    if isinstance(model, LoadedModel):
        model, tok = model.model, model.tokenizer
    prompts = [_prompt_ids(p, tok) for p in prompts]
    if stop_ids is None:
        if tok is None:
            raise UsageError("generate() needs stop_ids= for a bare nn.Module; pass a LoadedModel (load_model) to "
                             "take the stop tokens from its chat template")
        stop_ids = stop_token_ids(tok, model)
    if pad_id is None:
        pad_id = int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0
    b = len(prompts)
    temps = [float(temperatures)] * b if isinstance(temperatures, int | float) else [float(t) for t in temperatures]
    if len(temps) != b:
        raise ValueError("one temperature per prompt")
    if not all(math.isfinite(t) and t >= 0 for t in temps):
        raise UsageError(f"temperatures must be finite and >= 0 (0 = greedy), got {temperatures!r}")
    seeds = list(seeds) if seeds is not None else [None] * b
    if any(t > 0 and s is None for t, s in zip(temps, seeds)):
        raise ValueError("sampled rows need a seed so they can be regenerated exactly")
    dev = input_device(model)
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(tuple(p), len(first)) for p in prompts]
    share = share_prefill and len(first) < b
    unique = [list(p) for p in first] if share else prompts
    _check_kv_stores(model, prefix_store, keep_kv)
    kind: str | None = None
    if prefix_store is not None:
        cache, ids, mask, pos, kind = _reuse_prefixes(model, prefix_store, unique, pad_id, dev)
    else:
        ids, mask, pos = left_pad(unique, pad_id, dev)
        cache = DynamicCache()
    gens = _make_generators(seeds, dev)
    temp_t = torch.tensor(temps, device=dev)
    kept: set[int] = set()

    out_tokens: list[list[int]] = [[] for _ in range(b)]
    reasons: list[str | None] = [None] * b

    step_ids, step_pos = ids, pos
    rows = list(range(b))  # original row index of each batch position (rows leave when drop_finished)
    for step in range(max_new_tokens):
        # Not logits_to_keep=1: measured 2x *slower* prefill in bf16 on CPU (benchmarks/bench_speed.py --prefill).
        with forward_kind(kind if step == 0 else None):
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                        **kv_kw(model, cache), use_cache=True)
        logits = out.logits[:, -1, :].float()
        cache = out_cache(out)
        if step == 0 and share:  # expand the unique prompts' prefill to one row per requested prompt
            idx = torch.tensor(inverse, device=dev)
            cache.reorder_cache(idx)
            logits, mask, step_pos = logits[idx], mask[idx], step_pos[idx]
        nxt = logits.argmax(-1)
        for j, i in enumerate(rows):
            if temps[i] > 0 and reasons[i] is None:
                probs = torch.softmax(logits[j] / temp_t[i], dim=-1)
                if top_p < 1.0:
                    probs = _top_p(probs, top_p)
                nxt[j] = torch.multinomial(probs, 1, generator=gens[i])[0]
        for j, t in enumerate(nxt.tolist()):
            i = rows[j]
            if reasons[i] is None:
                out_tokens[i].append(t)
                if t in stop_ids:
                    reasons[i] = stop_ids[t]
        if keep_kv is not None:
            _keep_rows(keep_kv, cache, mask, rows, prompts, out_tokens, reasons, kept, step == max_new_tokens - 1)
        keep = [j for j, i in enumerate(rows) if reasons[i] is None]
        if not keep:
            break
        if len(keep) < len(rows):
            if drop_finished:
                kidx = torch.tensor(keep, device=dev)
                cache.reorder_cache(kidx)
                nxt, mask, step_pos = nxt[kidx], mask[kidx], step_pos[kidx]
                rows = [rows[j] for j in keep]
            else:  # finished rows keep decoding a harmless token; their outputs are discarded
                done = torch.tensor([reasons[i] is not None for i in rows], device=dev)
                nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        step_ids = nxt[:, None]
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=dev)], dim=1)
    gens_out = [Generation(token_ids=out_tokens[i], stop_reason=reasons[i] or "max_tokens") for i in range(b)]
    if tok is not None:
        for g in gens_out:
            g.text = decode(tok, g)[1]
    return gens_out


def _check_kv_stores(model: Any, prefix_store: KVSource | None, keep_kv: KVSource | None) -> None:
    """Refuse a store whose prefixes this call could not reuse, or keys and values an intervention has touched."""
    for store in (prefix_store, keep_kv):
        if store is not None:
            store.check(model)
            problem = reuse_problem(model)
            if problem:
                raise UsageError(f"cannot reuse KV caches: {problem}; call generate without a prefix store")
    before = active_interventions(model, before_boundary_only=True)
    if prefix_store is not None and before:
        raise UsageError(f"{before[0]} edits positions before the user-role boundary, so the stored prefixes (computed "
                         "without it) are not what it would compute: steer from the boundary on (positions="
                         "'boundary', 'generated' or 'boundary+generated') or call generate without prefix_store")
    active = active_interventions(model)
    if keep_kv is not None and active:
        raise UsageError(f"keep_kv stores the generated positions' keys and values, and {active[0]} is active: "
                         "they would carry it into the next turn; keep KV only from unsteered generation")


def fill_prefixes(model: Any, store: KVSource, prompts: Sequence[Sequence[int]], *, pad_id: int = 0,
                  max_tail: int = 0) -> list[tuple[int, KV | None]]:
    """Each prompt's longest stored prefix ``(n_tokens, kv)``, after computing and storing, in one forward call
    marked ``"prefix"``, the prefix up to (not including) the boundary of every prompt whose uncovered rest is
    longer than ``max_tail`` tokens (0: every prompt not yet covered up to its boundary).

    Each computed prefix continues from what the store already holds, so a conversation stored up to its
    answer costs only the tokens after it. :meth:`mechprobe.lm.prefix.PrefixStore.build` calls this per batch.
    """
    model = model.model if isinstance(model, LoadedModel) else model
    found: list[tuple[int, KV | None]] = [store.lookup(p, len(p) - 1) for p in prompts]
    far = [i for i, (n, _) in enumerate(found)
           if n < len(prompts[i]) - 1 and (max_tail == 0 or len(prompts[i]) - n > max_tail)]
    if not far:
        return found
    dev = input_device(model)
    sub = [found[i] for i in far]
    cache, width = assemble([kv for _, kv in sub], [n for n, _ in sub], dev)
    ids, mask, pos = continuation_inputs([prompts[i][n:-1] for i, (n, _) in zip(far, sub)], [n for n, _ in sub],
                                         width, pad_id, dev)
    with forward_kind("prefix"), torch.inference_mode():
        out = logits_kept(model, 1, input_ids=ids, attention_mask=mask, position_ids=pos,
                          **kv_kw(model, cache), use_cache=True)
    cache = out_cache(out)
    for r, i in enumerate(far):
        kv = take_row(cache, r, mask[r].nonzero().flatten())
        store.add(prompts[i][:-1], kv)
        found[i] = (len(prompts[i]) - 1, kv)
    return found


def _reuse_prefixes(model: Any, store: KVSource, prompts: Sequence[Sequence[int]], pad_id: int, dev: torch.device
                    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, str | None]:
    """First-call inputs that continue each prompt from its longest stored prefix (cache, ids, mask, positions,
    forward kind); a prompt whose rest is longer than ``store.max_tail`` has its prefix computed first."""
    found = fill_prefixes(model, store, prompts, pad_id=pad_id, max_tail=store.max_tail)
    starts = [n for n, _ in found]
    cache, width = assemble([kv for _, kv in found], starts, dev)
    if width == 0:
        ids, mask, pos = left_pad(prompts, pad_id, dev)
        return cache, ids, mask, pos, None
    ids, mask, pos = continuation_inputs([p[n:] for p, n in zip(prompts, starts)], starts, width, pad_id, dev)
    return cache, ids, mask, pos, "continue"


def _keep_rows(store: KVSource, cache: Any, mask: torch.Tensor, rows: list[int], prompts: Sequence[Sequence[int]],
               out_tokens: list[list[int]], reasons: list[str | None], kept: set[int], last: bool) -> None:
    """Store the keys and values of rows that ended in this step (all rows on the last step): the prompt and
    every generated token but the last, which no forward has read yet."""
    for j, i in enumerate(rows):
        if i in kept or (reasons[i] is None and not last):
            continue
        ids = list(prompts[i]) + out_tokens[i][:-1]
        cols = mask[j].nonzero().flatten()
        if len(cols) != len(ids):  # the mask must cover exactly the cached tokens of the row
            raise RuntimeError(f"row {i}: {len(cols)} cached positions for {len(ids)} tokens")
        store.add(ids, take_row(cache, j, cols))
        kept.add(i)


def _prompt_ids(p: Sequence[int] | ProbePrompt | str, tokenizer: Any) -> list[int]:
    """Token ids of one prompt given as ids, a :class:`ProbePrompt` or (with a tokenizer) rendered text."""
    if isinstance(p, ProbePrompt):
        return list(p.input_ids)
    if isinstance(p, str):
        if tokenizer is None:
            raise UsageError("a text prompt needs a LoadedModel (its tokenizer); pass token ids for a bare nn.Module")
        return tokenize_rendered(tokenizer, p)[0]
    return [int(t) for t in p]


def _top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, idx = probs.sort(descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < p
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return out / out.sum()


AUTO_MAX_ROWS = 64


def free_memory_bytes(device: torch.device | str | None = None) -> int:
    """Memory a new batch may use now: free CUDA memory on a GPU, ``MemAvailable`` on a CPU (8 GiB if unknown)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def auto_batch_size(model: Any, prompt_len: int, max_new_tokens: int, *, free_bytes: int | None = None,
                    fraction: float = 0.5, max_rows: int = AUTO_MAX_ROWS, prefill_len: int | None = None) -> int:
    """Rows per decode call that fit in ``fraction`` of the free memory (``--batch-size auto``).

    Why bigger is better, up to a point: a decode step reads every weight once whatever the batch, so on a
    memory-bound CPU more rows are nearly free (1.5B bf16, 2 cores: user stage 21.7 tok/s at 8 rows,
    41.9 at 40; ``benchmarks/README.md``). What a row costs is dominated by the prefill's logits (HF
    computes the LM head at every prompt position: prompt_len x vocab values in the model's dtype), then
    the KV cache (prompt + new tokens, every layer) and the widest MLP activation. This counts every row
    as prefilled even though rows sharing a prompt are prefilled once, so the estimate errs on the
    safe side. Capped at ``max_rows``: beyond it, per-step attention and padding eat the gain.

    ``prefill_len``: the tokens the prefill call actually computes (default ``prompt_len``). A prompt that
    continues from a stored prefix (:class:`~mechprobe.lm.prefix.PrefixStore`) prefills only its last few
    tokens, so its logits and MLP activations are a few rows, not ``prompt_len``; only its KV cache is whole.
    Counting the whole prompt there would split one decode call into several for memory it never uses, and
    every extra call repeats all ``max_new_tokens`` decode steps.
    """
    cfg = _text_config(model)
    nbytes, dev = _dtype_bytes_and_device(model)
    vocab = int(getattr(cfg, "vocab_size", 0) or 50_000)
    hidden = int(getattr(cfg, "hidden_size", 0) or 1024)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    fill = prompt_len if prefill_len is None else min(prompt_len, max(1, prefill_len))
    per_row = (fill * vocab * nbytes + (prompt_len + max_new_tokens) * kv_bytes_per_token(model)
               + 3 * fill * inter * nbytes)
    free = free_memory_bytes(dev) if free_bytes is None else free_bytes
    return max(1, min(max_rows, int(fraction * free // max(per_row, 1))))


def _text_config(model: Any) -> Any:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None


def _dtype_bytes_and_device(model: Any) -> tuple[int, torch.device]:
    try:
        p = next(model.parameters())
        return p.element_size(), p.device
    except (StopIteration, AttributeError, TypeError):
        return 4, torch.device("cpu")


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token adds to the model's KV cache, all layers (config defaults if absent)."""
    cfg = _text_config(model)
    nbytes, _ = _dtype_bytes_and_device(model)
    hidden = int(getattr(cfg, "hidden_size", 0) or 1024)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 24)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 16)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or hidden // max(heads, 1))
    return 2 * layers * kv_heads * head_dim * nbytes


def batches_by_length(lengths: Sequence[int], batch_size: int, token_budget: int | None = None) -> list[list[int]]:
    """Group indices into batches of similar length (less padding), capped by size and padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and (len(cur) >= batch_size or (token_budget and longest * (len(cur) + 1) > token_budget)):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def decode(tokenizer: Any, gen: Generation) -> tuple[str, str]:
    """(raw text with special tokens, cleaned text without them and without the stop token)."""
    raw = tokenizer.decode(gen.token_ids, skip_special_tokens=False)
    body = gen.token_ids[:-1] if gen.stop_reason != "max_tokens" else gen.token_ids
    clean = tokenizer.decode(body, skip_special_tokens=True).strip()
    return raw, clean
