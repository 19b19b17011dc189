"""Judges: the label of every generated user turn (genuine follow-up, new query, restatement, ...).

:mod:`.base` (``JudgeInput``, the ``Judge`` protocol) · :mod:`.offline` (rules, no model) · :mod:`.llm` (an
OpenAI-compatible endpoint) · :mod:`.local` and :mod:`.hybrid` (the run's own model scores the labels) ·
:mod:`.trained` (a logistic judge over turn features) · :mod:`.registry` (``register_judge``, the parsed
``JudgeSpec``) and :mod:`.kinds` (one module per judge kind, registered on import) · :mod:`.factory` (``make_judge``
from a spec and the default-judge rule, ``auto`` resolved in ``resolve_judge_spec``) · :mod:`.run` (label a run, resumable) · :mod:`.agreement` (two label sources compared).
Why several: no judge is right on every model, so the audit (:mod:`mechprobe.audit`) measures and corrects them.
"""

from __future__ import annotations

from mechprobe.judges.base import Judge, JudgeInput
from mechprobe.judges.factory import best_judge, make_judge, resolve_judge_spec
from mechprobe.judges.registry import JudgeSpec, judge_kinds, register_judge
from mechprobe.judges.run import judge_run

__all__ = ["Judge", "JudgeInput", "JudgeSpec", "best_judge", "judge_kinds", "judge_run", "make_judge",
           "register_judge", "resolve_judge_spec"]
