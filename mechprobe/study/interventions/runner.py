"""The intervention study's steps, their order, and ``status``/``run`` over the ledger.

Steps (each writes under ``ROOT`` = ``reports/interventions/<plan name>/`` and is recorded in the ledger with its
wall time and the sha256 of its outputs, so its files can be committed as soon as it finishes):

1. ``train_answers`` / ``heldout_answers``: the base model's greedy answers to a split's candidates; the first
   complete ones per dataset (in the plan's draw order) become its fixed conversations.
2. ``train_turns``: on train conversations, the instructed stimuli and the model's own greedy user turn.
3. ``train_sheet``: the train turns as shuffled blind sheets of ``sheet_batch`` rows.
4. ``train_labels``: *external*: two model-written labellers fill each sheet (``train/labels/<batch>/<name>.csv``);
   done when the labelled batches hold at least ``min_positives`` turns both call strictly genuine.
5. ``direction``: the reading contrast per candidate layer from the audited train labels, its item-grouped
   cross-validated AUROC, and the layer's mean boundary residual norm (the vector's norm).
6. ``select``: layer and alpha on train items by the plan's rule; frozen in ``selection.json``.
7. ``heldout_<arm>``: each arm's user turns on the held-out conversations (one row per item); unsteered arms need
   only the held-out answers, steering arms also the frozen selection.
8. ``heldout_sheet``, ``judge`` (verdicts beside the labels) and ``heldout_labels`` (*external*); then ``table``.

A plan that *extends* another (part 2) lists the parent's steps as ``part1:<step>`` (done or pending in the
parent's ledger, never run here) and adds its own (:mod:`.post_steps`): ``sft_data``, ``train_<adapter>``,
``dpo_pairs``, ``post_train_turns``, ``post_direction``, ``post_select``, ``heldout_<arm>``, ``patch``,
``accuracy_<model>``, ``accuracy``, then the sheet, the judge and the labels as above.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mechprobe.audit.arms import (
    arm_outcomes,
    pooled_tests,
    read_sheet_labels,
    study_outcome,
    study_table,
    table_markdown,
)
from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import JsonlStore, output_dir_lock, read_json, read_jsonl, sha256_file, write_json
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.factory import make_judge
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.lm.prefix import PrefixStore
from mechprobe.lm.registry import EMBEDDED, embedded_gguf_path
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.interventions import (
    patching_figure_title,
    plot_patching_profile,
    plot_study_arms,
    study_figure_title,
)
from mechprobe.records import AssistantRecord
from mechprobe.steering.degenerate import degenerate_rate, largest_safe_alpha
from mechprobe.steering.vector import SteeringVector, random_like
from mechprobe.study.interventions.generate import (
    STIMULUS_KINDS,
    boundary_norms,
    reading_states,
    stimuli,
    user_turns,
)
from mechprobe.study.interventions.ledger import Ledger
from mechprobe.study.interventions.plan import Plan, load_plan
from mechprobe.study.interventions.post_steps import PART1, POST, PostTrainingSteps
from mechprobe.study.interventions.sheets import write_sheet
from mechprobe.study.interventions.summary import part2_summary, summary_markdown
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ProbeConfig, assistant_answers

__all__ = ["Study", "StepStatus"]

EXTERNAL = ("train_labels", "heldout_labels")


@dataclass
class StepStatus:
    name: str
    state: str  # done | pending | external | blocked
    note: str = ""
    seconds: float | None = None


class Study(PostTrainingSteps):
    """A plan, its output folder and its ledger; loads the model once, when a step first needs it.

    For a plan that extends another, ``parent`` is the parent's Study (same reports and work roots): its
    conversations, train labels and reused arms are read from there.

    Example:
        >>> from mechprobe.study.interventions import Study, load_plan
        >>> s = Study(load_plan("studies/interventions/plan.json"), "reports/interventions")  # doctest: +SKIP
        >>> [st.state for st in s.status()][:2]  # doctest: +SKIP
        ['done', 'pending']
    """

    def __init__(self, plan: Plan, reports: str | Path, work: str | Path = "runs/interventions",
                 progress: bool = True) -> None:
        self.plan = plan
        self.root = Path(reports) / plan.name
        self.work = Path(work) / plan.name
        self.progress = progress
        self.ledger = Ledger.open(self.root, plan)
        parent = plan.parent
        self.parent = Study(parent, reports, work, progress) if parent is not None else None
        self._lm: LoadedModel | None = None
        self._store: PrefixStore | None = None
        self._adapter_lms: dict[str, LoadedModel] = {}
        self._adapter_stores: dict[str, PrefixStore] = {}
        if plan.raw.get("train", {}).get("reuse_from"):
            self._reuse(plan.train["reuse_from"], self._TRAIN_STEPS, self._TRAIN_FIELDS)
        if plan.raw.get("reuse"):
            self._reuse(plan.raw["reuse"], tuple(plan.raw["reuse"]["steps"]), None)

    # The plan fields a train-side output depends on: equal in both plans, the outputs are this plan's own.
    _TRAIN_FIELDS = ("model", "seed", "conversations", "train", "selection")
    _TRAIN_STEPS = ("train_answers", "train_stimuli", "train_turns", "train_sheet")
    # What a plan may change and still reuse an earlier plan's steps (``reuse``): its name and its story only.
    _META_FIELDS = ("name", "written", "reason", "supersedes", "cost", "reuse")

    def _reuse(self, src: dict[str, Any], steps: tuple[str, ...], fields: tuple[str, ...] | None) -> None:
        """Take ``steps`` (and the external train labels) from the earlier plan ``src`` names, instead of running
        them again.

        ``train.reuse_from`` (``fields`` = the train side's fields) serves a plan that changes only the held-out
        side; top-level ``reuse`` (``fields`` None: every field but the name and the story must be equal) serves a
        plan that changes only code, e.g. a fixed detector, and redoes the steps after the ones it lists. Refused
        unless the fields are equal and the earlier outputs still match their ledger's hashes; the copies are
        recorded with the same hashes and the source's cost.
        """
        other = load_plan(Path(self.plan.path).parent / src["plan"])

        def fields_of(p: Plan) -> dict[str, Any]:
            raw = {k: v for k, v in p.raw.items() if (k in fields if fields else k not in self._META_FIELDS)}
            if "train" in raw:
                raw["train"] = {k: v for k, v in raw["train"].items() if k != "reuse_from"}
            if fields:
                raw["items"] = p.raw["items"]["train"]
            return raw

        mine, theirs = fields_of(self.plan), fields_of(other)
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if other.name != src["name"] or diff:
            raise UserError(f"reuse of {src['name']!r}: that plan differs in {', '.join(diff) or 'name'}; "
                            f"its outputs are not this plan's")
        src_root = self.root.parent / other.name
        theirs_ledger = Ledger.open(src_root, other)
        bad = theirs_ledger.verify()
        if bad:
            raise UserError(f"{src_root}: {', '.join(bad[:3])} no longer match(es) its ledger; restore them first")
        for step in steps:
            rec = theirs_ledger.steps.get(step)
            if rec is None or self.ledger.done(step):
                continue
            for rel in rec.outputs:
                (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src_root / rel, self.root / rel)
            self.ledger.record(step, 0.0, [self.root / rel for rel in rec.outputs],
                               {"reused_from": other.name, "source_seconds": rec.seconds, "source_cpu": rec.cpu,
                                "source_finished": rec.finished})
        # the external train labels, what the labellers and the author saw, and the resumable turn stores the plan
        # names (``stores``: a step that is run again resumes from them, e.g. select recomputes its rule on the
        # same greedy train turns): copied as they are
        for rel in ("train/labels", "train/author_instructions.md", "codebook_as_labelled.md", *src.get("stores", ())):
            a, b = src_root / rel, self.root / rel
            if a.is_dir() and not b.exists():
                shutil.copytree(a, b)
            elif a.is_file() and not b.exists():
                shutil.copyfile(a, b)

    # ------------------------------------------------------------------ helpers
    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            self._check_model()
            self._lm = load_model(self.plan.model, dtype=self.plan.dtype)
        return self._lm

    @property
    def store(self) -> PrefixStore:
        """The conversations' KV prefixes, shared by every arm of this process (on disk under the work folder
        beyond 2 GiB, reused by a later process on the same weights)."""
        if self._store is None:
            self._store = PrefixStore(self.lm, disk_dir=self.work / "prefix", progress=self.progress)
        return self._store

    def _check_model(self) -> None:
        m = EMBEDDED.get(self.plan.model)
        if m is None or m.sha256 != self.plan.model_sha256:
            raise UserError(f"the plan pins {self.plan.model} with GGUF sha256 {self.plan.model_sha256[:12]}…, which "
                            f"is not the embedded model of that name; the study must run on the pinned weights")
        embedded_gguf_path(self.plan.model)  # a one-line error naming the fetch command when absent

    def conversations(self, split: str) -> list[AssistantRecord]:
        """The fixed conversations of ``split`` (``train``/``heldout``), in the plan's order (an extending plan's are
        its parent's)."""
        if self.parent is not None:
            return self.parent.conversations(split)
        items = read_json(self.root / f"items_{split}.json")["items"]
        by_id = {r["item_id"]: r for r in read_jsonl(self.root / f"conversations_{split}.jsonl")}
        return [AssistantRecord(item_id=i, dataset=by_id[i]["dataset"], prompt=by_id[i]["query"],
                                response=by_id[i]["answer"], stop_reason=by_id[i]["stop_reason"],
                                n_tokens=by_id[i]["n_answer_tokens"]) for i in items]

    def done(self, step: str) -> bool:
        """Whether ``step`` is done: a ``part1:`` step in the parent's ledger, any other in this plan's."""
        if step.startswith(PART1):
            return self.parent is not None and self.parent.ledger.done(step[len(PART1):])
        return self.ledger.done(step)

    def _need(self, *steps: str) -> None:
        miss = [s for s in steps if not self.done(s)]
        if miss:
            raise MissingInput(f"step(s) {', '.join(miss)} not done yet: run `mechprobe interventions run` first")

    # ------------------------------------------------------------------ steps
    def step_answers(self, split: str) -> list[Path]:
        """The fixed conversations of ``split``: greedy answers to its candidates in draw order, the first complete
        ones per dataset kept (``conversations_<split>.jsonl``, ``items_<split>.json``)."""
        items = {}
        for ds in self.plan.datasets:
            for it in load_dataset(ds).items:
                items[it.item_id] = it
        missing = [i for ds in self.plan.datasets for i in self.plan.candidates(split, ds) if i not in items]
        if missing:
            raise UserError(f"the plan names {len(missing)} items the datasets lack (e.g. {missing[0]}): is ../shared "
                            f"the data the plan was drawn from?")
        cfg = ProbeConfig(model=self.plan.model, dtype=self.plan.dtype, max_assistant_tokens=self.plan.answer_tokens,
                          temperatures=[0.0], samples=0)
        # Candidates in draw order, a chunk at a time, until the split has its complete answers: the rule picks
        # the first complete ones, so answers past that point would never be used.
        recs: dict[str, AssistantRecord] = {}
        chosen: list[str] = []
        chunk = int(self.plan.conversations.get("chunk", 16))
        complete = bool(self.plan.conversations.get("require_complete", True))
        for ds in self.plan.datasets:
            cands, need, ok = self.plan.candidates(split, ds), self.plan.wanted(split, ds), []
            pos = 0
            while len(ok) < need and pos < len(cands):
                take = cands[pos:pos + max(1, min(chunk, 2 * (need - len(ok))))]
                pos += len(take)
                for r in assistant_answers(cfg, self.lm, [items[i] for i in take], self.answers_dir(),
                                           progress=self.progress):
                    recs[r.item_id] = r
                ok += [i for i in take if recs[i].stop_reason != "max_tokens" or not complete]
            if len(ok) < need:
                raise UserError(f"only {len(ok)} of the {split} {ds} candidates have complete answers, the plan "
                                f"wants {need}: a new plan with more candidates is needed")
            chosen += ok[:need]
        conv = self.root / f"conversations_{split}.jsonl"
        rows = []
        for i in chosen:
            r = recs[i]
            rows.append({"item_id": i, "split": split, "dataset": r.dataset, "query": r.prompt, "answer": r.response,
                         "stop_reason": r.stop_reason, "n_answer_tokens": r.n_tokens, "score": r.score,
                         "gold": r.gold})
        self.root.mkdir(parents=True, exist_ok=True)
        conv.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tried = {ds: [i for i in self.plan.candidates(split, ds) if i in recs] for ds in self.plan.datasets}
        write_json(self.root / f"items_{split}.json",
                   {"items": chosen, "answered": {k: len(v) for k, v in tried.items()},
                    "left_out_cut_at_cap": {k: [i for i in v if recs[i].stop_reason == "max_tokens"]
                                            for k, v in tried.items()}})
        return [conv, self.root / f"items_{split}.json"]

    def answers_dir(self) -> Path:
        """The scratch store of greedy answers; ``conversations.answers_from`` names an earlier plan whose store is
        reused (refused unless it pinned the same model, dtype and answer cap: the answers are then the same)."""
        src = self.plan.conversations.get("answers_from")
        if not src:
            return self.work / "answers"
        other = self.plan.conversations.get("answers_from_plan")
        if other:
            o = load_plan(Path(self.plan.path).parent / other)
            same = (o.model, o.model_sha256, o.dtype, o.answer_tokens) == (self.plan.model, self.plan.model_sha256,
                                                                           self.plan.dtype, self.plan.answer_tokens)
            if not same or o.name != src:
                raise UserError(f"answers_from {src!r}: that plan pins another model, dtype or answer cap; its answers "
                                f"are not this plan's")
        return self.work.parent / src / "answers"

    @property
    def authored(self) -> bool:
        """Whether the train stimuli are written by an author session (an external step) rather than the model."""
        return self.plan.train.get("stimuli") == "authored"

    def authored_stimuli(self) -> tuple[list[dict[str, Any]], str]:
        """The authored stimuli file's rows (every train item once), and a one-line progress note."""
        f = self.root / "train" / "stimuli_authored.jsonl"
        if not f.exists():
            return [], f"waits for {f.relative_to(self.root)} (an author session writes react/ignore per item)"
        rows = read_jsonl(f)
        want = {a.item_id for a in self.conversations("train")}
        got = {r.get("item_id") for r in rows}
        bad = [r.get("item_id") for r in rows if not (isinstance(r.get("react"), str) and r["react"].strip()
                                                       and isinstance(r.get("ignore"), str) and r["ignore"].strip())]
        if got != want or len(rows) != len(want) or bad:
            return [], f"{f.name}: {len(want - got)} train items missing, {len(got - want)} unknown, {len(bad)} empty"
        return rows, f"{len(rows)} items with react and ignore stimuli"

    def step_train_turns(self) -> list[Path]:
        """Candidate follow-ups on train conversations: the stimuli of every kind, plus the model's own greedy turn."""
        self._need("train_answers")
        convs = self.conversations("train")
        out = self.root / "train" / "turns.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        store = JsonlStore(out, key="turn_id")
        rows = read_jsonl(out)
        if self.authored:
            stim, note = self.authored_stimuli()
            if not stim:
                raise MissingInput(note)
            by_id = {a.item_id: a for a in convs}
            for r in stim:
                a = by_id[r["item_id"]]
                for kind in ("react", "ignore"):
                    tid = f"{a.item_id}|{kind}"
                    if not store.has(tid):
                        store.append({"turn_id": tid, "decoding": kind, "item_id": a.item_id, "dataset": a.dataset,
                                      "stimulus": kind, "ignore_kind": r.get("ignore_kind") if kind == "ignore" else None,
                                      "query": a.prompt, "answer": a.response, "turn": r[kind].strip(),
                                      "stop_reason": "authored"})
        for kind in ([] if self.authored else STIMULUS_KINDS):
            have = {r["item_id"] for r in rows if r["decoding"] == kind}
            for row in stimuli(self.lm, convs, kind, max_new_tokens=self.plan.user_tokens, done=have,
                               progress=self.progress):
                store.append({"turn_id": f"{row['item_id']}|{kind}", "decoding": kind, **row})
        have = {r["item_id"] for r in rows if r["decoding"] == "greedy"}
        for row in user_turns(self.lm, convs, arm="train_greedy", kind="decode", seed=self.plan.seed,
                              max_new_tokens=self.plan.user_tokens, done=have, progress=self.progress):
            store.append({"turn_id": f"{row['item_id']}|greedy", "decoding": "greedy", **row})
        return [out]

    def step_train_sheet(self) -> list[Path]:
        self._need("train_turns")
        tr = self.plan.train
        turns = read_jsonl(self.root / "train" / "turns.jsonl")
        rng = np.random.default_rng(self.plan.seed)
        order = [turns[i] for i in rng.permutation(len(turns))]
        size = int(tr["sheet_batch"])
        outs: list[Path] = []
        for b in range(0, len(order), size):
            name = f"batch{b // size + 1:02d}"
            d = self.root / "train" / "sheets"
            # Cleaned text for every row: the stimuli were written as assistant messages, so their special tokens
            # would differ from the model's own user turns and tell a labeller which is which.
            rows = [{"turn_id": t["turn_id"], "query": t["query"], "answer": t["answer"], "turn": t["turn"],
                     "item_id": t["item_id"], "decoding": t["decoding"]} for t in order[b:b + size]]
            write_sheet(rows, d / f"{name}.csv", d / f"{name}.key.json", sample_id=f"{self.plan.name}-train-{name}",
                        seed=self.plan.seed + b)
            outs += [d / f"{name}.csv", d / f"{name}.key.json"]
        return outs

    def train_labels(self) -> tuple[list[dict[str, Any]], str]:
        """Every labelled train turn (both labellers done on its batch), and a one-line progress note."""
        d = self.root / "train" / "sheets"
        lab_dir = self.root / "train" / "labels"
        rows: list[dict[str, Any]] = []
        n_batches = 0
        for key in sorted(d.glob("*.key.json")):
            name = key.name.split(".")[0]
            files = sorted((lab_dir / name).glob("*.csv")) if (lab_dir / name).is_dir() else []
            if len(files) < 2:
                continue
            k = read_json(key)
            keys = set(k["rows"])
            labs = [read_sheet_labels(f, k["sample_id"], keys) for f in files[:2]]
            if any(len(lab) < len(keys) for lab in labs):
                continue
            n_batches += 1
            for rk, meta in k["rows"].items():
                rows.append({**meta, "row": rk, "labels": [lab[rk] for lab in labs]})
        pos = sum(all(x["strict_genuine"] for x in r["labels"]) for r in rows)
        need = int(self.plan.train["min_positives"])
        return rows, f"{n_batches} batch(es) labelled by two labellers: {pos} strict positives (need {need})"

    def step_direction(self) -> list[Path]:
        rows, note = self.train_labels()
        need = int(self.plan.train["min_positives"])
        pos = [r for r in rows if all(x["strict_genuine"] for x in r["labels"])]
        neg = [r for r in rows if not any(x["lenient_genuine"] for x in r["labels"])]
        if len(pos) < need:
            raise UserError(f"{note}: label the next train sheet batch before building the direction")
        by_id = {r["turn_id"]: r for r in read_jsonl(self.root / "train" / "turns.jsonl")}
        convs = {a.item_id: a for a in self.conversations("train")}
        use = pos + neg
        layers = [int(x) for x in self.plan.selection["layers"]]
        states = reading_states(self.lm, [convs[r["item_id"]] for r in use], [by_id[r["turn_id"]]["turn"] for r in use],
                                layers, progress=self.progress)
        y = np.array([1] * len(pos) + [0] * len(neg))
        groups = np.array([r["item_id"] for r in use])
        info: dict[str, Any] = {"n_pos": len(pos), "n_neg": len(neg), "n_dropped_disagree": len(rows) - len(use),
                                "layers": {}}
        tensors: dict[str, torch.Tensor] = {}
        norms = boundary_norms(self.lm, self.conversations("train"), layers)
        for r in layers:
            x = states[r].numpy()
            info["layers"][str(r)] = {"cv_auroc": _grouped_cv_auroc(x, y, groups, self.plan.seed),
                                      "resid_norm": norms[r]}
            tensors[f"layer{r}"] = torch.from_numpy(x[y == 1].mean(0) - x[y == 0].mean(0)).float()
        out = self.root / "direction"
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "reading_contrast.safetensors"))
        write_json(out / "direction.json", info)
        return [out / "reading_contrast.safetensors", out / "direction.json"]

    def vector(self, kind: str, layer: int) -> SteeringVector:
        """The study's vector of ``kind`` at ``layer``, with norm = the layer's mean boundary residual norm."""
        info = read_json(self.root / "direction" / "direction.json")
        raw = load_file(str(self.root / "direction" / "reading_contrast.safetensors"))[f"layer{layer}"]
        norm = float(info["layers"][str(layer)]["resid_norm"])
        # A diff of means (of reading states, not boundary states): the package's ``diff_means`` kind, with the
        # construction named in its metadata.
        v = SteeringVector(raw / raw.norm() * norm, layer, "diff_means",
                           {"resid_norm": norm, "weight_hash": self.lm.weight_hash, "construction": "reading_contrast"})
        if kind == "reading_contrast":
            return v
        if kind == "random":
            return random_like(v, seed=self.plan.seed)
        raise UsageError(f"unknown vector {kind!r} in the plan: use reading_contrast or random")

    def step_select(self) -> list[Path]:
        self._need("direction")
        sel = self.plan.selection
        info = read_json(self.root / "direction" / "direction.json")
        layer = max((int(k) for k in info["layers"]), key=lambda k: (info["layers"][str(k)]["cv_auroc"], -k))
        convs = self.conversations("train")[: int(sel["n_train_items"])]
        out = self.root / "train" / "selection_turns.jsonl"
        store = JsonlStore(out, key="turn_id")
        have = {r["turn_id"] for r in read_jsonl(out)}

        def bad_rate(alpha: float) -> float:
            name = f"a{alpha:g}"
            vec = self.vector("reading_contrast", layer)
            done = {t.split("|")[0] for t in have if t.endswith(f"|{name}")}
            for row in user_turns(self.lm, convs, arm=f"select_{name}", kind="steer", vector=vec, alpha=alpha,
                                  max_new_tokens=self.plan.user_tokens, done=done, progress=self.progress,
                                  prefix_store=self.store):
                store.append({"turn_id": f"{row['item_id']}|{name}", **row})
                have.add(f"{row['item_id']}|{name}")
            rows = [r for r in read_jsonl(out) if r["turn_id"].endswith(f"|{name}")]
            return degenerate_rate(r["turn"] for r in rows)

        chosen, base, tried = largest_safe_alpha(sel["alphas"], bad_rate, float(sel["max_degenerate_increase"]))
        if chosen is None:
            raise UserError(f"no alpha in {sel['alphas']} keeps degenerate turns within +{sel['max_degenerate_increase']}"
                            f" of unsteered on train items ({tried}); the plan's rule selects nothing")
        write_json(self.root / "selection.json", {"layer": layer, "alpha": chosen, "degenerate_rate_base": base,
                                                   "degenerate_rate_by_alpha": tried,
                                                   "cv_auroc": info["layers"][str(layer)]["cv_auroc"],
                                                   "rule": sel["rule"]})
        return [self.root / "selection.json", out]

    def step_heldout(self, arm_name: str) -> list[Path]:
        self._need("heldout_answers")
        arm = next(a for a in self.plan.arms if a.name == arm_name)
        vec, alpha = None, 0.0
        if arm.kind == "steer":
            self._need("select")
            s = read_json(self.root / "selection.json")
            vec, alpha = self.vector(arm.vector or "", int(s["layer"])), float(s["alpha"])
        out = self.root / "heldout" / f"{arm.name}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        store = JsonlStore(out, key="item_id")
        have = {r["item_id"] for r in read_jsonl(out)}
        for row in user_turns(self.lm, self.conversations("heldout"), arm=arm.name, kind=arm.kind,
                              temperature=arm.temperature, seed=self.plan.seed, vector=vec, alpha=alpha,
                              max_new_tokens=self.plan.user_tokens, done=have, progress=self.progress,
                              prefix_store=self.store):
            store.append(row)
        return [out]

    def _arm_path(self, arm: str) -> Path:
        return self.arm_file(arm) if self.parent is not None else self.root / "heldout" / f"{arm}.jsonl"

    def _arm_step(self, arm: Any) -> str:
        return f"{PART1}heldout_{arm.name}" if arm.reuse == "part1" else f"heldout_{arm.name}"

    def step_heldout_sheet(self) -> list[Path]:
        arms = [a.name for a in self.plan.arms]
        self._need(*[self._arm_step(a) for a in self.plan.arms])
        rows = []
        for a in arms:
            for r in read_jsonl(self._arm_path(a)):
                # As generated, special tokens included (the codebook reads a turn as written); every arm's turn
                # comes from the same decoder, so the raw text reveals no arm.
                rows.append({"turn_id": f"{r['item_id']}|{a}", "query": r["query"], "answer": r["answer"],
                             "turn": r["raw_turn"], "item_id": r["item_id"], "arm": a})
        d = self.root / "heldout"
        write_sheet(rows, d / "sheet.csv", d / "sheet.key.json", sample_id=f"{self.plan.name}-heldout",
                    seed=self.plan.seed)
        return [d / "sheet.csv", d / "sheet.key.json"]

    def step_judge(self) -> list[Path]:
        """Each plan judge's verdict on every held-out turn, from what the labellers see (query, real answer, turn)."""
        self._need("heldout_sheet")
        d = self.root / "heldout"
        key = read_json(d / "sheet.key.json")["rows"]
        turns = {f"{r['item_id']}|{a.name}": r for a in self.plan.arms for r in read_jsonl(self._arm_path(a.name))}
        outs = []
        for spec in self.plan.raw["labels"]["judges"]:
            judge = make_judge(spec)
            inputs = []
            for row, meta in sorted(key.items()):
                t = turns[meta["turn_id"]]
                inputs.append(JudgeInput(record_id=row, prompt=t["query"], response=t["answer"], raw_text=t["raw_turn"],
                                         text=t["turn"], stop_reason=t["stop_reason"], dataset=t["dataset"],
                                         item_id=t["item_id"], subject=self.plan.model))
            out = d / f"verdicts_{spec.replace(':', '_')}.jsonl"
            store = JsonlStore(out, key="record_id")
            todo = [i for i in inputs if not store.has(i.record_id)]
            for rec in judge.label_many(todo):
                store.append(rec.to_dict())
            outs.append(out)
        return outs

    def table(self) -> dict[str, Any]:
        """The held-out table (:func:`~mechprobe.audit.arms.study_table`), written as
        ``table.json`` and ``table.md``; needs both labellers' files complete."""
        d = self.root / "heldout"
        k = read_json(d / "sheet.key.json")
        files = sorted((d / "labels").glob("*.csv")) if (d / "labels").is_dir() else []
        if len(files) < 2:
            raise MissingInput(f"{d / 'labels'} holds {len(files)} labels file(s); two labellers must fill sheet.csv")
        labs = [read_sheet_labels(f, k["sample_id"], set(k["rows"])) for f in files]
        short = [f.name for f, lab in zip(files, labs) if len(lab) < len(k["rows"])]
        if short:
            raise UserError(f"{', '.join(short)} leave rows unlabelled; every held-out row needs a label")
        judges = {}
        for spec in self.plan.raw["labels"]["judges"]:
            f = d / f"verdicts_{spec.replace(':', '_')}.jsonl"
            if f.exists():
                got = {r["record_id"]: bool(r["genuine"]) for r in read_jsonl(f)}
                if set(k["rows"]) <= set(got):
                    judges[spec] = got
                else:  # the judge step has not finished: the table goes on without that judge, and says so
                    print(f"{f.name}: {len(got)} of {len(k['rows'])} rows judged; left out of the table until the "
                          f"judge step finishes")
        names = [a.name for a in self.plan.arms]
        if self.parent is None:
            tab = study_table(k["rows"], labs, names, judges=judges or None)
        else:  # part 2's floor and control arms; its pre-registered tests are part2_tests, not part 1's outcome
            ad = self.plan.adapters
            tab = study_table(k["rows"], labs, names, judges=judges or None,
                              floor=next(a.name for a in self.plan.arms if a.kind == "no_response"),
                              control=next(a.name for a in self.plan.arms if a.kind == "adapter"
                                           and ad[a.adapter].get("data") == "control"))
        tab["labellers"] = [f.stem for f in files]
        tab["compared_with"] = ({"floor": "answer_removed", "control": "steer_random"} if self.parent is None else
                                {"floor": next(a.name for a in self.plan.arms if a.kind == "no_response"),
                                 "control": next(a.name for a in self.plan.arms if a.kind == "adapter"
                                                 and self.plan.adapters[a.adapter].get("data") == "control")})
        tab["study_outcome"] = study_outcome(tab) if self.parent is None else None
        md_extra = ""
        if self.parent is not None:
            tab["part2"] = self.part2_tests(k["rows"], labs)
            tab["part2_summary"] = self.part2_summary(k["rows"], labs, tab)
            patching = self.root / POST / "patching.json"
            pat = read_json(patching) if patching.exists() else None
            md_extra = "\n" + summary_markdown(tab["part2_summary"], tab["part2"], pat)
            if pat is not None:
                pfig = self.root / "patching.png"
                _, err = draw_figure(pfig, lambda: plot_patching_profile(
                    pat, pfig, patching_figure_title(self.plan.model, pat["adapter"], len(pat["items"]))))
                if err:
                    print(err)
        write_json(self.root / "table.json", tab)
        note = ("Judges beside the labels: " + ", ".join(f"`{j}`" for j in judges) + ".") if judges else ""
        (self.root / "table.md").write_text(table_markdown(tab, self.plan.model, note) + md_extra, encoding="utf-8")
        fig = self.figure_path
        _, err = draw_figure(fig, lambda: plot_study_arms(
            tab, [a.name for a in self.plan.arms], fig,
            study_figure_title(self.plan.model, f"plan {self.plan.path.name}", int(tab["arms"][self.plan.arms[0].name]
                                                                                   ["strict"]["n"]))))
        if err:
            print(err)
        return tab

    @property
    def figure_path(self) -> Path:
        """``arms.png`` in the plan's report folder (the arms' rates and their differences vs base), beside the
        table it draws."""
        return self.root / "arms.png"

    def part2_tests(self, key: dict[str, Any], labs: list[dict[str, Any]]) -> dict[str, Any]:
        """The extending plan's tests per reading: SFT pooled over its seeds against base, the control and its
        answer-removed floor, and the post-training steering arm's share of SFT's lift."""
        arms = self.plan.arms
        ad = self.plan.adapters
        sft = [a.name for a in arms if a.kind == "adapter" and ad[a.adapter]["method"] == "sft"
               and ad[a.adapter]["data"] == "human"]
        control = next(a.name for a in arms if a.kind == "adapter" and ad[a.adapter].get("data") == "control")
        floor = next(a.name for a in arms if a.kind == "no_response")
        steer = next((a.name for a in arms if a.kind == "steer"), None)
        out: dict[str, Any] = {r: pooled_tests(arm_outcomes(key, labs, r), sft, "base", control, floor, steer,
                                               seed=self.plan.seed) for r in ("strict", "lenient")}
        out["arms"] = {"pooled": sft, "base": "base", "control": control, "floor": floor, "steer": steer,
                       "seed": self.plan.seed}  # what the findings recompute the tests with
        return out

    def part2_summary(self, key: dict[str, Any], labs: list[dict[str, Any]], tab: dict[str, Any]) -> dict[str, Any]:
        """The one table of part 2 (:func:`~mechprobe.study.interventions.summary.part2_summary`): the labels'
        table joined with ``accuracy/accuracy.json`` (when the accuracy step is done) and the ledgers' costs."""
        arms = self.plan.arms
        ad = self.plan.adapters
        control = next(a.name for a in arms if a.kind == "adapter" and ad[a.adapter].get("data") == "control")
        floor = next(a.name for a in arms if a.kind == "no_response")
        accf = self.root / "accuracy" / "accuracy.json"
        acc = read_json(accf)["models"] if accf.exists() else None
        steps = {n: vars(r) for n, r in self.ledger.steps.items()}
        if self.parent is not None:
            steps.update({PART1 + n: vars(r) for n, r in self.parent.ledger.steps.items()})
        raw = {a["name"]: a for a in self.plan.raw["arms"]}
        return part2_summary(tab, [raw[a.name] for a in arms], {r: arm_outcomes(key, labs, r) for r in ("strict", "lenient")},
                             control=control, floor=floor, accuracy=acc, steps=steps,
                             dpo_methods={n: str(v.get("method")) for n, v in ad.items()}, seed=self.plan.seed)

    # ------------------------------------------------------------------ the ledger
    def steps(self) -> list[tuple[str, Callable[[], list[Path]] | None, tuple[str, ...]]]:
        """Every step in run order with what it needs; ``None`` for the external (labelling) steps.

        The model's held-out conversations and the unsteered arms need nothing from the train side, so they run
        while the train sheet is being labelled; the steering arms need the frozen selection.
        """
        if self.parent is not None:
            return self._extending_steps()
        arms = self.plan.arms
        free = [a for a in arms if a.kind != "steer"]
        steered = [a for a in arms if a.kind == "steer"]

        def arm_step(name: str) -> Callable[[], list[Path]]:
            return lambda: self.step_heldout(name)

        out: list[tuple[str, Callable[[], list[Path]] | None, tuple[str, ...]]] = [
            ("train_answers", lambda: self.step_answers("train"), ()),
            *([("train_stimuli", None, ("train_answers",))] if self.authored else []),
            ("train_turns", self.step_train_turns, ("train_answers", "train_stimuli") if self.authored
             else ("train_answers",)),
            ("train_sheet", self.step_train_sheet, ("train_turns",)),
            ("heldout_answers", lambda: self.step_answers("heldout"), ())]
        out += [(f"heldout_{a.name}", arm_step(a.name), ("heldout_answers",)) for a in free]
        out += [("train_labels", None, ("train_sheet",)), ("direction", self.step_direction, ("train_labels",)),
                ("select", self.step_select, ("direction",))]
        out += [(f"heldout_{a.name}", arm_step(a.name), ("heldout_answers", "select")) for a in steered]
        out += [("heldout_sheet", self.step_heldout_sheet, tuple(f"heldout_{a.name}" for a in arms)),
                ("judge", self.step_judge, ("heldout_sheet",)), ("heldout_labels", None, ("heldout_sheet",))]
        return out

    def _extending_steps(self) -> list[tuple[str, Callable[[], list[Path]] | None, tuple[str, ...]]]:
        """Part 2's steps after the parent's (listed as ``part1:<step>``, never run here)."""
        assert self.parent is not None
        Step = tuple[str, Callable[[], list[Path]] | None, tuple[str, ...]]
        out: list[Step] = [(PART1 + n, None, tuple(PART1 + d for d in deps)) for n, _, deps in self.parent.steps()]
        ad = self.plan.adapters
        sel = next(n for n, s in ad.items() if s.get("steps") == "select")

        def train(n: str) -> Callable[[], list[Path]]:
            return lambda: self.step_train(n)

        out.append(("sft_data", self.step_sft_data, ()))
        out.append((f"train_{sel}", train(sel), ("sft_data",)))
        out += [(f"train_{n}", train(n), ("sft_data", f"train_{sel}")) for n, s in ad.items()
                if s["method"] == "sft" and n != sel]
        if any(s["method"] == "dpo" for s in ad.values()):
            out.append(("dpo_pairs", self.step_dpo_pairs, (PART1 + "train_labels",)))
            out += [(f"train_{n}", train(n), ("dpo_pairs",)) for n, s in ad.items() if s["method"] == "dpo"]
        dad = self.plan.raw["direction"]["adapter"]
        out += [("post_train_turns", self.step_post_train_turns, (f"train_{dad}", PART1 + "train_answers")),
                ("post_direction", self.step_post_direction, (f"train_{dad}", PART1 + "train_answers")),
                ("post_select", self.step_post_select, ("post_direction", "post_train_turns"))]

        def arm(n: str) -> Callable[[], list[Path]]:
            return lambda: self.step_heldout_post(n)

        pad = self.plan.raw["patching"]["adapter"]
        patch_turns = next(f"heldout_{a.name}" for a in self.plan.arms if a.kind == "adapter" and a.adapter == pad)
        late: list[Step] = []
        for a in self.plan.arms:
            if a.reuse:
                continue
            needs = [PART1 + "heldout_answers"] + ([f"train_{a.adapter}"] if a.adapter else [])
            if a.kind == "steer":
                needs.append("post_select")
            if a.kind == "patch":
                late.append((f"heldout_{a.name}", arm(a.name), (*needs, "patch")))
            else:
                out.append((f"heldout_{a.name}", arm(a.name), tuple(needs)))
        out.append(("patch", self.step_patch, (patch_turns,)))
        out += late

        def acc(m: str) -> Callable[[], list[Path]]:
            return lambda: self.step_accuracy_answers(m)

        models = list(self.plan.raw["accuracy"]["models"])
        out += [(f"accuracy_{m}", acc(m), () if m == "base" else (f"train_{m}",)) for m in models]
        out.append(("accuracy", self.step_accuracy, tuple(f"accuracy_{m}" for m in models)))
        out += [("heldout_sheet", self.step_heldout_sheet, tuple(self._arm_step(a) for a in self.plan.arms)),
                ("judge", self.step_judge, ("heldout_sheet",)), ("heldout_labels", None, ("heldout_sheet",))]
        return out

    def status(self) -> list[StepStatus]:
        """Each step: done (with its wall seconds), external (labels awaited) or pending; an extending plan's
        ``part1:`` steps are done or ``part1`` (pending under the parent plan, which runs them)."""
        res = []
        cost = self.plan.raw.get("cost", {})
        for name, fn, _ in self.steps():
            if name.startswith(PART1):
                assert self.parent is not None
                prec = self.parent.ledger.steps.get(name[len(PART1):])
                if prec is not None:
                    res.append(StepStatus(name, "done", f"reused from {self.parent.plan.path.name}'s ledger",
                                          prec.seconds))
                else:
                    res.append(StepStatus(name, "part1", f"runs under {self.parent.plan.path.name}, not here"))
                continue
            rec = self.ledger.steps.get(name)
            if rec is not None:
                res.append(StepStatus(name, "done", f"{len(rec.outputs)} file(s), {rec.cpu}", rec.seconds))
            elif fn is None and name == "train_stimuli":
                res.append(StepStatus(name, "external", self.authored_stimuli()[1]))
            elif fn is None and name == "train_labels":
                note = self.train_labels()[1] if self.ledger.done("train_sheet") else "waits for train_sheet"
                res.append(StepStatus(name, "external", note))
            elif fn is None:
                res.append(StepStatus(name, "external", "two labellers fill heldout/labels/<name>.csv"))
            else:
                res.append(StepStatus(name, "pending", str(cost.get(name, cost.get(_cost_key(name), "")))))
        return res

    def run(self, only: str | None = None) -> list[str]:
        """Run every pending step whose needs are done, in order (or just ``only``); an external step counts as done
        once its labels are in (``train_labels``: enough strict positives). Returns the steps run."""
        ran: list[str] = []
        names = [n for n, _, _ in self.steps()]
        if only is not None and only not in names:
            raise UsageError(f"unknown step {only!r}; steps: {', '.join(names)}")
        with output_dir_lock(self.root, "interventions run", "reports"):
            for name, fn, needs in self.steps():
                if name.startswith(PART1):
                    if only == name:
                        raise UsageError(f"{name} is a step of {self.parent.plan.path.name if self.parent else 'the parent'}"
                                         f": run it under that plan, not this one")
                    continue
                if (only is not None and name != only) or self.ledger.done(name):
                    continue
                if not all(self.done(n) for n in needs):
                    if only is not None:
                        self._need(*needs)
                    continue
                if fn is None:
                    if name == "train_stimuli" and self.authored_stimuli()[0]:
                        self.ledger.record(name, 0.0, [self.root / "train" / "stimuli_authored.jsonl"],
                                           {"note": self.authored_stimuli()[1]})
                        ran.append(name)
                    if name == "train_labels":
                        rows, note = self.train_labels()
                        pos = sum(all(x["strict_genuine"] for x in r["labels"]) for r in rows)
                        if pos >= int(self.plan.train["min_positives"]):
                            files = sorted((self.root / "train" / "labels").rglob("*.csv"))
                            self.ledger.record(name, 0.0, files, {"note": note})
                            ran.append(name)
                    continue
                t0 = time.time()
                outs = fn()
                self.ledger.record(name, time.time() - t0, outs)
                ran.append(name)
        return ran

    def verify(self) -> list[str]:
        """Committed outputs whose bytes changed since their step recorded them."""
        return self.ledger.verify()


