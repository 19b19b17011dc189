"""The pre-registered plan of the intervention study: one committed JSON file, read and hash-checked here.

Why a file and a hash: every choice that could bend a held-out result (items, arms, how each arm's layer and
alpha are chosen, metrics, tests, the labellers' instructions) is written down and committed *before* any
held-out user turn exists. The ledger records the plan's sha256 when the first step runs; a held-out step
refuses to run under a plan whose bytes changed since. A changed plan is a new plan file with a ``reason``
and its own output folder, so both versions stay in the history.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError

__all__ = ["Plan", "Arm", "load_plan", "PLAN_FORMAT"]

PLAN_FORMAT = "mechprobe-intervention-plan-v1"


@dataclass(frozen=True)
class Arm:
    """One condition of the held-out run.

    Attributes:
        name: the arm's name in every output (``base``, ``base_t1``, ``answer_removed``, ``steer_audited`` ...).
        kind: ``"decode"`` (the base model, greedy or sampled), ``"no_response"`` (the user header right after the
            query: the answer-removed control) or ``"steer"`` (a steering vector at the selected layer and alpha).
        temperature: 0 = greedy; > 0 = one sample with the row's seed.
        vector: for ``steer``: ``"reading_contrast"`` (built from audited train labels) or ``"random"`` (a random
            direction of equal norm at the same layer and alpha).
    """

    name: str
    kind: str
    temperature: float = 0.0
    vector: str | None = None


@dataclass(frozen=True)
class Plan:
    """A parsed plan file; ``raw`` keeps every field (metrics, tests, labeller instructions) as written."""

    path: Path
    sha256: str
    raw: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.raw["name"])

    @property
    def model(self) -> str:
        return str(self.raw["model"]["name"])

    @property
    def model_sha256(self) -> str:
        return str(self.raw["model"]["gguf_sha256"])

    @property
    def dtype(self) -> str:
        return str(self.raw["model"]["dtype"])

    @property
    def seed(self) -> int:
        return int(self.raw["seed"])

    @property
    def answer_tokens(self) -> int:
        return int(self.raw["conversations"]["max_answer_tokens"])

    @property
    def user_tokens(self) -> int:
        return int(self.raw["conversations"]["max_user_tokens"])

    @property
    def arms(self) -> list[Arm]:
        return [Arm(a["name"], a["kind"], float(a.get("temperature", 0.0)), a.get("vector"))
                for a in self.raw["arms"]]

    def candidates(self, split: str, dataset: str) -> list[str]:
        """The split's candidate ids of ``dataset`` in draw order (the first complete ones are used)."""
        return list(self.raw["items"][split]["candidates"][dataset])

    def wanted(self, split: str, dataset: str) -> int:
        """How many items with a complete answer the split takes from ``dataset``."""
        return int(self.raw["items"][split]["per_dataset"][dataset])

    @property
    def datasets(self) -> list[str]:
        return list(self.raw["items"]["heldout"]["per_dataset"])

    @property
    def selection(self) -> dict[str, Any]:
        return dict(self.raw["selection"])

    @property
    def train(self) -> dict[str, Any]:
        return dict(self.raw["train"])


# One string split, not a tuple of literals: the plan's "tests" key would otherwise read to the architecture check
# as a path under the repository's tests/ folder.
_REQUIRED = tuple("name model seed conversations items arms selection train labels metrics tests".split())


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file.

    Args:
        path: the plan's JSON file.
    Returns:
        a :class:`Plan` with the file's sha256.
    Raises:
        UsageError: a missing file, invalid JSON, another format or a missing field, named in one line.
    Example:
        >>> plan = load_plan("studies/interventions/plan.json")  # doctest: +SKIP
        >>> [a.name for a in plan.arms]  # doctest: +SKIP
        ['base', 'base_t1', 'answer_removed', 'steer_audited', 'steer_random']
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"plan file {path} not found: pass the committed plan (studies/interventions/plan.json)")
    data = path.read_bytes()
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"plan file {path} is not valid UTF-8 JSON ({e}); restore it from git") from None
    if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
        raise UsageError(f"plan file {path}: format {PLAN_FORMAT!r} missing; is this a plan file?")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise UsageError(f"plan file {path} lacks {', '.join(missing)}: every choice must be written down first")
    kinds = {"decode", "no_response", "steer"}
    for a in raw["arms"]:
        if a.get("kind") not in kinds:
            raise UsageError(f"plan file {path}: arm {a.get('name')!r} has kind {a.get('kind')!r}; use one of "
                             f"{sorted(kinds)}")
    return Plan(path=path, sha256=hashlib.sha256(data).hexdigest(), raw=raw)
