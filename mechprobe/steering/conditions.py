"""One steering condition (vector kind x alpha) on a set of items: generate (resuming), judge, score NLLs, summarise.

Steered turns are stored per condition in a JSONL file keyed by item, so an interrupted run resumes where it
stopped; labels by another judge than the stored one are kept beside the file, never written into it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mechprobe.io import JsonlStore, read_jsonl
from mechprobe.judges.base import JudgeInput
from mechprobe.lm import chat
from mechprobe.records import AssistantRecord, truncated_item_ids
from mechprobe.steering.evaluate import (
    NllScorer,
    SteeredTurn,
    assistant_accuracy,
    genuine_by_item,
    steered_user_turns,
    summarize,
)
from mechprobe.steering.vector import SteeringVector


def judge_turns(judge, turns: list[SteeredTurn], by_item: dict[str, AssistantRecord], key: str,
                subject: str = "") -> dict[str, str]:
    """Labels of steered turns by ``judge``, keyed ``<key>|<item>``: judged as greedy turns after the item's own
    prompt and answer, exactly as the run's turns were, so steered and unsteered verdicts are comparable
    (``subject``: the steered model, for a judge calibrated per subject model)."""
    inputs = [JudgeInput(record_id=f"{key}|{t.item_id}", prompt=by_item[t.item_id].prompt,
                         response=by_item[t.item_id].response, raw_text=t.raw_text, text=t.text,
                         stop_reason=t.stop_reason, dataset=by_item[t.item_id].dataset, decoding="greedy",
                         item_id=t.item_id, subject=subject) for t in turns]
    bar = tqdm(judge.label_many(inputs), total=len(inputs), desc=f"judge {key}", unit="turn", leave=False)
    return {r.record_id: r.label for r in bar}


def probe_prompt_ids(lm, items, system) -> list[list[int]]:
    """The user-turn probe prompts of ``items`` as token ids (the prefix every steered turn continues)."""
    return [list(chat.build_probe_prompt(lm.tokenizer, x.prompt, x.response, system=system,
                                         history=x.messages or None).input_ids) for x in items]


def base_token_ids(lm, turn: SteeredTurn) -> list[int]:
    """The alpha-0 turn's tokens (rows of older versions lack them: re-tokenised from the raw text)."""
    if turn.token_ids is not None:
        return list(turn.token_ids)
    return list(lm.tokenizer(turn.raw_text, add_special_tokens=False).input_ids)


def run_condition(lm, judge, vec, alpha, a, items, by_item, path: Path, system=None,
                  base: dict[str, SteeredTurn] | None = None, scorer: NllScorer | None = None,
                  engine: object | None = None) -> tuple[dict, list[SteeredTurn], dict[str, bool]]:
    """Generate (resuming ``path``), judge and summarise one (vector, alpha) on ``items``.

    With ``base`` (the alpha-0 turns of the same items), each turn also gets ``nll_base_text``: the NLL
    of the unsteered turn under this condition's steered model. Returns the summary, the turns and
    per-item genuine flags (for the paired test against alpha 0).
    """
    steered = vec is not None and alpha != 0
    kind = vec.kind if steered else "none"
    key = f"{kind}|a{alpha:g}"
    store = JsonlStore(path, key="item_id")
    done = {r["item_id"] for r in read_jsonl(path, key="item_id")}
    todo = [x for x in items if x.item_id not in done]
    if todo:
        scorer = scorer or NllScorer(lm)
        t0 = time.perf_counter()
        turns = steered_user_turns(lm, todo, vec if steered else None, alpha, a.positions, a.max_user_tokens,
                                   system=system, engine=engine, nll=scorer)
        turns = with_base_nll(lm, turns, todo, vec if steered else None, alpha, a.positions, system, base, scorer)
        t1 = time.perf_counter()
        labels = judge_turns(judge, turns, by_item, key, getattr(lm, "name", ""))
        print(f"{path.parent.name}/{path.name}: {len(todo)} turns generated + NLLs in {t1 - t0:.0f} s, "
              f"judged in {time.perf_counter() - t1:.0f} s", flush=True)
        for t in turns:
            store.append({**asdict(t), "label": labels.get(f"{key}|{t.item_id}"), "judge": judge.name})
    wanted = {x.item_id for x in items}
    rows = [r for r in read_jsonl(path, key="item_id") if r["item_id"] in wanted]
    turns = [SteeredTurn(**{k: v for k, v in r.items() if k not in ("label", "judge")}) for r in rows]
    missing = [t for t in turns if t.nll_base_text is None]
    if missing and (base is not None or not steered):  # rows of older versions: compute, do not rewrite the file
        fixed = {t.item_id: t for t in with_base_nll(lm, missing, [by_item[t.item_id] for t in missing],
                                                     vec if steered else None, alpha, a.positions, system, base,
                                                     scorer or NllScorer(lm))}
        turns = [fixed.get(t.item_id, t) for t in turns]
    labels = {f"{key}|{r['item_id']}": r["label"] for r in rows if r.get("judge") == judge.name}
    labels.update(other_judge_labels(judge, turns, rows, by_item, key, path, getattr(lm, "name", "")))
    cut = set() if getattr(a, "include_truncated", False) else truncated_item_ids(by_item[t.item_id] for t in turns)
    res = summarize(turns, labels, key, cut)
    nb = [t.nll_base_text for t in turns if t.nll_base_text is not None]
    res["nll_unsteered_text"] = sum(nb) / len(nb) if nb else None
    return {"kind": kind, "alpha": alpha, **res}, turns, genuine_by_item(turns, labels, key, cut)


