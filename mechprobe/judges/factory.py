"""Judge specs to judge objects: the one place that knows every judge kind and the default-judge rule."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from mechprobe.errors import UsageError
from mechprobe.io import read_jsonl
from mechprobe.judges import kinds as _kinds  # noqa: F401  (imports, and so registers, every judge kind)
from mechprobe.judges.base import Judge, judge_dtype
from mechprobe.judges.kinds.hybrid import HYBRID_VOICE
from mechprobe.judges.registry import (
    AUTO,
    BEST_JUDGE,
    OFFLINE_JUDGE,
    JudgeSpec,
    judge_help,
    judge_kind,
    judge_kinds,
)
from mechprobe.lm.models import check_model_source
from mechprobe.lm.registry import DEFAULT_MODEL, EMBEDDED, ModelLoadError, embedded_gguf_path

SPEC_ALIASES = {"hybrid2": HYBRID_VOICE}
"""Other spec kinds accepted wherever a judge spec is (registered with the kind, :mod:`mechprobe.judges.kinds`):
``hybrid2:MODEL`` is ``hybrid-voice:MODEL``, so commands, scripts and recorded specs written with the older kind
keep working."""

__all__ = ["SPEC_ALIASES", "JudgeSpec", "best_judge", "canonical_spec", "check_judge_spec",
           "default_judge", "is_hybrid_spec", "judge_help", "judges_model", "labelled_by", "make_judge",
           "model_unavailable", "resolve_judge_spec", "shared_judge_model", "spec_of_judge_name"]


def canonical_spec(spec: str) -> str:
    """``spec`` with an alias kind replaced by its name (``hybrid2:M`` -> ``hybrid-voice:M``); others unchanged.

    Why: every check of a spec's kind goes through one name, so an alias cannot be accepted in one place and
    refused in another. A string that is not a valid spec is returned as it is.

    Example:
        >>> canonical_spec("hybrid2:qwen2.5-coder-1.5b-instruct"), canonical_spec("offline")
        ('hybrid-voice:qwen2.5-coder-1.5b-instruct', 'offline')
    """
    try:
        return str(JudgeSpec.parse(spec))
    except UsageError:
        return spec


def is_hybrid_spec(spec: str) -> bool:
    """Whether ``spec`` builds a :class:`HybridJudge` (``hybrid:``, ``hybrid-voice:`` or its alias ``hybrid2:``)."""
    return _kind_or_none(spec) in ("hybrid", HYBRID_VOICE)


def _kind_or_none(spec: str | None) -> str | None:
    try:
        return JudgeSpec.parse(spec or "").kind
    except UsageError:
        return None


def best_judge() -> str:
    """The best-validated judge this machine can run (:data:`~mechprobe.judges.registry.BEST_JUDGE`, the
    hidden-state judge read by the 0.5B Qwen) when its model is fetched, else the offline rules (reports name
    whichever labelled them).

    Why a function, not a constant: a fresh machine without the reader's weights must still run every entry point."""
    why = model_unavailable(BEST_JUDGE.split(":", 1)[1])
    if why:
        print(f"judge: {OFFLINE_JUDGE} ({BEST_JUDGE} needs the model: {why})", file=sys.stderr)
        return OFFLINE_JUDGE
    return BEST_JUDGE


def model_unavailable(model: str) -> str | None:
    """Why ``model`` cannot run here (weights not fetched), or None. Only embedded names are checked:
    a HF id or path fails at load time with its own message."""

    if model not in EMBEDDED:
        return None
    try:
        embedded_gguf_path(model)
    except ModelLoadError as e:
        return str(e)
    return None


def spec_of_judge_name(name: str) -> str | None:
    """The ``--judge`` spec that reproduces a judge recorded in ``labels.jsonl`` by its name, or None (each kind
    says how its names read, :class:`~mechprobe.judges.registry.JudgeKind`)."""
    for kind in judge_kinds():
        again = judge_kind(kind).spec_of_name
        spec = again(name) if again is not None else None
        if spec:
            return spec
    return None


def default_judge(model: str | None = None, labelled_by: str | None = None) -> str:
    """What ``--judge auto`` (every command's default) means: the one rule, in order.

    1. ``openai:$MECHPROBE_JUDGE_MODEL`` when that variable is set;
    2. the judge that already labelled the run (``labelled_by``, a judge name from ``labels.jsonl``), when it
       can be named again, so resuming a run never mixes judges;
    3. ``offline`` for the embedded default model and local checkpoints (the main job's fast path);
    4. otherwise the best-validated judge this machine can run (:func:`best_judge`).

    Args:
        model: the subject model of the run (None: several models, e.g. the study).
        labelled_by: the judge name recorded in an existing ``labels.jsonl``.

    Returns:
        A judge spec for :func:`make_judge`.
    """

    env = os.environ.get("MECHPROBE_JUDGE_MODEL")
    if env:
        return f"openai:{env}"
    again = spec_of_judge_name(labelled_by or "")
    if again:
        return again
    if model is not None and (model == DEFAULT_MODEL or Path(model).exists() or str(model).endswith(".gguf")):
        return OFFLINE_JUDGE
    return best_judge()


def judges_model(spec: str | None) -> str | None:
    """The model a model-based judge spec loads (``hybrid-voice:M`` -> ``M``), else None (offline, openai, auto).

    Example:
        >>> judges_model("hybrid-voice:qwen2.5-coder-1.5b-instruct"), judges_model("offline")
        ('qwen2.5-coder-1.5b-instruct', None)
    """
    try:
        parsed = JudgeSpec.parse(spec or "")
    except UsageError:
        return None
    return parsed.model if parsed.judge_kind.loads_model else None


