"""Steering-vector kinds, one module each; every module here is imported (and so registered) when this package loads.

A new way to build a steering vector is one module in this package with a function decorated by
:func:`mechprobe.steering.kind_registry.register_vector_kind`, taking a
:class:`~mechprobe.steering.kind_registry.VectorContext` and returning a raw
:class:`~mechprobe.steering.steering_vector.SteeringVector` of that kind at ``ctx.layer``; the experiment, the
``kinds`` setting and the CLI pick it up from the registry. Built in: :mod:`.diff_means` (the difference of
means), :mod:`.random` (a random direction of equal norm), :mod:`.negative` (``-v``), :mod:`.probe` (the
logistic probe's direction fitted on train rows).
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
