"""mechprobe.lm."""

from __future__ import annotations

from mechprobe.lm.generation import generate
from mechprobe.lm.models import LoadedModel, get_blocks, load_model

__all__ = ["LoadedModel", "generate", "get_blocks", "load_model"]
