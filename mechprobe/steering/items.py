"""Which items the steering experiment steers: the run's own (hash split) or a split file's, with their answers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.errors import UserError
from mechprobe.io import read_jsonl
from mechprobe.records import AssistantRecord
from mechprobe.splits import ItemSplit
from mechprobe.steering.evaluate import split_of
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import assistant_answers


def split_answers(split: ItemSplit, run: Path, cfg: Any, lm: Any, have: set[str], out_dir: Path,
                  wanted: list[str] | None = None) -> dict[str, AssistantRecord]:
    """Assistant answers of the split's items the run does not hold, generated greedily with the run's settings
    into ``<steer dir>/split_answers/assistant.jsonl`` (resumable).

    ``wanted`` (default: every held-out and train item) names the items this invocation will steer: with a fixed
    ``--layer`` and no selection the train items are never steered, and ``--max-heldout`` caps the held-out ones,
    so their answers (minutes each on a CPU for a 1.5B model) are not generated."""
    need = [i for i in (wanted if wanted is not None else (*split.heldout, *split.train)) if i not in have]
    if not need:
        return {}
    items = {it.item_id: it for it in load_dataset(cfg.dataset, path=cfg.data_path).items}
    missing = [i for i in need if i not in items]
    if missing:
        raise UserError(f"split_file={split.path} names {len(missing)} items the {cfg.dataset} data lacks (e.g. "
                        f"{missing[0]}): the data file differs from the split's source; pass the data the split "
                        f"was drawn from (data_path=) or another split")
    print(f"{len(need)} items of split {split.name} are not in {run}: greedy assistant answers go to "
          f"{out_dir / 'split_answers'}")
    recs = assistant_answers(cfg, lm, [items[i] for i in need], out_dir / "split_answers")
    return {r.item_id: r for r in recs}


@dataclass
class SteerItems:
    """The assistant answers by item, the train items (selection, layer sweep) and the held-out items."""

    by_item: dict[str, AssistantRecord]
    train: list[AssistantRecord]
    heldout: list[AssistantRecord]


def steer_items(a: Any, run: Path, cfg: Any, lm: Any, split: ItemSplit | None, out_dir: Path) -> SteerItems:
    """Train and held-out items: the run's by the hash split, or the split file's (answers generated when missing).

    ``a`` is the :class:`~mechprobe.steering.config.SteerConfig`; with a split file only the items this
    invocation steers get answers (see :func:`split_answers`).
    """
    assistants = [AssistantRecord.from_dict(r) for r in read_jsonl(run / "assistant.jsonl", key="item_id")]
    by_item = {x.item_id: x for x in assistants}
    if split is None:
        train_items = [x for x in assistants if split_of(x.item_id) == "train"]
        heldout = [x for x in assistants if split_of(x.item_id) == "heldout"][: a.max_heldout]
    else:
        wanted = list(split.heldout[: a.max_heldout])
        if a.select_on_train:
            wanted += list(split.train[: a.select_items])
        elif a.layer is None:  # the layer sweep steers every train item
            wanted += list(split.train)
        by_item.update(split_answers(split, run, cfg, lm, set(by_item), out_dir, wanted))
        train_items = [by_item[i] for i in split.train if i in by_item]
        heldout = [by_item[i] for i in split.heldout if i in by_item][: a.max_heldout]
        print(f"split {split.name}: {len(train_items)} train items (selection), {len(heldout)} held-out items")
    return SteerItems(by_item, train_items, heldout)