def shared_judge_model(spec: str | None, lm: Any) -> Any:
    """``lm`` when the judge ``spec`` would load exactly that model (same weights, the judge's default dtype on that
    device), else None: pass it as ``loaded=`` so a process holds one copy of the weights per dtype.

    Why: a steering or probe command already holds the subject model; a model-based judge of the same model
    (``hybrid-voice:qwen2.5-coder-1.5b-instruct`` on a 1.5B run) would otherwise load a second copy of the same
    weights (another 3-6 GB and a load) to compute the same forwards.

    Args:
        spec: a judge spec (``auto`` and None resolve to no sharing: the judge is not known yet).
        lm: the :class:`~mechprobe.lm.models.LoadedModel` the caller holds, or None.
    Returns:
        ``lm`` or None.
    Example:
        >>> shared_judge_model("offline", None) is None
        True
    """
    if lm is None or not spec or spec == AUTO:
        return None
    model = judges_model(spec)
    if model is None:
        return None
    same_model = model == lm.name or (Path(model).expanduser().resolve() == Path(str(lm.name)).expanduser().resolve()
                                      if Path(model).exists() else False)
    return lm if same_model and lm.dtype == judge_dtype(torch.device(lm.device)) else None


def labelled_by(run: str | Path, labels_file: str = "labels.jsonl") -> str | None:
    """The judge name recorded in ``run/labels_file`` (its first row), or None when the run has no labels."""
    p = Path(run) / labels_file
    rows = read_jsonl(p) if p.exists() else []
    return str(rows[0].get("judge", "")) if rows else None


def resolve_judge_spec(spec: str | JudgeSpec | None, model: str | None = None, labelled: str | None = None) -> str:
    """The concrete, canonical spec ``spec`` stands for: the one place ``auto`` and None are resolved.

    ``auto`` and None mean the same: the default-judge rule (:func:`default_judge`) given what is known, the run's
    subject ``model`` and the judge that already ``labelled`` it; any other spec is parsed and returned canonical
    (``hybrid2:M`` -> ``hybrid-voice:M``).

    Args:
        spec: a judge spec, ``"auto"`` or None.
        model: the subject model of the run (None: not known, e.g. a study over several models).
        labelled: the judge name recorded in the run's ``labels.jsonl``.

    Returns:
        A spec :func:`make_judge` builds.

    Raises:
        UsageError: an unknown kind or a malformed spec.

    Example:
        >>> resolve_judge_spec("hybrid2:qwen2.5-coder-1.5b-instruct")
        'hybrid-voice:qwen2.5-coder-1.5b-instruct'
    """
    if spec is None or spec == AUTO:
        return default_judge(model, labelled)
    return str(JudgeSpec.parse(spec))


def make_judge(spec: str | JudgeSpec | None = OFFLINE_JUDGE, **opts: Any) -> Judge:
    """Build the judge a spec names, through the judge registry (:mod:`mechprobe.judges.kinds`).

    ``opts`` go to the judge's constructor (``base_url``, ``api_key``, ``concurrency``, ``timeout``,
    ``max_retries``, ``cache_dir`` for the LLM judge; ``embed`` for the offline one...). Options the kind does not
    take, and ``None`` values, are dropped, so a command passes all its judge options whatever the judge.

    Args:
        spec: one of the registered forms: ``"offline"`` (default; rules, embedding variant when installed),
            ``"offline-lexical"``, ``"offline-embed"``, ``"hybrid:MODEL"``, ``"hybrid-voice:MODEL"`` (alias
            ``"hybrid2:MODEL"``), ``"trained:MODEL"``, ``"local:MODEL"``, ``"openai:MODEL"``; or a parsed
            :class:`~mechprobe.judges.registry.JudgeSpec`. ``"auto"`` and None: the default-judge rule
            (:func:`resolve_judge_spec`; with no run known, ``openai:$MECHPROBE_JUDGE_MODEL`` when set, else
            :func:`best_judge`).
        **opts: constructor options; options the chosen judge does not take, and None values, are dropped.

    Returns:
        A :class:`~mechprobe.judges.base.Judge`.

    Raises:
        UsageError: an unknown spec or a spec without its model name.

    Example:
        >>> from mechprobe import make_judge
        >>> judge = make_judge("offline-lexical", cache_dir=None, concurrency=4)   # unused options ignored
        >>> type(judge).__name__, judge.name
        ('OfflineJudge', 'offline-v3+lexical')
        >>> make_judge("openai:gpt-4o-mini")        # needs OPENAI_API_KEY or base_url=  # doctest: +SKIP
    """
    parsed = JudgeSpec.parse(resolve_judge_spec(spec))
    kind = parsed.judge_kind
    return kind.build(parsed, **{k: v for k, v in opts.items() if v is not None and k in kind.options})


def check_judge_spec(spec: str | None, field: str = "judge") -> str:
    """Parse a judge spec without building the judge (nothing is loaded): the canonical spec, or a
    :class:`UsageError` naming ``field``. The model of a kind that loads one (``local:``, ``hybrid:``,
    ``hybrid-voice:``, ``trained:``) must be a known model source (:func:`mechprobe.lm.models.check_model_source`).
    Lets a long command refuse a typo before its first model loads. ``auto`` (or None) passes: it is resolved to a
    concrete judge later, from the run."""
    if spec in (None, AUTO):
        return AUTO
    parsed = JudgeSpec.parse(spec, field)
    if parsed.judge_kind.loads_model and parsed.model:
        check_model_source(parsed.model, field)
    return spec
