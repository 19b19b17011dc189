"""The study's post-training arms: training data, the control pairing, audited DPO pairs, adapters, patching.

Why these live with the study and not in :mod:`mechprobe.post_train`: every choice here is a rule of the
pre-registered plan (which human turns, how the control pairs them, which labelled turns make a DPO pair, which
residual is patched where), so the rules are written once, next to the plan that names them, and tested there.
Training itself is :func:`mechprobe.post_train.train.train_lora` / :func:`mechprobe.post_train.dpo.train_dpo`.

* SFT: LoRA on real human next turns (HH-RLHF harmless-base test and Topical-Chat test_freq, the only real
  human next turns in the shared data), the loss on the human turn only.
* Control: the same human turns, each after *another* conversation's messages (a seeded derangement within its
  source), so the turn has nothing in front of it to react to; an example is kept in both arms only when both
  renderings fit, so the two arms train on the same human turns in the same order.
* DPO pairs: from the blind train labels only: chosen = both labellers strictly genuine, rejected = neither
  labeller genuine under the lenient reading, same train conversation; never a judge verdict.
* Patching: the post-trained model's residual at the user-role boundary (one position) written into the base
  model at one residual index, then the post-trained model's own turn teacher-forced: the fraction of the
  post-trained-minus-base log-likelihood gap that one position carries.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from mechprobe.errors import UsageError
from mechprobe.lm import chat
from mechprobe.lm.forward import get_blocks
from mechprobe.post_train import train as pt
from mechprobe.post_train.pairs import Pair
from mechprobe.records import AssistantRecord

__all__ = ["human_turn_split", "control_pairing", "paired_examples", "adapter_sha256", "audited_pairs",
           "probe_ids", "boundary_states", "turn_logliks", "patch_boundary", "add_from", "recovered_fraction", "turn_ids",
           "target_logprobs", "merge_error"]


def human_turn_split(sources: Sequence[str], held_out_fraction: float, data_path: str | Path | None = None,
                     limit: int | None = None) -> tuple[list[pt.Conversation], list[pt.Conversation]]:
    """(train, held-out) real conversations ending at an assistant turn, each with the human turn that followed.

    The split is by conversation id (:func:`mechprobe.splits.split_of`), so the held-out training loss that
    chooses the step count is measured on conversations no step trained on.
    """
    convs = pt.load_conversations(sources, data_path=data_path, limit=limit)
    return pt.split_conversations(convs, held_out_fraction)


def control_pairing(convs: Sequence[pt.Conversation], seed: int) -> list[pt.Conversation]:
    """Each conversation's human next turn after another conversation's messages (same source, seeded).

    A derangement within each source (no turn keeps its own context; a context whose own next turn is the same
    text is avoided too): the control trains the same human turns with nothing in front of them to react to.

    Example:
        >>> cs = [pt.Conversation(f"s:{i}", "s", [{"role": "user", "content": f"q{i}"},
        ...       {"role": "assistant", "content": f"a{i}"}], f"n{i}") for i in range(4)]
        >>> [c.messages[-1]["content"] != f"a{c.next_user[1:]}" for c in control_pairing(cs, 0)]
        [True, True, True, True]
    """
    by_src: dict[str, list[int]] = {}
    for i, c in enumerate(convs):
        by_src.setdefault(c.source, []).append(i)
    rng = np.random.default_rng(seed)
    other = list(range(len(convs)))
    for src, idx in sorted(by_src.items()):
        if len(idx) < 2:
            raise UsageError(f"control pairing: source {src} has {len(idx)} conversation(s); it needs two or more")
        for _ in range(1000):
            perm = [idx[j] for j in rng.permutation(len(idx))]
            if all(p != i and convs[p].next_user.strip() != convs[i].next_user.strip() for i, p in zip(idx, perm)):
                break
        else:
            raise UsageError(f"control pairing: no derangement of source {src} found (too many identical turns)")
        for i, p in zip(idx, perm):
            other[i] = p
    return [pt.Conversation(conv_id=f"control:{c.conv_id}<-{convs[o].conv_id}", source=c.source,
                            messages=list(convs[o].messages), next_user=c.next_user)
            for c, o in zip(convs, other)]


def paired_examples(tokenizer: Any, real: Sequence[pt.Conversation], control: Sequence[pt.Conversation],
                    max_len: int) -> tuple[list[pt.TrainExample], list[pt.TrainExample], dict[str, int]]:
    """SFT and control examples over the same human turns: a turn is kept in both arms only when both of its
    renderings fit ``max_len`` (never truncated), so the arms differ only in what precedes the turn."""
    if len(real) != len(control):
        raise UsageError("paired_examples: the control list must pair every real conversation")
    a: list[pt.TrainExample] = []
    b: list[pt.TrainExample] = []
    skipped = {"too_long": 0, "template": 0}
    for r, c in zip(real, control):
        try:
            er = pt.build_example(tokenizer, r.messages, r.next_user, r.conv_id)
            ec = pt.build_example(tokenizer, c.messages, c.next_user, c.conv_id)
        except pt.PostTrainError:
            skipped["template"] += 1
            continue
        if max(len(er.input_ids), len(ec.input_ids)) > max_len:
            skipped["too_long"] += 1
            continue
        a.append(er)
        b.append(ec)
    return a, b, skipped


def adapter_sha256(adapter_dir: str | Path) -> str:
    """sha256 over the adapter's tensors (names, dtypes, shapes, bytes; sorted by name): the adapter's identity,
    independent of the file's metadata layout."""
    f = Path(adapter_dir) / "adapter_model.safetensors"
    if not f.is_file():
        raise UsageError(f"{f} not found: train the adapter first")
    h = hashlib.sha256()
    for k, v in sorted(load_file(str(f)).items()):
        t = v.detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def turn_ids(tokenizer: Any, text: str) -> list[int]:
    """A user turn's ids as the model would write them: its text's tokens and the user end-of-turn token."""
    eot = chat.user_end_of_turn_ids(tokenizer)
    return list(tokenizer(text.strip(), add_special_tokens=False)["input_ids"]) + eot[:1]


