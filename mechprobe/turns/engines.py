"""The generation engines of the probe: HF (exact, hookable), vLLM (GPU sampling), llama.cpp (CPU, GGUF weights),
picked by ``ProbeConfig.engine``, and how many rows each decodes per call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mechprobe.lm.generation import auto_batch_size, generate
from mechprobe.lm.llamacpp import load_engine
from mechprobe.lm.models import LoadedModel, load_model, load_tokenizer, weight_identity
from mechprobe.lm.prefix import PrefixStore
from mechprobe.lm.vllm import generate_vllm, load_vllm
from mechprobe.turns.config import ProbeConfig

__all__ = ["context_length", "decode_rows", "load_generator", "rows_per_call"]

log = logging.getLogger(__name__)


def context_length(lm: LoadedModel) -> int | None:
    """Positions the model was trained for (None when unknown, e.g. a vLLM engine without HF weights)."""
    n = getattr(getattr(lm.model, "config", None), "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    n = getattr(lm.tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else None


def load_generator(cfg: ProbeConfig) -> tuple[LoadedModel, Any]:
    """(model, engine) for ``cfg.engine``: engine None means the HF path generates with ``model``."""
    if cfg.engine == "vllm":
        return _load_vllm_engine(cfg)
    if cfg.engine == "llamacpp":
        return load_engine(cfg.model, chat_template=cfg.chat_template)
    return load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, chat_template=cfg.chat_template), None


def _load_vllm_engine(cfg: ProbeConfig) -> tuple[LoadedModel, Any]:
    """vLLM engine + tokenizer; the HF weights are not loaded (they would double GPU memory).

    The run's identity (name, weight hash, tokenizer with pad token, template) comes from the same
    functions :func:`~mechprobe.lm.models.load_model` uses, so ``mechprobe cache`` (HF engine) accepts the run.
    """
    tok = load_tokenizer(cfg.model, cfg.chat_template)
    engine = load_vllm(cfg.model)
    name, weight_hash = weight_identity(cfg.model)  # after vLLM fetched the weights into the HF cache
    lm = LoadedModel(model=None, tokenizer=tok, name=name, weight_hash=weight_hash,
                     device=torch.device("cuda"), dtype=torch.bfloat16)
    return lm, engine


def rows_per_call(cfg: ProbeConfig, engine: Any, lm: LoadedModel | None = None, prompt_len: int = 0,
          max_new: int = 0, prefill_len: int | None = None) -> int:
    """Rows per decode call: the engine's own size when it has one (llama.cpp decodes 32 rows together by
    default, where ``--batch-size 8`` would leave most of its speed-up unused), else ``--batch-size``, else
    (``auto``, the default) as many as fit in memory for the longest prompt (:func:`auto_batch_size`);
    ``prefill_len``: the longest part of a prompt not covered by a stored prefix (the prefill computes only it)."""
    n = getattr(engine, "max_rows", 0) or cfg.batch_size
    if n:
        return int(n)
    if lm is None or lm.model is None:
        return 8
    n = auto_batch_size(lm.model, prompt_len, max_new, prefill_len=prefill_len)
    log.info("batch_size=auto: %d rows per decode call (prompts up to %d tokens, %s prefilled, + %d new)", n,
             prompt_len, "all" if prefill_len is None else f"<= {prefill_len}", max_new)
    return n


def decode_rows(lm: LoadedModel, engine: Any, prompts: list[list[int]], *, kv_store: PrefixStore | None = None,
                  reuse: bool = False, **kw: Any) -> list[Any]:
    """Decode with the run's engine; on the HF path, ``kv_store`` receives the rows' KV caches (answers) or,
    with ``reuse``, supplies the prefixes the prompts continue from (user turns)."""
    if hasattr(engine, "decode_batch"):  # llamacpp_backend.LlamaCppEngine
        return engine.decode_batch(prompts, **kw)
    if engine is not None:
        kw.pop("pad_id", None)
        return generate_vllm(engine, prompts, **kw)
    if kv_store is not None:
        kw["prefix_store" if reuse else "keep_kv"] = kv_store
    return generate(lm.model, prompts, **kw)
