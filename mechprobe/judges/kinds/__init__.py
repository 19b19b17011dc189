"""Judge kinds, one module each; every module here is imported (and so registered) when this package loads.

A new judge is one module in this package: its class (or an import of it) and a builder decorated with
:func:`mechprobe.judges.registry.register_judge`, which names the spec's kind, whether it takes a model, the
constructor options it accepts and a few words of help. The factory (:func:`mechprobe.judges.factory.make_judge`),
the spec checks, ``--judge``'s help and the commands' option routing read the registry. Built in:
:mod:`.offline` (``offline``, ``offline-lexical``, ``offline-embed``), :mod:`.openai`, :mod:`.local`,
:mod:`.hybrid` (``hybrid``, ``hybrid-voice``), :mod:`.trained`.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