def other_judge_labels(judge, turns: list[SteeredTurn], rows: list[dict], by_item: dict[str, AssistantRecord],
                       key: str, path: Path, subject: str = "") -> dict[str, str]:
    """Labels by ``judge`` for rows another judge labelled (or older rows that do not say which judge did).

    Why: a steering directory outlives its judge (docs/results.md: the 1.5B sweep was re-judged with ``hybrid-voice:``).
    Reusing the stored label under another ``--judge`` would mix judges silently; regenerating would waste the turns.
    So the turns are judged again, never regenerated, and the verdicts kept in ``<file>.labels.jsonl`` keyed by
    judge and item (resumable; the generation file is never rewritten).
    """
    other = [r for r in rows if r.get("judge") != judge.name]
    if not other:
        return {}
    side_p = path.with_name(path.stem + ".labels.jsonl")
    side = {r["key"]: r["label"] for r in read_jsonl(side_p, key="key")}
    other_ids = {r["item_id"] for r in other}
    need = [t for t in turns if t.item_id in other_ids and f"{judge.name}|{t.item_id}" not in side]
    if need:
        got = judge_turns(judge, need, by_item, key, subject)
        store = JsonlStore(side_p, key="key")
        for t in need:
            lab = got.get(f"{key}|{t.item_id}")
            store.append({"key": f"{judge.name}|{t.item_id}", "item_id": t.item_id, "judge": judge.name,
                          "label": lab})
            side[f"{judge.name}|{t.item_id}"] = lab
    return {f"{key}|{r['item_id']}": side[f"{judge.name}|{r['item_id']}"] for r in other}


def with_base_nll(lm, turns, items, vec, alpha, positions, system, base, scorer: NllScorer) -> list[SteeredTurn]:
    """Fill ``nll_base_text``: at alpha 0 the turn is its own base text; steered, score the base turns."""
    if vec is None:
        return [replace(t, nll_base_text=t.nll) for t in turns]
    if base is None:
        return turns
    have = [(t, x) for t, x in zip(turns, items) if x.item_id in base]
    nlls = scorer(probe_prompt_ids(lm, [x for _, x in have], system),
                  [base_token_ids(lm, base[x.item_id]) for _, x in have], vec, alpha, positions)
    got = {t.item_id: n for (t, _), n in zip(have, nlls)}
    return [replace(t, nll_base_text=got.get(t.item_id)) for t in turns]


class TaskAccuracy:
    """Task accuracy of the assistant turn with a vector on, per condition, cached in ``accuracy.jsonl``.

    Why cached by condition key (kind, layer, unit, alpha, seed, item count): a resumed run must not pay for
    the assistant answers again, and a key that omits any of these would hand one condition another's number.
    """

    def __init__(self, lm: Any, path: Path, items: list[AssistantRecord], layer: int, unit: str, a: Any, cfg: Any,
                 engine: object | None) -> None:
        self.lm, self.items, self.layer, self.unit, self.a, self.cfg, self.engine = lm, items, layer, unit, a, cfg, engine
        self.store = JsonlStore(path, key="cond")
        self.done = {r["cond"]: r["accuracy"] for r in read_jsonl(path, key="cond")}
        self.n_items = len(items)

    def __call__(self, vec: SteeringVector | None, alpha: float) -> float | None:
        a = self.a
        if a.no_assistant_check or (vec is not None and vec.kind not in a.acc_kinds.split(",") and alpha != 0):
            return None
        steered = vec is not None and alpha != 0
        n = self.n_items
        cond = (f"{vec.kind}|L{self.layer}|{self.unit}|a{alpha:g}|seed{a.seed}|n{n}" if steered else f"none|n{n}")
        if cond not in self.done:
            self.done[cond] = assistant_accuracy(self.lm, self.items, vec if steered else None, alpha,
                                                 self.cfg.max_assistant_tokens, system=self.cfg.system,
                                                 engine=self.engine)
            self.store.append({"cond": cond, "accuracy": self.done[cond], "n_items": n})
        return self.done[cond]
