"""Residual activations at the user-role boundary: capture them and keep them on disk.

:mod:`.backends` reads the residual stream with plain PyTorch hooks, nnsight or TransformerLens behind one
``Backend`` protocol (each checked against HF ``output_hidden_states``); :mod:`.cache` runs a backend over a run's
conversations and stores the boundary states as safetensors shards with a manifest (``ActivationCache``,
``cache_run``). Why a cache stage of its own: probes and steering read the same states many times, so they are
computed once per run and model and reused.
"""

from __future__ import annotations

from mechprobe.activations.backends import BACKENDS, CACHE_POSITIONS, make_backend
from mechprobe.activations.cache import ActivationCache, cache_run

__all__ = ["ActivationCache", "BACKENDS", "CACHE_POSITIONS", "cache_run", "make_backend"]
