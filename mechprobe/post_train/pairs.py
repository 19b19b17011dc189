"""Preference pairs for the DPO step: user turns the *base* model sampled for the same training conversation.

One pair = one probe prompt (the rendered conversation ``[user query, the base model's own answer]`` up to and
including the user-role header: exactly the ``prompt_ids`` of a probe run's user-turn record), a *chosen* turn the
judge called ``genuine_followup`` and a *rejected* turn of the same prompt with a failure label. The completions are
the sampled token ids themselves (``generated_ids``, the stop token included), so the pair is on-policy token for
token and the DPO completion mask is exactly the user turn plus its end-of-turn token.

Training items are GSM8K test rows that no evaluation ever reads: rows below the index the fixed steering split
starts at (earlier ``--limit 200`` runs and every post-training eval list use them), both lists of that split, and
the post-training evaluation items are all excluded, and :func:`build_pairs` refuses a training set that meets the
evaluation set. The item ids of both go into the pairs manifest.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.audit.rates import AuditTruth
from mechprobe.errors import UserError
from mechprobe.io import write_json
from mechprobe.splits import STEERING_SPLIT_RULE
from mechprobe.stats import Rate
from mechprobe.taxonomy import GENUINE, JUDGE_ERROR

PAIRS_FILE = "pairs.jsonl"
PAIRS_MANIFEST = "pairs_manifest.json"
PAIR_DATASET = "gsm8k"
# Rows below this index were used by earlier runs for selection, thresholds and judge choices, and hold every
# post-training eval list (the first --eval-limit items): never a DPO training item.
RESERVED_ROWS = int(STEERING_SPLIT_RULE["min_index"])


class PairError(UserError, ValueError):
    """The preference pairs cannot be built (no usable pair, training items that meet the evaluation items)."""


@dataclass(frozen=True)
class Pair:
    """One preference pair: a probe prompt and two sampled user turns of it, chosen (genuine) and rejected.

    Args:
        item_id: the training item (a GSM8K row id).
        chosen_id: record id of the turn judged ``genuine_followup``.
        rejected_id: record id of the turn with a failure label.
        rejected_label: that failure label.
        chosen_text: the chosen turn's cleaned text (for reading; training uses the ids).
        rejected_text: the rejected turn's cleaned text.
        prompt_ids: the probe prompt (conversation + user-role header).
        chosen_ids: the chosen turn's generated ids, its stop token included.
        rejected_ids: the rejected turn's generated ids (a turn cut at the token cap has no stop token).

    Example:
        >>> p = Pair("gsm8k-0600", "gsm8k-0600|T1|s0", "gsm8k-0600|T1|s1", "new_query", "Why 3?", "Now 2+2?",
        ...          [1, 2], [3, 9], [4, 9])
        >>> Pair.from_dict(p.to_dict()) == p
        True
    """

    item_id: str
    chosen_id: str
    rejected_id: str
    rejected_label: str
    chosen_text: str
    rejected_text: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pair:
        return cls(**dict(d))

    @property
    def longest(self) -> int:
        """Tokens of the longer of the two sequences (prompt + completion)."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


@dataclass
class PairSet:
    """The pairs and the counts that say how many were available (written to the pairs manifest)."""

    pairs: list[Pair]
    counts: dict[str, Any] = field(default_factory=dict)


def training_item_ids(all_ids: Sequence[str], n: int, excluded: Iterable[str]) -> list[str]:
    """The first ``n`` ids of ``all_ids`` (a dataset's ids in row order) at row >= :data:`RESERVED_ROWS` that are not
    ``excluded`` (the evaluation items and both lists of the fixed steering split).

    Args:
        all_ids: every item id of the training dataset, in row order (``gsm8k-0000`` ...).
        n: how many training items to take (>= 1).
        excluded: item ids no training item may be.

    Returns:
        The chosen ids, in row order (fewer than ``n`` when the dataset runs out).

    Example:
        >>> ids = [f"gsm8k-{i:04d}" for i in range(510)]
        >>> training_item_ids(ids, 3, excluded={"gsm8k-0501"})
        ['gsm8k-0500', 'gsm8k-0502', 'gsm8k-0503']
    """
    if n < 1:
        raise PairError(f"pair_items={n}: must be >= 1")
    skip = set(excluded)
    return [i for i in all_ids[RESERVED_ROWS:] if i not in skip][:n]


