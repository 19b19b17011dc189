"""Language models: loading, chat templates, generation and serving.

:mod:`.models` (the embedded GGUF models, loading, dtype and threads) · :mod:`.chat` (chat templates and the
user-role header the probe appends) · :mod:`.generation` (batched decoding with stop tokens) · :mod:`.prefix`
(a store of conversation prefixes' KV caches that ``generate`` continues from) · :mod:`.kv` (cutting and
reassembling KV-cache rows) · :mod:`.choice` (constrained choice over shared KV prefixes) · :mod:`.llamacpp`
and :mod:`.vllm` (other engines) · :mod:`.server` (an OpenAI-compatible endpoint on loopback). The lowest
model layer: nothing here knows about judges, runs or steering.
"""

from __future__ import annotations

from mechprobe.lm.forward import get_blocks
from mechprobe.lm.generation import generate
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.lm.prefix import PrefixStore

__all__ = ["LoadedModel", "PrefixStore", "generate", "get_blocks", "load_model"]
