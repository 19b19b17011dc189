"""What every judge consumes and promises: the judge input record and the Judge protocol.

Lives below every judge implementation so each can import it without importing the factory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import read_json, read_jsonl, shell_arg
from mechprobe.lm.device import cpu_has_native_bf16, default_device
from mechprobe.lm.models import load_model
from mechprobe.records import AssistantRecord, LabelRecord, UserTurnRecord


def load_judge_model(model: str, dtype: str | torch.dtype | None = None, device: str | None = None,
                     loaded: Any = None) -> Any:
    """The model a local judge scores with: ``loaded`` when given (shared with the caller), else ``model`` on the
    default device, in bf16 on a GPU or a CPU with native bf16 matmuls and fp32 on other CPUs. Why: a judge only
    prefills (compute-bound); with AVX512-BF16 a bf16 1.5B model prefilled 1.8x faster than fp32
    (docs/judge_agreement.md), at half the memory, but an AVX2-only CPU emulates bf16 ~100x slower than fp32."""
    if loaded is not None:
        return loaded
    dev = torch.device(device) if device else default_device()
    return load_model(model, device=dev, dtype=dtype or judge_dtype(dev))


def judge_dtype(device: torch.device) -> torch.dtype:
    """A local judge's default dtype on ``device``: bf16 on a GPU or a CPU with native bf16, else fp32."""
    return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32


USER_TURNS = "user_turns.jsonl"


RUN_MANIFEST = "manifest.json"


ASSISTANT = "assistant.jsonl"


@dataclass(frozen=True)
class JudgeInput:
    """What a judge sees about one user turn: the conversation and the raw generated text.

    ``raw_text`` keeps special tokens (an opened assistant header is evidence); ``text`` is the
    cleaned turn when the probe stage provided one. ``messages`` is any conversation *before*
    ``prompt``. Group fields (dataset, decoding, temperature) are only used by summaries.

    Args:
        record_id: the :class:`~mechprobe.records.UserTurnRecord` judged (copied into the verdict).
        prompt: the user query.
        response: the assistant's answer the user turn follows.
        raw_text: the generated user turn with special tokens.
        text: the cleaned user turn; None (default) when the probe stage gave none.
        messages: earlier conversation as ``(role, content)`` pairs; empty by default.
        stop_reason: how the user turn ended (``"end_of_turn"``, ``"eos"``, ``"max_tokens"``); None by default.
        dataset: dataset name, for summaries (default ``""``).
        decoding: ``"greedy"`` or ``"sample"``, for summaries (default ``""``).
        temperature: sampling temperature, for summaries (default 0.0).
        item_id: the source item, for summaries (default ``""``).
        subject: the model that wrote the turn (default ``""``: not said). A judge calibrated per subject model
            (the hidden-state judge's per-model thresholds) uses it; any other judge ignores it.

    Example:
        >>> from mechprobe import JudgeInput
        >>> inp = JudgeInput(record_id="demo-0|greedy|s0", prompt="What is 12 * 7?",
        ...                  response="12 * 7 = 84.", raw_text="Thanks!<|im_end|>")
        >>> [m["role"] for m in inp.conversation()]
        ['user', 'assistant']
    """

    record_id: str
    prompt: str
    response: str
    raw_text: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    stop_reason: str | None = None
    dataset: str = ""
    decoding: str = ""
    temperature: float = 0.0
    item_id: str = ""
    subject: str = ""

    def conversation(self) -> list[dict[str, str]]:
        """History + user query + assistant response as chat messages."""
        msgs = [{"role": r, "content": c} for r, c in self.messages]
        return msgs + [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.response}]


