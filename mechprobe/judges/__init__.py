"""mechprobe.judges."""

from __future__ import annotations

from mechprobe.judges.base import Judge, JudgeInput
from mechprobe.judges.factory import best_judge, make_judge, resolve_judge_spec
from mechprobe.judges.run import judge_run

__all__ = ["Judge", "JudgeInput", "best_judge", "judge_run", "make_judge", "resolve_judge_spec"]