def check_disjoint(train_ids: Iterable[str], eval_ids: Iterable[str]) -> None:
    """Raise :class:`PairError` when a training item is also an evaluation item.

    Args:
        train_ids: the DPO training item ids.
        eval_ids: every item id an evaluation reads.

    Example:
        >>> check_disjoint(["gsm8k-0600"], ["gsm8k-0000"])
        >>> check_disjoint(["gsm8k-0000"], ["gsm8k-0000"])
        Traceback (most recent call last):
        ...
        mechprobe.post_train.pairs.PairError: 1 DPO training item(s) are evaluation items (e.g. gsm8k-0000): the preference step must never train on what it is evaluated on
    """
    both = sorted(set(train_ids) & set(eval_ids))
    if both:
        raise PairError(f"{len(both)} DPO training item(s) are evaluation items (e.g. {both[0]}): the preference step "
                        "must never train on what it is evaluated on")


def build_pairs(turns: Iterable[Mapping[str, Any]], labels: Mapping[str, Mapping[str, Any]], train_ids: Iterable[str],
                eval_ids: Iterable[str], *, truncated: Iterable[str] = (), max_len: int | None = None,
                max_pairs: int | None = None) -> PairSet:
    """Pair a genuine and a failure turn of the same training item, each turn used at most once.

    Only sampled turns count (greedy turns are not draws of the same distribution). Per item the genuine turns
    that ended (a stop token; a genuine turn cut at the cap would teach an unfinished turn) are paired in sample
    order with the failure turns: ``min(#genuine, #failure)`` pairs. Judge errors are neither. Turns of items
    outside ``train_ids`` are never used (counted as ``outside_training_items``); ``truncated`` items (assistant
    answer at its token cap) are left out as in every rate. Pairs longer than ``max_len`` tokens are skipped and
    counted; ``max_pairs`` keeps the first pairs in item order.

    Args:
        turns: user-turn rows of a probe run (``user_turns.jsonl`` as dicts).
        labels: ``record_id -> label row`` (``labels.jsonl``).
        train_ids: the training item ids.
        eval_ids: every evaluation item id; meeting ``train_ids`` raises :class:`PairError`.
        truncated: item ids whose assistant answer hit its token cap.
        max_len: longest prompt + completion in tokens; None = no limit.
        max_pairs: keep at most this many pairs; None = all.

    Returns:
        A :class:`PairSet`; its ``counts`` hold items, turns, genuine, failures, items with both, pairs
        available, too long, used.

    Example:
        >>> t = [{"record_id": f"a|T1|s{k}", "item_id": "a", "decoding": "sample", "sample_index": k, "text": x,
        ...       "stop_reason": "end_of_turn", "prompt_ids": [1], "generated_ids": [k, 9]}
        ...      for k, x in enumerate(["Why 3?", "Next one?"])]
        >>> lab = {"a|T1|s0": {"label": "genuine_followup"}, "a|T1|s1": {"label": "new_query"}}
        >>> ps = build_pairs(t, lab, ["a"], ["b"])
        >>> [(p.chosen_id, p.rejected_id) for p in ps.pairs], ps.counts["pairs_used"]
        ([('a|T1|s0', 'a|T1|s1')], 1)
    """
    train, evals = set(train_ids), set(eval_ids)
    check_disjoint(train, evals)
    cut = set(truncated)
    by_item: dict[str, list[Mapping[str, Any]]] = {}
    c: Counter = Counter()
    for t in turns:
        if t.get("decoding") != "sample" or t.get("variant", "full") != "full":
            continue
        iid = str(t["item_id"])
        if iid not in train or iid in evals:
            c["outside_training_items"] += 1
            continue
        if iid in cut:
            c["after_truncated_answer"] += 1
            continue
        by_item.setdefault(iid, []).append(t)
    pairs: list[Pair] = []
    rejected_labels: Counter = Counter()
    for iid in sorted(by_item):
        rows = sorted(by_item[iid], key=lambda r: int(r.get("sample_index", 0)))
        good, bad = [], []
        for r in rows:
            c["turns"] += 1
            lab = labels.get(r["record_id"], {}).get("label")
            if lab is None or lab == JUDGE_ERROR:
                c["unjudged_or_judge_error"] += 1
            elif lab == GENUINE:
                c["genuine"] += 1
                if r.get("stop_reason") == "max_tokens":
                    c["genuine_unfinished"] += 1
                else:
                    good.append(r)
            else:
                c["failure"] += 1
                bad.append((r, lab))
        if good and bad:
            c["items_with_both"] += 1
        for g, (b, lab) in zip(good, bad):
            p = Pair(iid, g["record_id"], b["record_id"], lab, g.get("text", ""), b.get("text", ""),
                     list(g["prompt_ids"]), list(g["generated_ids"]), list(b["generated_ids"]))
            if list(b["prompt_ids"]) != p.prompt_ids:
                raise PairError(f"{iid}: two sampled turns of one item have different probe prompts")
            c["pairs_available"] += 1
            if max_len is not None and p.longest > max_len:
                c["pairs_too_long"] += 1
                continue
            pairs.append(p)
            rejected_labels[lab] += 1
    c["items"] = len(by_item)
    if max_pairs is not None:
        pairs = pairs[:max_pairs]
    counts = {k: int(c[k]) for k in ("items", "turns", "genuine", "genuine_unfinished", "failure",
                                     "unjudged_or_judge_error", "items_with_both", "pairs_available",
                                     "pairs_too_long", "outside_training_items", "after_truncated_answer")}
    counts["pairs_used"] = len(pairs)
    counts["rejected_labels"] = dict(Counter(p.rejected_label for p in pairs).most_common())
    return PairSet(pairs, counts)


