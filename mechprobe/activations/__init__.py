"""mechprobe.activations.cache."""

from __future__ import annotations

from mechprobe.activations.backends import BACKENDS, CACHE_POSITIONS, make_backend
from mechprobe.activations.cache import ActivationCache, cache_run

__all__ = ["ActivationCache", "BACKENDS", "CACHE_POSITIONS", "cache_run", "make_backend"]
