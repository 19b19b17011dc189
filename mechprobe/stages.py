"""Reuse-or-build for every stage, so any experiment script works from a fresh clone.

Each ``ensure_*`` looks at the run directory, keeps what is already there (resuming partial files),
and builds only what is missing. The model is loaded at most once and only when a stage needs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .models import LoadedModel, load_model
from .pipeline import ProbeConfig, run_probe


def default_dataset() -> str:
    """GSM8K when the shared data folder is reachable, else the bundled prompts (offline machines)."""
    try:
        from .datasets import find_data_dir

        return "gsm8k" if find_data_dir() is not None else "builtin"
    except (ImportError, FileNotFoundError):
        return "builtin"


# The main job's probe configuration: enough sampled turns for some positives at T=1.0, small enough
# to finish in minutes on a 2-core CPU with the embedded 135M model.
MAIN_JOB = dict(limit=60, temperatures=[0.0, 1.0], samples=4, max_assistant_tokens=192, max_user_tokens=48,
                batch_size=16)


@dataclass
class Stages:
    """The run directory and a lazily loaded model shared by the stages."""

    run_dir: Path
    cfg: ProbeConfig
    lm: LoadedModel | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def model(self) -> LoadedModel:
        if self.lm is None:
            self.lm = load_model(self.cfg.model, device=self.cfg.device, dtype=self.cfg.dtype,
                                 chat_template=self.cfg.chat_template)
        return self.lm

    def _timed(self, name: str, fn: Any) -> Any:
        t = time.time()
        out = fn()
        self.timings[name] = round(time.time() - t, 1)
        return out

    def probe(self) -> Path:
        """Generate (or finish generating) assistant and user turns."""
        return self._timed("probe", lambda: run_probe(self.cfg, self.run_dir, lm=self.model()))

    def labels(self, judge: str = "offline", **opts: Any) -> Any:
        from .judge import judge_run

        return self._timed("judge", lambda: judge_run(self.run_dir, judge=judge, **opts))

    def cache(self, backend: str = "hooks", positions: tuple[str, ...] = ("boundary",), **opts: Any) -> Path:
        from .activations import cache_run

        return self._timed("cache", lambda: cache_run(self.run_dir, model=self.model(), backend=backend,
                                                      positions=positions, **opts))

    def all(self, judge: str = "offline", backend: str = "hooks") -> Stages:
        self.probe()
        self.labels(judge)
        self.cache(backend)
        return self


def probe_config(model: str, dataset: str | None, **overrides: Any) -> ProbeConfig:
    """The main job's config for ``model``/``dataset`` with explicit overrides (None values ignored)."""
    kw = dict(MAIN_JOB)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ProbeConfig(model=model, dataset=dataset or default_dataset(), **kw)