def audited_pairs(rows: Sequence[Mapping[str, Any]], turns: Mapping[str, Mapping[str, Any]],
                  convs: Mapping[str, AssistantRecord], tokenizer: Any) -> tuple[list[Pair], dict[str, Any]]:
    """DPO pairs from blind labels: every (chosen, rejected) of one train conversation where both labellers call
    the chosen turn genuine under the strict reading and neither calls the rejected one genuine under the lenient
    reading (turns the labellers split on are never used).

    Args:
        rows: labelled train turns (``turn_id``, ``item_id``, ``decoding``, ``labels``: one dict per labeller with
            ``strict_genuine``/``lenient_genuine``/``label``), as the study's ``train_labels`` returns them.
        turns: the train turns by ``turn_id`` (their ``turn`` text).
        convs: the train conversations by item id.
        tokenizer: the base model's tokenizer.
    Returns:
        (pairs in item order, counts: pairs, items, and where the chosen and rejected turns came from).
    """
    pos: dict[str, list[Mapping[str, Any]]] = {}
    neg: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        labs = r["labels"]
        if labs and all(x["strict_genuine"] for x in labs):
            pos.setdefault(r["item_id"], []).append(r)
        elif labs and not any(x["lenient_genuine"] for x in labs):
            neg.setdefault(r["item_id"], []).append(r)
    pairs: list[Pair] = []
    src_c: dict[str, int] = {}
    src_r: dict[str, int] = {}
    for item in sorted(set(pos) & set(neg)):
        a = convs[item]
        prompt = probe_ids(tokenizer, [a])[0]
        for c in sorted(pos[item], key=lambda r: r["turn_id"]):
            for n in sorted(neg[item], key=lambda r: r["turn_id"]):
                # An empty rejected turn (the model ended its turn at once) is a real non-genuine turn: kept.
                ct, nt = turns[c["turn_id"]]["turn"], turns[n["turn_id"]]["turn"]
                pairs.append(Pair(item, c["turn_id"], n["turn_id"], str(n["labels"][0]["label"]), ct, nt, prompt,
                                  turn_ids(tokenizer, ct), turn_ids(tokenizer, nt)))
                src_c[c["decoding"]] = src_c.get(c["decoding"], 0) + 1
                src_r[n["decoding"]] = src_r.get(n["decoding"], 0) + 1
    return pairs, {"pairs": len(pairs), "items": len({p.item_id for p in pairs}), "chosen_from": src_c,
                   "rejected_from": src_r, "items_with_chosen": len(pos), "items_with_rejected": len(neg)}


