"""The study's ledger: which step is done, what it cost, which files it wrote (with their sha256).

Why: the study spans sessions. A step's outputs are committed as soon as it finishes, and the next session
reads ``ledger.json`` to know what is left. The ledger also pins the plan: the first step records the plan's
sha256, and every later step refuses a plan whose hash differs (a changed plan is a new plan file).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UserError
from mechprobe.io import read_json, sha256_file, write_json

__all__ = ["Ledger", "StepRecord", "cpu_name"]

LEDGER = "ledger.json"


def cpu_name() -> str:
    """The CPU model and its bf16 support, as every absolute time in the study names it."""
    name = platform.processor() or platform.machine()
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags.split()]
    return f"{name}, {os.cpu_count()} cores" + (f", {'/'.join(bf16)}" if bf16 else ", no native bf16")


@dataclass
class StepRecord:
    """One finished step: wall seconds, CPU, when, and the sha256 of each output file (relative paths)."""

    name: str
    seconds: float
    cpu: str
    finished: str
    outputs: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class Ledger:
    """``ROOT/ledger.json``: the plan's hash and one :class:`StepRecord` per finished step.

    Example:
        >>> led = Ledger.open("reports/interventions", plan)  # doctest: +SKIP
        >>> led.done("answers")  # doctest: +SKIP
        True
    """

    def __init__(self, root: Path, plan_sha256: str, steps: dict[str, StepRecord]) -> None:
        self.root = root
        self.plan_sha256 = plan_sha256
        self.steps = steps

    @classmethod
    def open(cls, root: str | Path, plan: Any) -> Ledger:
        """The ledger of ``root``, created for ``plan`` when absent; refused when it pins another plan."""
        root = Path(root)
        p = root / LEDGER
        if not p.exists():
            return cls(root, plan.sha256, {})
        d = read_json(p)
        if d.get("plan_sha256") != plan.sha256:
            raise UserError(f"{p} pins plan sha256 {str(d.get('plan_sha256'))[:12]}… but {plan.path} hashes to "
                            f"{plan.sha256[:12]}…: the plan changed after the study started. Restore the committed "
                            f"plan, or write a new plan file (with a reason) and give it its own output folder")
        steps = {k: StepRecord(**v) for k, v in d.get("steps", {}).items()}
        return cls(root, d["plan_sha256"], steps)

    def done(self, step: str) -> bool:
        return step in self.steps

    def record(self, step: str, seconds: float, outputs: list[Path], info: dict[str, Any] | None = None) -> StepRecord:
        """Mark ``step`` done with the sha256 of each output file, and write the ledger at once."""
        rec = StepRecord(step, round(seconds, 1), cpu_name(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         {str(o.relative_to(self.root)): sha256_file(o) for o in outputs if o.is_file()},
                         info or {})
        self.steps[step] = rec
        self.save()
        return rec

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json(self.root / LEDGER, {"plan_sha256": self.plan_sha256,
                                        "steps": {k: vars(v) for k, v in self.steps.items()}})

    def verify(self) -> list[str]:
        """Output files whose bytes no longer match the hash recorded when their step finished."""
        bad = []
        for rec in self.steps.values():
            for rel, sha in rec.outputs.items():
                f = self.root / rel
                if not f.is_file() or sha256_file(f) != sha:
                    bad.append(rel)
        return bad