def _cost_key(step: str) -> str:
    """The plan's cost entry that covers ``step`` when it has none of its own (``train_sft_s1`` -> ``train_sft``,
    ``heldout_sft_s2`` -> ``heldout_arm``, ``accuracy_dpo`` -> ``accuracy_model``)."""
    if step.startswith("train_sft") or step == "train_control":
        return "train_sft"
    if step.startswith("heldout_patch"):
        return "heldout_patch"
    if step.startswith("heldout_"):
        return "heldout_arm"
    if step.startswith("accuracy_"):
        return "accuracy_model"
    return step


def _grouped_cv_auroc(x: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int, folds: int = 5) -> float:
    """AUROC of the diff-of-means projection, fitted on the other folds; folds split by item (no item in two)."""
    uniq = np.unique(groups)
    rng = np.random.default_rng(seed)
    fold_of = {g: i % folds for i, g in enumerate(rng.permutation(uniq))}
    f = np.array([fold_of[g] for g in groups])
    scores = np.zeros(len(y), dtype=float)
    for k in range(folds):
        tr, te = f != k, f == k
        if te.sum() == 0 or len(set(y[tr])) < 2:
            continue
        w = x[tr & (y == 1)].mean(0) - x[tr & (y == 0)].mean(0)
        scores[te] = x[te] @ w
    return float(_auroc(scores, y))


def _auroc(s: np.ndarray, y: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).mean()
    eq = (pos[:, None] == neg[None, :]).mean()
    return float(gt + 0.5 * eq)


def file_hashes(paths: list[Path]) -> dict[str, str]:
    return {str(p): sha256_file(p) for p in paths}