def probe_ids(tokenizer: Any, convs: Sequence[AssistantRecord]) -> list[list[int]]:
    """Each conversation's probe prompt ids (query, answer, the user-role header; the boundary is the last id)."""
    return [list(chat.build_probe_prompt(tokenizer, a.prompt, a.response, history=a.messages or None).input_ids)
            for a in convs]


@torch.inference_mode()
def boundary_states(model: Any, prompts: Sequence[Sequence[int]], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The residual at the user-role boundary (the last id of each probe prompt, :func:`probe_ids`) at each residual index in ``layers``
    (``r`` = the output of block ``r - 1``, read by a hook, so the last index is the pre-norm residual the patch
    writes): ``{layer: [n, d_model] float32}``, one unpadded forward per conversation (no padding to reason about).
    """
    blocks = get_blocks(model)
    bad = [r for r in layers if not 1 <= r <= len(blocks)]
    if bad:
        raise UsageError(f"boundary layers {bad}: residual indices 1..{len(blocks)} (the output of a block)")
    dev = next(model.parameters()).device
    out: dict[int, list[torch.Tensor]] = {r: [] for r in layers}
    seen: dict[int, torch.Tensor] = {}

    def grab(r: int) -> Any:
        def hook(_m: Any, _inp: Any, o: Any) -> None:
            seen[r] = (o if isinstance(o, torch.Tensor) else o[0])[0, -1].float().cpu()
        return hook

    handles = [blocks[r - 1].register_forward_hook(grab(r)) for r in layers]
    try:
        for p in prompts:
            model(input_ids=torch.tensor([list(p)], device=dev), use_cache=False)
            for r in layers:
                out[r].append(seen[r])
    finally:
        for h in handles:
            h.remove()
    return {r: torch.stack(v) for r, v in out.items()}


@contextmanager
def _edit_block_output(model: Any, layer: int, edit: Any, what: str) -> Iterator[None]:
    """While open, every forward's output of block ``layer - 1`` (residual index ``layer``) is ``edit(h)``; the
    hook is removed on exit, also after an exception."""
    blocks = get_blocks(model)
    if not 1 <= layer <= len(blocks):
        raise UsageError(f"{what} layer {layer}: residual indices 1..{len(blocks)} (the output of a block)")

    def hook(_m: Any, _inp: Any, out: Any) -> Any:
        h = edit(out if isinstance(out, torch.Tensor) else out[0])
        return h if isinstance(out, torch.Tensor) else (h, *out[1:])

    handle = blocks[layer - 1].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def patch_boundary(model: Any, layer: int, value: torch.Tensor, position: int) -> Any:
    """While open, the output of block ``layer - 1`` at sequence ``position`` of every forward is ``value``
    (a ``[d_model]`` tensor): one residual position of another model written into this one."""

    def edit(h: torch.Tensor) -> torch.Tensor:
        if h.shape[1] > position:
            h = h.clone()
            h[:, position] = value.to(h.dtype).to(h.device)
        return h

    return _edit_block_output(model, layer, edit, "patch")


def add_from(model: Any, layer: int, vector: torch.Tensor, start: int) -> Any:
    """While open, ``vector`` is added to the output of block ``layer - 1`` at every position from ``start`` on:
    steering at the boundary and every turn position of a teacher-forced forward (what generation's
    ``boundary+generated`` does over the decode steps)."""

    def edit(h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[:, start:] += vector.to(h.dtype).to(h.device)
        return h

    return _edit_block_output(model, layer, edit, "steer")


@torch.inference_mode()
def turn_logliks(model: Any, prompts: Sequence[Sequence[int]], turns: Sequence[Sequence[int]],
                 edit: Callable[[int, int], Any] | None = None) -> list[float]:
    """Teacher-forced log-likelihood (sum over the turn's tokens) of each ``turns[i]`` after probe prompt
    ``prompts[i]`` (:func:`probe_ids`), one unpadded forward per item; ``edit(i, boundary)`` (optional) returns a context manager active
    during item ``i``'s forward (``boundary`` = the probe prompt's last position): a patch or a steering vector.
    """
    dev = next(model.parameters()).device
    out = []
    for i, (p, t) in enumerate(zip(prompts, turns)):
        p = list(p)
        ids = torch.tensor([p + list(t)], device=dev)
        with edit(i, len(p) - 1) if edit is not None else nullcontext():
            logits = model(input_ids=ids, use_cache=False).logits
        lp = torch.log_softmax(logits[0, len(p) - 1:-1].float(), -1)
        out.append(float(lp.gather(1, torch.tensor(list(t), device=dev)[:, None]).sum()))
    return out


def recovered_fraction(base: Sequence[float], post: Sequence[float], patched: Sequence[float], seed: int = 0,
                       n_boot: int = 2000) -> dict[str, float]:
    """Fraction of the post-minus-base log-likelihood gap a patch recovers: sum(patched - base) / sum(post - base)
    over items (a ratio of sums, stable when single items have tiny gaps), with an item-bootstrap 95% interval.

    Example:
        >>> recovered_fraction([0.0, 0.0], [2.0, 2.0], [1.0, 1.0])["fraction"]
        0.5
    """
    b, p, x = (np.asarray(v, dtype=float) for v in (base, post, patched))
    gap = p - b
    if not len(gap) or math.isclose(float(gap.sum()), 0.0, abs_tol=1e-12):
        return {"fraction": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": len(gap), "gap": 0.0}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(gap), size=(n_boot, len(gap)))
    den = gap[idx].sum(1)
    boots = np.where(np.abs(den) > 1e-12, (x - b)[idx].sum(1) / np.where(den == 0, 1, den), np.nan)
    lo, hi = np.nanpercentile(boots, [2.5, 97.5])
    return {"fraction": float((x - b).sum() / gap.sum()), "lo": float(lo), "hi": float(hi), "n": len(gap),
            "gap": float(gap.mean())}


@torch.inference_mode()
def target_logprobs(model: Any, examples: Sequence[pt.TrainExample]) -> torch.Tensor:
    """Log-probability of every target token (label != -100) of ``examples``, one unpadded forward each,
    concatenated in order: what a training example says the model should write, as the model scores it."""
    dev = next(model.parameters()).device
    out = []
    for e in examples:
        ids = torch.tensor([list(e.input_ids)], device=dev)
        lab = torch.tensor(list(e.labels), device=dev)
        pos = torch.nonzero(lab[1:] != pt.IGNORE).flatten()
        logits = model(input_ids=ids, use_cache=False).logits[0, pos].float()
        out.append(torch.log_softmax(logits, -1).gather(1, lab[pos + 1][:, None])[:, 0].cpu())
    return torch.cat(out) if out else torch.zeros(0)


def merge_error(base: torch.Tensor, unmerged: torch.Tensor, merged: torch.Tensor) -> dict[str, float]:
    """How much of an adapter's effect merging it into low-precision weights loses: the relative error
    ||merged - unmerged|| / ||unmerged - base|| over target-token log-probabilities (0 = merged is the trained
    model; 1 = the error is as large as the whole effect), and the share of the mean log-probability gain kept.

    Example:
        >>> r = merge_error(torch.zeros(4), torch.ones(4), torch.full((4,), 0.9))
        >>> round(r["relative_error"], 3), round(r["gain_kept"], 3)
        (0.1, 0.9)
    """
    effect = float((unmerged - base).norm())
    err = float((merged - unmerged).norm())
    gain = float((unmerged - base).mean())
    return {"relative_error": err / effect if effect > 0 else float("inf"),
            "gain_kept": float((merged - base).mean()) / gain if gain != 0 else float("nan"),
            "effect_norm": effect, "error_norm": err, "n_tokens": int(base.numel()),
            "error_rms_per_token": err / max(1, base.numel()) ** 0.5}
