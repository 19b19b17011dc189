"""Perturbed conversations for the study's controls: the same assistant record, changed before the user header.

Every variant is built from the assistant turn already in the run (nothing is regenerated), so a change in
the follow-up rate between ``full`` and a variant is caused by the change to the conversation alone:

* ``truncate``: the response cut mid-way, in tokens (the first half of its tokens, cut at a token boundary
  of the original string, so the text is an exact prefix of what the model wrote);
* ``append_question``: the response followed by :data:`APPENDED` (the assistant invites a reaction);
* ``no_response``: the user header follows the query directly, with no assistant turn at all;
* ``swap``: the response of another item of the same dataset (a deterministic derangement: no item keeps
  its own response), so the answer no longer matches the question;
* ``no_conversation``: the user header after no conversation, only the system prompt if the template
  writes one; what the model says as "the user" with nothing to react to.

:func:`variant_record` returns the conversation *as the model sees it* (an :class:`AssistantRecord` whose
prompt/response are the perturbed ones): the judge is shown exactly that, since a follow-up can only be
grounded in a response the model was shown.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

from mechprobe.errors import UsageError, UserError
from mechprobe.lm import chat
from mechprobe.records import AssistantRecord

VARIANTS: tuple[str, ...] = ("truncate", "append_question", "no_response", "swap", "no_conversation")
APPENDED = " Does that make sense?"


def check_variants(names: list[str]) -> list[str]:
    """The variants in canonical order; a :class:`UsageError` naming the valid ones for anything else."""
    bad = sorted(set(names) - set(VARIANTS))
    if bad:
        raise UsageError(f"unknown variant(s) {bad}: use any of {', '.join(VARIANTS)}")
    return [v for v in VARIANTS if v in names]


def truncate_response(tokenizer: Any, response: str, frac: float = 0.5) -> str:
    """The first ``floor(n * frac)`` tokens of ``response`` (n = its token count), as a prefix of the string.

    Cut with the tokenizer's character offsets rather than by decoding the kept ids: decoding can change
    spacing or merge bytes, and the judge must see exactly the characters the model was shown.
    """
    if not 0.0 < frac < 1.0:
        raise ValueError(f"frac must be in (0, 1), got {frac}")
    try:
        enc = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizer: decode the kept ids instead
        ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids[: int(len(ids) * frac)])
    keep = int(len(offsets) * frac)
    return response[: offsets[keep - 1][1]] if keep > 0 else ""


def _seed(seed: int, dataset: str) -> int:
    return int.from_bytes(hashlib.sha256(f"swap:{seed}:{dataset}".encode()).digest()[:8], "little")


def derangement(item_ids: list[str], seed: int = 0, dataset: str = "") -> dict[str, str]:
    """``{item: partner}``: one seeded cycle through the sorted ids, so nobody keeps their own response.

    Deterministic for a given id set (the input order does not matter: ids are sorted first, and the seed
    mixes in the dataset name so two datasets are not paired alike). A single cycle is a derangement for
    any n >= 2, where a seeded shuffle alone could leave fixed points.
    """
    ids = sorted(set(item_ids))
    if len(ids) != len(item_ids):
        raise ValueError("derangement: item ids must be unique")
    if len(ids) < 2:
        raise UserError(f"the swap variant needs at least 2 items of one dataset, got {len(ids)}")
    random.Random(_seed(seed, dataset)).shuffle(ids)
    return {ids[i]: ids[(i + 1) % len(ids)] for i in range(len(ids))}


def variant_record(tokenizer: Any, a: AssistantRecord, variant: str,
                   partner: AssistantRecord | None = None) -> AssistantRecord:
    """The conversation the model is shown under ``variant``; task fields (score, gold) stay the original's."""
    if variant == "truncate":
        return dataclasses.replace(a, response=truncate_response(tokenizer, a.response))
    if variant == "append_question":
        return dataclasses.replace(a, response=a.response.rstrip() + APPENDED)
    if variant == "no_response":
        return dataclasses.replace(a, response="")
    if variant == "swap":
        if partner is None or partner.item_id == a.item_id:
            raise ValueError("swap needs the record of another item as partner")
        return dataclasses.replace(a, response=partner.response)
    if variant == "no_conversation":
        return dataclasses.replace(a, prompt="", response="", messages=[])
    raise UsageError(f"unknown variant {variant!r}: use any of {', '.join(VARIANTS)}")


def variant_records(tokenizer: Any, records: list[AssistantRecord], variant: str, seed: int = 0
                    ) -> list[AssistantRecord]:
    """:func:`variant_record` for every record (``swap`` partners from :func:`derangement` per dataset)."""
    partners: dict[str, str] = {}
    if variant == "swap":
        by_ds: dict[str, list[str]] = {}
        for r in records:
            by_ds.setdefault(r.dataset, []).append(r.item_id)
        for ds, ids in by_ds.items():
            partners.update(derangement(ids, seed, ds))
    by_id = {r.item_id: r for r in records}
    return [variant_record(tokenizer, r, variant, by_id[partners[r.item_id]] if variant == "swap" else None)
            for r in records]


def variant_prompt(tokenizer: Any, v: AssistantRecord, variant: str, system: str | None = None) -> chat.ProbePrompt:
    """The probe prompt of a perturbed record ``v`` (from :func:`variant_record`): conversation + user header."""
    if variant == "no_response":
        return chat.build_headed_prompt(tokenizer, chat.conversation_messages(v.prompt, None, system, v.messages or None))
    if variant == "no_conversation":
        return chat.build_headed_prompt(tokenizer, [{"role": "system", "content": system}] if system is not None else [])
    return chat.build_probe_prompt(tokenizer, v.prompt, v.response, system=system, history=v.messages or None)
