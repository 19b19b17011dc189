"""A store of conversation prefixes' KV caches, so a fixed conversation is read once, not once per arm.

Steering arms, T > 0 samples and repeated evaluations of a study change nothing before the user-role
boundary: the keys and values of the conversation up to (not including) the boundary are the same in every
arm. :class:`PrefixStore` keeps them, keyed by the model's weight hash, dtype and device type and by the token
ids, and :func:`~mechprobe.lm.generation.generate` (``prefix_store=``) then prefills only the tokens after the
longest stored prefix of each prompt: the boundary itself is always computed inside the arm, so a hook at the
boundary (steering at ``boundary`` or ``boundary+generated``, activation capture) sees it computed with the hook
active. An intervention that edits earlier positions (``steer(..., positions="all")``) makes ``generate``
refuse the store; changed weights (training, :func:`~mechprobe.steering.intervene.bake`, ``load_state_dict``)
make the store refuse the model.

The same store carries the probe's answers to their user turns: ``generate(..., keep_kv=store)`` stores each
answer's keys and values (prompt + answer), and the probe prompt that renders that answer continues from the
longest common token prefix (:mod:`mechprobe.turns.pipeline`).

Memory: entries are kept in memory up to ``max_bytes`` (least recently used first out), beyond it on disk
(``disk_dir``, or a temporary directory removed by :meth:`PrefixStore.close`).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from mechprobe.errors import UsageError
from mechprobe.lm.chat import ProbePrompt
from mechprobe.lm.generation import auto_batch_size, batches_by_length, fill_prefixes
from mechprobe.lm.kv import KV, kv_nbytes
from mechprobe.lm.models import LoadedModel

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_TAIL", "PrefixStore"]

DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_MAX_TAIL = 32


@dataclass
class _Entry:
    ids: tuple[int, ...]
    kv: KV | None  # None: on disk only
    path: Path | None
    nbytes: int


def _fingerprint(model: Any) -> tuple[Any, ...]:
    """Which parameter tensors the model holds and how often each was edited in place (cheap: no data read)."""
    return tuple((name, id(p), p.data_ptr(), p._version) for name, p in model.named_parameters())


class PrefixStore:
    """KV caches of conversation prefixes, reused by :func:`~mechprobe.lm.generation.generate` (``prefix_store=``).

    Args:
        lm: the :class:`~mechprobe.lm.models.LoadedModel` whose caches are stored; its ``weight_hash``, dtype and
            device type key the entries, and the store refuses the model once its weights change in memory.
        max_bytes: bytes of keys and values kept in memory (default 2 GiB); the least recently used entries
            beyond it go to disk.
        disk_dir: where entries beyond ``max_bytes`` go (a subfolder per model identity; entries found there
            are reused by a later process); None (default) = a temporary directory removed by :meth:`close`.
        max_tail: a prompt whose tokens after its longest stored prefix are more than this many (default 32)
            has its prefix up to the boundary computed and stored first; shorter rests (the end of an answer
            and the user-role header) are prefilled with the boundary.
        progress: show a progress bar while :meth:`build` computes prefixes (default True).

    Attributes:
        identity: hash of weight hash, dtype, device type and model class: what an entry is valid for.

    Example:
        >>> import torch
        >>> from mechprobe import LoadedModel, generate, tiny_model
        >>> from mechprobe.lm.prefix import PrefixStore
        >>> lm = LoadedModel(model=tiny_model("llama"), tokenizer=None, name="tiny", weight_hash="0" * 64,
        ...                  device=torch.device("cpu"), dtype=torch.float32)
        >>> prompts = [[1, 5, 9, 2, 7], [3, 4, 8]]
        >>> store = PrefixStore(lm, progress=False)
        >>> store.build(prompts)                       # the prefixes up to (not including) the boundary
        2
        >>> arm = generate(lm.model, prompts, stop_ids={}, max_new_tokens=4, prefix_store=store)
        >>> plain = generate(lm.model, prompts, stop_ids={}, max_new_tokens=4)
        >>> [g.token_ids for g in arm] == [g.token_ids for g in plain]
        True
        >>> store.close()
    """

    def __init__(self, lm: LoadedModel, *, max_bytes: int = DEFAULT_MAX_BYTES, disk_dir: str | Path | None = None,
                 max_tail: int = DEFAULT_MAX_TAIL, progress: bool = True) -> None:
        if not isinstance(lm, LoadedModel) or lm.model is None:
            raise UsageError("PrefixStore needs a LoadedModel with its HF model (load_model(...)), not an engine")
        if max_bytes < 0 or max_tail < 1:
            raise UsageError(f"PrefixStore: max_bytes must be >= 0 and max_tail >= 1, got {max_bytes}, {max_tail}")
        self.model = lm.model
        self.max_bytes = int(max_bytes)
        self.max_tail = int(max_tail)
        self.progress = progress
        p = next(lm.model.parameters())
        self.identity = hashlib.sha256(
            f"{lm.weight_hash}|{p.dtype}|{p.device.type}|{type(lm.model).__name__}".encode()).hexdigest()
        self._fingerprint = _fingerprint(lm.model)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._trie: list[Any] = [{}, None]  # node: [children by token id, key of one entry through this node]
        self._mem = 0
        self._tmp: Path | None = None
        self._dir: Path | None = Path(disk_dir) / self.identity[:16] if disk_dir is not None else None
        self._cleanup: Any = None
        if self._dir is not None and self._dir.is_dir():
            for f in sorted(self._dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    ids = tuple(int(t) for t in fh.get_tensor("ids").tolist())
                self._index(f.stem, _Entry(ids=ids, kv=None, path=f, nbytes=0))

    # -- what generate asks -------------------------------------------------------------------------------
    def check(self, model: Any) -> None:
        """Refuse a model other than the store's, or the store's model with weights changed since it was made."""
        model = model.model if isinstance(model, LoadedModel) else model
        if model is not self.model:
            raise UsageError("this PrefixStore holds another model's KV caches: make a PrefixStore for this model")
        if _fingerprint(model) != self._fingerprint:
            raise UsageError("the model's weights changed since this PrefixStore was made (training, bake, "
                             "load_state_dict): its prefixes were computed with the old weights; make a new PrefixStore")

    def lookup(self, ids: Sequence[int], limit: int) -> tuple[int, KV | None]:
        """The longest stored prefix of ``ids``, at most ``limit`` tokens: ``(n_tokens, kv)`` (``(0, None)``: none).

        The entry may be longer than ``ids`` or differ after the common prefix (an answer tokenised otherwise
        when the template renders it): only the common positions are returned.
        """
        node, depth = self._trie, 0
        for t in ids[:max(limit, 0)]:
            nxt = node[0].get(int(t))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        if depth == 0:
            return 0, None
        key = node[1]
        kv = self._load(key)
        return depth, [(k[:, :depth], v[:, :depth]) for k, v in kv]

    def covered(self, ids: Sequence[int], limit: int) -> int:
        """How many leading tokens of ``ids`` (at most ``limit``) a stored prefix covers, without loading it: what
        a caller sizing a batch needs (the prefill then computes only the rest)."""
        node, depth = self._trie, 0
        for t in ids[:max(limit, 0)]:
            nxt = node[0].get(int(t))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        return depth

    def add(self, ids: Sequence[int], kv: KV) -> None:
        """Store ``kv`` (one row, every layer, ``len(ids)`` positions) as the prefix ``ids``."""
        ids = tuple(int(t) for t in ids)
        if not ids:
            return
        if any(k.shape[1] != len(ids) for k, _ in kv):
            raise ValueError(f"kv covers {kv[0][0].shape[1]} positions, ids {len(ids)}")
        key = hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        kv = [(k.detach().to("cpu").contiguous(), v.detach().to("cpu").contiguous()) for k, v in kv]
        entry = _Entry(ids=ids, kv=kv, path=None, nbytes=kv_nbytes(kv))
        self._index(key, entry)
        self._mem += entry.nbytes
        self._spill()

    # -- building and housekeeping ------------------------------------------------------------------------
    def build(self, prompts: Sequence[Sequence[int] | ProbePrompt], *, batch_size: int | None = None,
              pad_id: int = 0) -> int:
        """Compute and store the prefix up to (not including) the boundary of every prompt not yet covered.

        Args:
            prompts: the probe prompts (token ids or :class:`~mechprobe.lm.chat.ProbePrompt`), each ending at
                the user-role boundary.
            batch_size: prompts per forward call; None (default) = as many as fit half the free memory.
            pad_id: left-padding id (masked out; default 0).

        Returns:
            How many prefixes were computed (prompts already covered are skipped).
        """
        ids = [list(p.input_ids) if isinstance(p, ProbePrompt) else [int(t) for t in p] for p in prompts]
        todo = [p for p in dict.fromkeys(tuple(p) for p in ids) if self.lookup(p, len(p) - 1)[0] < len(p) - 1]
        if not todo:
            return 0
        self.check(self.model)
        rows = batch_size or auto_batch_size(self.model, max(len(p) for p in todo), 0)
        bar = tqdm(total=len(todo), desc="conversation prefixes", unit="prefix", disable=not self.progress)
        for batch in batches_by_length([len(p) for p in todo], rows):
            fill_prefixes(self.model, self, [list(todo[i]) for i in batch], pad_id=pad_id)
            bar.update(len(batch))
        bar.close()
        return len(todo)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values now held in memory (entries on disk not counted)."""
        return self._mem

    def clear(self) -> None:
        """Forget every entry (files in an explicit ``disk_dir`` stay for later processes)."""
        self._entries.clear()
        self._trie = [{}, None]
        self._mem = 0
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self) -> None:
        """Forget every entry and remove the temporary spill directory, if one was made."""
        self.clear()

    # -- internals ----------------------------------------------------------------------------------------
    def _index(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        node = self._trie
        for t in entry.ids:
            nxt = node[0].get(t)
            if nxt is None:
                nxt = [{}, key]
                node[0][t] = nxt
            node = nxt

    def _load(self, key: str) -> KV:
        entry = self._entries[key]
        self._entries.move_to_end(key)
        if entry.kv is not None:
            return entry.kv
        assert entry.path is not None
        t = load_file(str(entry.path))
        return [(t[f"k{i}"], t[f"v{i}"]) for i in range(sum(k.startswith("k") for k in t))]

    def _spill_dir(self) -> Path:
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            return self._dir
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="mechprobe-prefix-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        return self._tmp

    def _spill(self) -> None:
        for key, entry in list(self._entries.items()):  # least recently used first
            if self._mem <= self.max_bytes:
                return
            if entry.kv is None:
                continue
            if entry.path is None:
                path = self._spill_dir() / f"{key}.safetensors"
                tensors = {"ids": torch.tensor(entry.ids, dtype=torch.int64)}
                for i, (k, v) in enumerate(entry.kv):
                    tensors[f"k{i}"], tensors[f"v{i}"] = k, v
                save_file(tensors, str(path), metadata={"identity": self.identity})
                entry.path = path
            entry.kv = None
            self._mem -= entry.nbytes