class Judge(Protocol):
    """Anything that turns :class:`JudgeInput` rows into :class:`LabelRecord` rows.

    A structural protocol (not runtime-checkable): any object with a ``name`` and a ``label_many``
    method can be passed to :func:`~mechprobe.judges.run.judge_run`. Built-in judges: :class:`OfflineJudge`,
    :class:`LLMJudge`, :class:`LocalJudge`, :class:`HybridJudge` (see :func:`make_judge`). A judge may also
    offer ``public_config()``, which :func:`judge_run` writes into the labels manifest.

    Attributes:
        name: the judge's identity, stored in every :class:`LabelRecord` it writes; one labels file holds
            one judge name.

    Example:
        >>> from mechprobe import JudgeInput, LabelRecord
        >>> class AlwaysNewQuery:
        ...     name = "always-new-query"
        ...     def label_many(self, inputs):
        ...         for inp in inputs:
        ...             yield LabelRecord(record_id=inp.record_id, label="new_query", genuine=False,
        ...                               rationale="baseline", judge=self.name)
        >>> inp = JudgeInput(record_id="r1", prompt="What is 12 * 7?", response="84.", raw_text="Thanks!")
        >>> [r.label for r in AlwaysNewQuery().label_many([inp])]
        ['new_query']
    """

    name: str

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        """Yield one record per input, in any order, as soon as each is known."""
        ...


class JudgeMismatch(UserError, RuntimeError):
    """A labels file already holds rows from a different judge."""


def _msgs(messages: Iterable[dict[str, str]] | None) -> tuple[tuple[str, str], ...]:
    return tuple((str(m.get("role", "")), str(m.get("content", ""))) for m in (messages or []))


def inputs_from_run(run_dir: str | Path) -> list[JudgeInput]:
    """Join a probe run's user turns with their assistant turns (by ``item_id``)."""
    run_dir = Path(run_dir)
    if not (run_dir / USER_TURNS).exists():
        raise MissingInput(
            f"{run_dir} has no {USER_TURNS}: run the probe stage first "
            f"(`mechprobe probe {shell_arg(run_dir)}`), or pass the directory that holds it")
    assistants = {r["item_id"]: AssistantRecord.from_dict(r) for r in read_jsonl(run_dir / ASSISTANT, key="item_id")}
    subject = run_model_name(run_dir)
    out: list[JudgeInput] = []
    missing: list[str] = []
    for row in read_jsonl(run_dir / USER_TURNS, key="record_id"):
        u = UserTurnRecord.from_dict(row)
        a = assistants.get(u.item_id)
        if a is None:
            missing.append(u.item_id)
            continue
        out.append(JudgeInput(record_id=u.record_id, prompt=a.prompt, response=a.response, raw_text=u.raw_text,
                              text=u.text, messages=_msgs(a.messages), stop_reason=u.stop_reason,
                              dataset=u.dataset, decoding=u.decoding, temperature=u.temperature,
                              item_id=u.item_id, subject=subject))
    if missing:
        raise UsageError(f"{run_dir / USER_TURNS} has user turns for items missing from {ASSISTANT} "
                         f"(e.g. {sorted(set(missing))[:3]}); the run is damaged: re-run the probe stage "
                         f"on {run_dir} to regenerate them")
    return out


def inputs_from_rows(rows: Iterable[dict[str, Any]]) -> list[JudgeInput]:
    """Inputs from self-contained rows (the model-written label fixture format: prompt, response, raw_text, ...)."""
    out = []
    for i, r in enumerate(rows):
        need = [k for k in ("record_id", "prompt", "response", "raw_text") if k not in r]
        if need:
            raise UsageError(f"row {i} lacks {need}: a self-contained label row needs record_id, prompt, "
                             "response and raw_text (the model-written label fixture format)")
        out.append(JudgeInput(record_id=str(r["record_id"]), prompt=r["prompt"], response=r["response"],
                              raw_text=r["raw_text"], text=r.get("text"), messages=_msgs(r.get("messages")),
                              stop_reason=r.get("stop_reason"), dataset=r.get("dataset", ""),
                              decoding=r.get("decoding", ""), temperature=float(r.get("temperature", 0.0)),
                              item_id=r.get("item_id", ""), subject=str(r.get("subject", ""))))
    return out



def run_model_name(run: str | Path) -> str:
    """The subject model named in ``run/manifest.json`` (``""`` when the run has no manifest yet): the model that
    wrote the run's turns, which a judge calibrated per subject model reads from :attr:`JudgeInput.subject`."""
    p = Path(run) / RUN_MANIFEST
    return str((read_json(p).get("config") or {}).get("model") or "") if p.is_file() else ""