def require_pairs(ps: PairSet) -> None:
    """One clear line when there is nothing to train on.

    Args:
        ps: the built pairs.

    Example:
        >>> require_pairs(PairSet([], {"items": 5, "items_with_both": 0, "pairs_available": 0}))
        Traceback (most recent call last):
        ...
        mechprobe.post_train.pairs.PairError: no pairs: 0 of 5 training items had both a genuine and a failure turn; sample more (pair_samples=) or use more items (pair_items=)
    """
    if ps.pairs:
        return
    n, both = ps.counts.get("items", 0), ps.counts.get("items_with_both", 0)
    if both and ps.counts.get("pairs_too_long"):
        raise PairError(f"no pairs: all {ps.counts['pairs_available']} pairs are longer than max_len= tokens; raise "
                        "max_len= or cap the answers (max_assistant_tokens=)")
    raise PairError(f"no pairs: {both} of {n} training items had both a genuine and a failure turn; sample more "
                    "(pair_samples=) or use more items (pair_items=)")


def judge_error_on_pairs(pairs: Sequence[Pair], audit: AuditTruth | None) -> dict[str, Any]:
    """How often the audit disagrees with the judge on the turns the pairs use.

    A chosen turn the audit does not call genuine (consensus < 0.5), or a rejected turn it does, makes a pair
    that teaches the wrong order. Without an audit of the pairs run this says so and how to get one.

    Args:
        pairs: the pairs used.
        audit: :func:`mechprobe.audit.rates.audit_truth` of the pairs run, or None.

    Returns:
        ``{"audited": bool, ...}``: with an audit, per side the audited turns and how many the audit contradicts
        (Wilson 95% CIs), and the audited pairs with a wrong order.

    Example:
        >>> judge_error_on_pairs([], None)["audited"]
        False
    """
    if audit is None:
        return {"audited": False, "note": "no audit of the pairs run: audit it (the audit command with n=80, by=decoding, or "
                                          "every turn), label the sheet, import the labels (labels=...), then re-run "
                                          "to fill this"}
    t = audit.truth
    chosen = [t[p.chosen_id] for p in pairs if p.chosen_id in t]
    rejected = [t[p.rejected_id] for p in pairs if p.rejected_id in t]
    wrong_c = Rate(sum(v < 0.5 for v in chosen), len(chosen))
    wrong_r = Rate(sum(v >= 0.5 for v in rejected), len(rejected))
    both = [p for p in pairs if p.chosen_id in t and p.rejected_id in t]
    wrong_p = Rate(sum(t[p.chosen_id] < 0.5 or t[p.rejected_id] >= 0.5 for p in both), len(both))
    return {"audited": True, "labellers": list(audit.labellers), "sample_id": audit.sample_id,
            "chosen_not_genuine": wrong_c.to_dict(), "rejected_genuine": wrong_r.to_dict(),
            "pairs_wrong_order": wrong_p.to_dict()}


def write_pairs(out: str | Path, ps: PairSet, meta: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``pairs.jsonl`` (one pair a line) and ``pairs_manifest.json`` (``meta`` + the counts) into ``out``.

    Args:
        out: the directory (created).
        ps: the pairs.
        meta: what else the manifest records (judge, run, item ids, the judge's error on the pairs).

    Returns:
        (pairs file, manifest file).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _, man = write_pairs(d, PairSet([], {"pairs_used": 0}), {"judge": "offline"})
        >>> man.name
        'pairs_manifest.json'
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = out / PAIRS_FILE
    tmp = p.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(x.to_dict()) + "\n" for x in ps.pairs))
    tmp.replace(p)
    m = out / PAIRS_MANIFEST
    write_json(m, {**meta, "counts": ps.counts})
    return p, m
