"""The pre-registered plan of the intervention study: one committed JSON file, read and hash-checked here.

Why a file and a hash: every choice that could bend a held-out result (items, arms, how each arm's layer and
alpha are chosen, metrics, tests, the labellers' instructions) is written down and committed *before* any
held-out user turn exists. The ledger records the plan's sha256 when the first step runs; a held-out step
refuses to run under a plan whose bytes changed since. A changed plan is a new plan file with a ``reason``
and its own output folder, so both versions stay in the history.

A plan may *extend* another (``extends``: the parent file, its name and its sha256): it keeps the parent's model,
items, conversations, train labels and codebook, runs none of the parent's steps, and adds arms of its own
(post-trained adapters, a post-training steering direction, activation patching, task accuracy). The parent's
bytes are pinned by the hash, so a parent that changes under its child is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError

__all__ = ["Plan", "Arm", "load_plan", "PLAN_FORMAT", "ARM_KINDS", "EXTENDED_ARM_KINDS"]

PLAN_FORMAT = "mechprobe-intervention-plan-v1"
ARM_KINDS = ("decode", "no_response", "steer")
# An extending plan's arms may also run a post-trained model (``adapter``) or patch one residual position of it
# into the base model (``patch``).
EXTENDED_ARM_KINDS = (*ARM_KINDS, "adapter", "patch")


@dataclass(frozen=True)
class Arm:
    """One condition of the held-out run.

    Attributes:
        name: the arm's name in every output (``base``, ``base_t1``, ``answer_removed``, ``steer_audited`` ...).
        kind: ``"decode"`` (the base model, greedy or sampled), ``"no_response"`` (the user header right after the
            query: the answer-removed control) or ``"steer"`` (a steering vector at the selected layer and alpha).
        temperature: 0 = greedy; > 0 = one sample with the row's seed.
        vector: for ``steer``: ``"reading_contrast"`` (built from audited train labels) or ``"random"`` (a random
            direction of equal norm at the same layer and alpha); in an extending plan ``"post_training"`` (the mean
            boundary-residual difference between a post-trained model and the base).
        adapter: for ``adapter``/``patch`` (and ``no_response`` in an extending plan): the post-trained model, a key
            of the plan's ``post_training.adapters``; None = the base model.
        rank: for ``patch``: 1 = the best patching layer, 2 = the second best.
        reuse: ``"part1"``: the parent plan's held-out turns of the arm of the same name, not regenerated.
    """

    name: str
    kind: str
    temperature: float = 0.0
    vector: str | None = None
    adapter: str | None = None
    rank: int | None = None
    reuse: str | None = None


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
    def conversations(self) -> dict[str, Any]:
        """The conversations' settings (token caps): this plan's, or for an extending plan the parent's, whose
        fixed conversations it reuses (an extending plan never restates them)."""
        if "conversations" in self.raw:
            return dict(self.raw["conversations"])
        parent = self.parent
        if parent is None:
            raise UsageError(f"{self.path}: no 'conversations' section and no plan it extends; add the section")
        return parent.conversations

    @property
    def answer_tokens(self) -> int:
        return int(self.conversations["max_answer_tokens"])

    @property
    def user_tokens(self) -> int:
        return int(self.conversations["max_user_tokens"])

    @property
    def arms(self) -> list[Arm]:
        return [Arm(a["name"], a["kind"], float(a.get("temperature", 0.0)), a.get("vector"), a.get("adapter"),
                    int(a["rank"]) if a.get("rank") is not None else None, a.get("reuse"))
                for a in self.raw["arms"]]

    @property
    def parent(self) -> Plan | None:
        """The plan this one extends (checked against its pinned sha256), or None."""
        ext = self.raw.get("extends")
        return None if not ext else load_plan(self.path.parent / ext["plan"])

    @property
    def post_training(self) -> dict[str, Any]:
        return dict(self.raw.get("post_training", {}))

    @property
    def adapters(self) -> dict[str, dict[str, Any]]:
        """The post-trained models by name (``method``, ``data``, ``seed``, ``steps``)."""
        return {k: dict(v) for k, v in self.post_training.get("adapters", {}).items()}

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
_REQUIRED_EXTENDING = tuple(
    "name extends model seed post_training arms direction patching accuracy labels metrics tests cost".split())
MIN_PATCH_LAYERS = 6
MIN_PATCH_ITEMS = 60
MIN_ACCURACY_ITEMS = 150
MIN_SFT_SEEDS = 3


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
    extending = "extends" in raw
    missing = [k for k in (_REQUIRED_EXTENDING if extending else _REQUIRED) if k not in raw]
    if missing:
        raise UsageError(f"plan file {path} lacks {', '.join(missing)}: every choice must be written down first")
    kinds = EXTENDED_ARM_KINDS if extending else ARM_KINDS
    for a in raw["arms"]:
        if a.get("kind") not in kinds:
            raise UsageError(f"plan file {path}: arm {a.get('name')!r} has kind {a.get('kind')!r}; use one of "
                             f"{sorted(kinds)}")
    plan = Plan(path=path, sha256=hashlib.sha256(data).hexdigest(), raw=raw)
    if extending:
        _check_extending(plan)
    return plan


def _check_extending(plan: Plan) -> None:
    """The rules an extending plan must keep: the parent pinned and unchanged, the same model and seed, arms that
    name known adapters, and the study's minimums (SFT seeds, patching layers and items, accuracy items)."""
    raw, where = plan.raw, f"plan file {plan.path}"
    ext = raw["extends"]
    if not isinstance(ext, dict) or not all(k in ext for k in ("plan", "name", "sha256")):
        raise UsageError(f"{where}: extends must give the parent's plan file, name and sha256")
    parent_path = plan.path.parent / str(ext["plan"])
    if not parent_path.is_file():
        raise UsageError(f"{where}: extends {ext['plan']}, which is not beside it; restore the parent plan")
    got = hashlib.sha256(parent_path.read_bytes()).hexdigest()
    if got != ext["sha256"]:
        raise UsageError(f"{where}: the parent {ext['plan']} hashes to {got[:12]}…, not the pinned "
                         f"{str(ext['sha256'])[:12]}…: the parent changed; restore it or write a new plan")
    parent = load_plan(parent_path)
    if parent.name != ext["name"]:
        raise UsageError(f"{where}: extends names {ext['name']!r} but {ext['plan']} is {parent.name!r}")
    if raw["model"] != parent.raw["model"] or int(raw["seed"]) != parent.seed:
        raise UsageError(f"{where}: model and seed must be the parent's ({parent.model}, seed {parent.seed}): an "
                         "extending plan reuses its conversations")
    bad: list[str] = []
    adapters = plan.adapters
    for name, spec in adapters.items():
        if spec.get("method") not in ("sft", "dpo"):
            bad.append(f"adapter {name}: method {spec.get('method')!r} (use sft or dpo)")
        elif spec["method"] == "sft" and spec.get("data") not in ("human", "control"):
            bad.append(f"adapter {name}: sft data {spec.get('data')!r} (use human or control)")
        elif spec["method"] == "dpo" and spec.get("data") != "audited_pairs":
            bad.append(f"adapter {name}: dpo data must be audited_pairs (pairs from blind labels, never a judge)")
    selecting = [n for n, s in adapters.items() if s.get("steps") == "select"]
    if len(selecting) != 1 or adapters[selecting[0]].get("data") != "human":
        bad.append("exactly one human-data sft adapter must choose the steps (steps: select) on held-out loss")
    for n, s in adapters.items():
        if s.get("method") == "sft" and s.get("steps") != "select" and s.get("steps") not in selecting:
            bad.append(f"adapter {n}: steps {s.get('steps')!r} must be 'select' or the selecting adapter's name")
    seeds = {s.get("seed") for s in adapters.values() if s.get("method") == "sft" and s.get("data") == "human"}
    if len(seeds) < MIN_SFT_SEEDS:
        bad.append(f"{len(seeds)} SFT seed(s) on human data; the study needs {MIN_SFT_SEEDS}")
    if not any(s.get("data") == "control" for s in adapters.values()):
        bad.append("no control adapter (the same human turns after another conversation's messages)")
    names = [a.name for a in plan.arms]
    if len(set(names)) != len(names):
        bad.append("arm names repeat")
    for a in plan.arms:
        if a.adapter is not None and a.adapter not in adapters:
            bad.append(f"arm {a.name}: adapter {a.adapter!r} is not in post_training.adapters")
        if a.kind in ("adapter", "patch") and a.adapter is None:
            bad.append(f"arm {a.name}: kind {a.kind} needs an adapter")
        if a.kind == "patch" and a.rank not in (1, 2):
            bad.append(f"arm {a.name}: patch rank must be 1 or 2")
        if a.kind == "steer" and a.vector != "post_training":
            bad.append(f"arm {a.name}: an extending plan steers with vector post_training (part 1's vectors are the "
                       "parent's arms)")
        if a.reuse is not None and (a.reuse != "part1" or a.name not in {b.name for b in parent.arms}):
            bad.append(f"arm {a.name}: reuse 'part1' needs an arm of that name in the parent")
    pat = raw["patching"]
    layers = [int(x) for x in pat.get("layers", [])]
    if len(set(layers)) < MIN_PATCH_LAYERS or min(layers, default=0) < 1:
        bad.append(f"patching.layers: at least {MIN_PATCH_LAYERS} distinct residual indices >= 1")
    if int(pat.get("n_items", 0)) < MIN_PATCH_ITEMS:
        bad.append(f"patching.n_items: at least {MIN_PATCH_ITEMS}")
    if pat.get("adapter") not in adapters or raw["direction"].get("adapter") not in adapters:
        bad.append("patching.adapter and direction.adapter must name an adapter")
    acc = raw["accuracy"]
    items = list(acc.get("items", []))
    used = {i for s in ("heldout", "train") for ds in parent.datasets for i in parent.candidates(s, ds)}
    if len(set(items)) < MIN_ACCURACY_ITEMS or len(set(items)) != len(items):
        bad.append(f"accuracy.items: at least {MIN_ACCURACY_ITEMS} distinct ids")
    if used & set(items):
        bad.append(f"accuracy.items share {len(used & set(items))} id(s) with the parent's candidates")
    unknown = [m for m in acc.get("models", []) if m != "base" and m not in adapters]
    if unknown or "base" not in acc.get("models", []):
        bad.append(f"accuracy.models must list base and adapters only (unknown: {unknown})")
    if bad:
        raise UsageError(f"{where}: " + "; ".join(bad))
