"""Judge specs to judge objects: the one place that knows every judge kind and the default-judge rule."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from mechprobe.errors import UsageError
from mechprobe.judges.base import Judge, judge_dtype
from mechprobe.judges.hybrid import DEFAULT_VOICE, HybridJudge
from mechprobe.judges.llm import LLMJudge
from mechprobe.judges.local import LocalJudge
from mechprobe.judges.offline import OfflineJudge
from mechprobe.judges.trained import TrainedJudge
from mechprobe.lm.models import (
    DEFAULT_MODEL,
    EMBEDDED,
    ModelLoadError,
    check_model_source,
    embedded_gguf_path,
)

HYBRID_VOICE = "hybrid-voice"
"""Spec kind of the hybrid judge with the voice check (``hybrid-voice:MODEL``); plain ``hybrid:`` has none."""
SPEC_ALIASES = {"hybrid2": HYBRID_VOICE}
"""Other spec kinds accepted wherever a judge spec is: ``hybrid2:MODEL`` is ``hybrid-voice:MODEL``, so commands,
scripts and recorded specs written with the older kind keep working."""
MODEL_JUDGE_KINDS = ("local", "hybrid", HYBRID_VOICE, "trained")
"""Spec kinds whose judge loads a language model (the part after ``:`` names it)."""

BEST_JUDGE = f"{HYBRID_VOICE}:qwen2.5-coder-1.5b-instruct"


def canonical_spec(spec: str) -> str:
    """``spec`` with an alias kind replaced by its name (``hybrid2:M`` -> ``hybrid-voice:M``); others unchanged.

    Why: every check of a spec's kind goes through one name, so an alias cannot be accepted in one place and
    refused in another.

    Example:
        >>> canonical_spec("hybrid2:qwen2.5-coder-1.5b-instruct"), canonical_spec("offline")
        ('hybrid-voice:qwen2.5-coder-1.5b-instruct', 'offline')
    """
    kind, sep, rest = spec.partition(":")
    return f"{SPEC_ALIASES[kind]}:{rest}" if sep and kind in SPEC_ALIASES else spec


def is_hybrid_spec(spec: str) -> bool:
    """Whether ``spec`` builds a :class:`HybridJudge` (``hybrid:``, ``hybrid-voice:`` or its alias ``hybrid2:``)."""
    return canonical_spec(spec).startswith(("hybrid:", f"{HYBRID_VOICE}:"))


def best_judge() -> str:
    """The best-validated judge this machine can run (docs/judge_agreement.md): the hybrid judge with the voice check
    on the 1.5B model when that model is fetched, else the offline rules (reports name whichever labelled them).

    Why a function, not a constant: a fresh machine without the 1.5B weights must still run every entry point."""
    why = model_unavailable(BEST_JUDGE.split(":", 1)[1])
    if why:
        print(f"judge: offline ({BEST_JUDGE} needs the model: {why})", file=sys.stderr)
        return "offline"
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
    """The ``--judge`` spec that reproduces a judge recorded in ``labels.jsonl`` by its name, or None."""
    if name.startswith("offline"):
        return "offline-lexical" if "lexical" in name else "offline"
    if name.startswith("trained:") and "@" in name:
        return "trained:" + name.split(":", 1)[1].split("@", 1)[0]
    if name.startswith("hybrid:") and "@" in name:
        judge_model = name.split(":", 1)[1].split("@", 1)[0]
        return f"{HYBRID_VOICE if '+voice' in name else 'hybrid'}:{judge_model}"
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
        return "offline"
    return best_judge()


def judges_model(spec: str | None) -> str | None:
    """The model a model-based judge spec loads (``hybrid-voice:M`` -> ``M``), else None (offline, openai, auto).

    Example:
        >>> judges_model("hybrid-voice:qwen2.5-coder-1.5b-instruct"), judges_model("offline")
        ('qwen2.5-coder-1.5b-instruct', None)
    """
    kind, sep, model = canonical_spec(spec or "").partition(":")
    return model if sep and kind in MODEL_JUDGE_KINDS and model else None


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
    if lm is None or not spec or spec == "auto":
        return None
    model = judges_model(spec)
    if model is None:
        return None
    same_model = model == lm.name or (Path(model).expanduser().resolve() == Path(str(lm.name)).expanduser().resolve()
                                      if Path(model).exists() else False)
    return lm if same_model and lm.dtype == judge_dtype(torch.device(lm.device)) else None


def resolve_judge_spec(spec: str | None) -> str:
    """``None`` means: ``openai:$MECHPROBE_JUDGE_MODEL`` when that is set, else ``offline``."""
    if spec:
        return spec
    model = os.environ.get("MECHPROBE_JUDGE_MODEL")
    return f"openai:{model}" if model else "offline"


def make_judge(spec: str | None = "offline", **opts: Any) -> Judge:
    """Build a judge from ``offline``, ``offline-lexical`` (no embedding model), ``openai:MODEL`` or ``local:MODEL``.

    ``opts`` go to the judge's constructor (``base_url``, ``api_key``, ``concurrency``, ``timeout``,
    ``max_retries``, ``cache_dir`` for the LLM judge; ``embed`` for the offline one). Unused ``None``
    options are ignored, so CLI arguments can be passed through unconditionally.

    Args:
        spec: ``"offline"`` (default; rules, embedding variant when installed), ``"offline-lexical"``,
            ``"offline-embed"``, ``"openai:MODEL"`` (:class:`LLMJudge`), ``"local:MODEL"``
            (:class:`LocalJudge`), ``"hybrid:MODEL"`` or ``"hybrid-voice:MODEL"`` (:class:`HybridJudge`, the
            latter with the voice check; ``"hybrid2:MODEL"`` is accepted for it). None = ``openai:$MECHPROBE_JUDGE_MODEL`` when set, else ``offline``.
        **opts: constructor options; options the chosen judge does not take, and None values, are dropped.

    Returns:
        A :class:`~mechprobe.judges.base.Judge` (one of the four judge classes).

    Raises:
        UsageError: an unknown spec or a spec without its model name.

    Example:
        >>> from mechprobe import make_judge
        >>> judge = make_judge("offline-lexical", cache_dir=None, concurrency=4)   # unused options ignored
        >>> type(judge).__name__, judge.name
        ('OfflineJudge', 'offline-v3+lexical')
        >>> make_judge("openai:gpt-4o-mini")        # needs OPENAI_API_KEY or base_url=  # doctest: +SKIP
    """
    spec = canonical_spec(resolve_judge_spec(spec))
    opts = {k: v for k, v in opts.items() if v is not None}
    if spec in ("offline", "offline-lexical", "offline-embed"):
        allowed = {"embed", "batch_size"}
        if spec == "offline-lexical":
            opts["embed"] = False
        elif spec == "offline-embed":
            opts["embed"] = True
        return OfflineJudge(**{k: v for k, v in opts.items() if k in allowed})
    if spec.startswith("openai:"):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge openai:MODEL needs a model name, e.g. openai:gpt-4o-mini")

        allowed = {"base_url", "api_key", "concurrency", "timeout", "max_retries", "cache_dir",
                   "backoff", "max_backoff", "structured", "max_tokens"}
        return LLMJudge(model, **{k: v for k, v in opts.items() if k in allowed})
    if spec.startswith("local:"):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge local:MODEL needs a model: an embedded name (e.g. "
                             "local:qwen2.5-coder-1.5b-instruct), a HF model directory or a .gguf file")

        allowed = {"dtype", "device", "few_shot", "bias", "cache_dir", "loaded"}
        return LocalJudge(model, **{k: v for k, v in opts.items() if k in allowed})
    if is_hybrid_spec(spec):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge hybrid:MODEL needs a model: an embedded name (e.g. "
                             "hybrid:qwen2.5-coder-1.5b-instruct), a HF model directory or a .gguf file")

        allowed = {"dtype", "device", "threshold", "veto", "cache_dir", "loaded", "embed", "voice"}
        kw = {k: v for k, v in opts.items() if k in allowed}
        if spec.startswith(f"{HYBRID_VOICE}:"):  # + the voice check at the margin chosen on the dev splits

            kw.setdefault("voice", DEFAULT_VOICE)
        return HybridJudge(model, **kw)
    if spec.startswith("trained:"):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge trained:MODEL needs the scoring model its weights were fit with, e.g. "
                             "trained:qwen2.5-coder-0.5b-instruct")
        allowed = {"dtype", "device", "cache_dir", "loaded", "embed", "weights"}
        return TrainedJudge(model, **{k: v for k, v in opts.items() if k in allowed})
    raise UsageError(f"unknown judge {spec!r}: use 'offline', 'offline-lexical', 'openai:MODEL', 'local:MODEL', "
                     "'hybrid:MODEL', 'hybrid-voice:MODEL' or 'trained:MODEL'")


def check_judge_spec(spec: str | None, flag: str = "--judge") -> str:
    """Parse a judge spec without building the judge (nothing is loaded): the resolved spec, or a
    :class:`UsageError`. The model of ``local:``/``hybrid:``/``hybrid-voice:`` (alias ``hybrid2:``) must be a known model source
    (:func:`mechprobe.lm.models.check_model_source`). Lets a long command refuse a typo before its first model loads.
    ``auto`` (or None) passes: it is resolved to a concrete judge later, from the run."""
    if spec in (None, "auto"):
        return "auto"
    if spec in ("offline", "offline-lexical", "offline-embed"):
        return spec
    kind, sep, model = spec.partition(":")
    if canonical_spec(spec).partition(":")[0] not in ("openai", *MODEL_JUDGE_KINDS) or not sep:
        raise UsageError(f"unknown judge {spec!r} ({flag}): use 'offline', 'offline-lexical', 'openai:MODEL', "
                         "'local:MODEL', 'hybrid:MODEL', 'hybrid-voice:MODEL' or 'trained:MODEL'")
    if not model:
        raise UsageError(f"{flag} {kind}:MODEL needs a model name, e.g. {kind}:qwen2.5-coder-1.5b-instruct")
    if kind != "openai":
        check_model_source(model, f"{flag} {kind}:")
    return spec
