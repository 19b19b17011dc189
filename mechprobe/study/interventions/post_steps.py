"""The steps of an extending plan (part 2): train the adapters, the post-training direction, patching, accuracy.

Why a separate module: the steps of part 1 (:mod:`.runner`) read and write the parent plan's folder; these write
only the extending plan's folder (``reports/interventions/<plan name>/``) and read the parent's outputs (its
conversations, train labels and held-out base turns) through the parent's ledger, never rerunning a parent step.

Where weights change (an adapter arm, the answer-removed arm under an adapter, accuracy under an adapter) the
base model's KV prefix store is never used (its prefixes were computed with other weights, and
:class:`~mechprobe.lm.prefix.PrefixStore` refuses another model); where the intervention starts at the boundary on
the base weights (the post-training steering arm, the patch arms) the base store is reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mechprobe.audit.arms import paired_difference
from mechprobe.errors import MissingInput, UsageError, UserError
from mechprobe.io import JsonlStore, read_json, read_jsonl, write_json
from mechprobe.lm.models import LoadedModel, load_model
from mechprobe.lm.prefix import PrefixStore
from mechprobe.post_train import train as pt
from mechprobe.post_train.dpo import DPOTrainConfig, train_dpo
from mechprobe.post_train.pairs import Pair
from mechprobe.records import AssistantRecord
from mechprobe.steering.degenerate import degenerate_rate, largest_safe_alpha
from mechprobe.steering.vector import SteeringVector
from mechprobe.study.interventions.generate import user_turns
from mechprobe.study.interventions.ledger import cpu_name
from mechprobe.study.interventions.post import (
    adapter_sha256,
    add_from,
    audited_pairs,
    boundary_states,
    control_pairing,
    human_turn_split,
    merge_error,
    paired_examples,
    patch_boundary,
    probe_ids,
    recovered_fraction,
    target_logprobs,
    turn_ids,
    turn_logliks,
)
from mechprobe.turns.datasets import load_dataset
from mechprobe.turns.pipeline import ProbeConfig, assistant_answers

__all__ = ["PostTrainingSteps", "PART1"]

PART1 = "part1:"  # prefix of the parent plan's steps in an extending plan's step list
POST = "post_training"


def _hash_examples(examples: list[pt.TrainExample]) -> str:
    return hashlib.sha256(json.dumps([[e.input_ids, e.labels] for e in examples]).encode()).hexdigest()


class PostTrainingSteps:
    """The part-2 steps; mixed into :class:`~mechprobe.study.interventions.runner.Study` (which supplies ``plan``,
    ``root``, ``work``, ``progress``, ``ledger``, ``lm``, ``store``, ``parent`` and ``conversations``)."""

    plan: Any
    root: Path
    work: Path
    progress: bool
    parent: Any
    _adapter_lms: dict[str, LoadedModel]
    _adapter_stores: dict[str, PrefixStore]

    # The base model and its prefix store, and the conversations, come from the Study.
    lm: LoadedModel
    store: PrefixStore
    conversations: Callable[[str], list[AssistantRecord]]

    # ------------------------------------------------------------------ data
    def post_examples(self) -> dict[str, Any]:
        """The SFT and control examples (train and held-out), rebuilt by the plan's rule (cheap, deterministic)."""
        d = self.plan.post_training["data"]
        tok = self.lm.tokenizer
        tr, ho = human_turn_split(d["sources"], float(d["held_out_fraction"]))
        a, b, sk = paired_examples(tok, tr, control_pairing(tr, self.plan.seed), int(d["max_len"]))
        ha, hb, hsk = paired_examples(tok, ho, control_pairing(ho, self.plan.seed), int(d["max_len"]))
        return {"human": (a, ha), "control": (b, hb), "skipped": {"train": sk, "heldout": hsk},
                "conversations": {"train": len(tr), "heldout": len(ho)}}

    def step_sft_data(self) -> list[Path]:
        """The training data's counts and hashes (``post_training/data.json``): every later training step checks
        that it rebuilt exactly these examples."""
        ex = self.post_examples()
        info = {"conversations": ex["conversations"], "skipped": ex["skipped"],
                "examples": {k: {"train": len(ex[k][0]), "heldout": len(ex[k][1]), "train_sha256":
                                 _hash_examples(ex[k][0]), "heldout_sha256": _hash_examples(ex[k][1])}
                             for k in ("human", "control")},
                "train_conv_ids": [e.conv_id for e in ex["human"][0]],
                "control_conv_ids": [e.conv_id for e in ex["control"][0]]}
        out = self.root / POST / "data.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, info)
        return [out]

    # ------------------------------------------------------------------ training
    def sft_config(self, name: str) -> pt.TrainConfig:
        hp, spec = self.plan.post_training["sft"], self.plan.adapters[name]
        return pt.TrainConfig(steps=int(hp["max_steps"]), batch_size=int(hp["batch_size"]), lr=float(hp["lr"]),
                              warmup_steps=int(hp["warmup_steps"]), lora_r=int(hp["lora_r"]),
                              lora_alpha=int(hp["lora_alpha"]), lora_dropout=float(hp["lora_dropout"]),
                              target_modules=str(hp["target_modules"]), seed=int(spec["seed"]),
                              checkpoint_every=int(hp["eval_every"]),
                              patience=int(hp["patience"]) if spec["steps"] == "select" else 0)

    def step_train(self, name: str, stop_after: int | None = None, out: Path | None = None) -> list[Path]:
        """Train adapter ``name`` (SFT or DPO) on a fresh copy of the base model; write its training log, config
        and ``adapter.json`` (adapter sha256, chosen step, data hash, seconds, CPU) under ``post_training/<name>/``.

        ``stop_after`` and ``out`` are for measuring cost on a few steps (a scratch folder, never the ledger)."""
        spec = self.plan.adapters[name]
        work = out or self.work / POST / name
        dest = (out / "report") if out is not None else self.root / POST / name
        dest.mkdir(parents=True, exist_ok=True)
        base = load_model(self.plan.model, dtype=self.plan.dtype)
        info: dict[str, Any] = {"adapter": name, **spec, "base_weight_hash": base.weight_hash, "cpu": cpu_name(),
                                "threads": torch.get_num_threads()}
        if spec["method"] == "sft":
            ex = self.post_examples()
            train, held = ex[spec["data"]]
            want = read_json(self.root / POST / "data.json")["examples"][spec["data"]] if out is None else None
            if want is not None and want["train_sha256"] != _hash_examples(train):
                raise UserError(f"the rebuilt {spec['data']} examples differ from post_training/data.json: the data "
                                "or tokenizer changed since sft_data; restore them or write a new plan")
            cfg = self.sft_config(name)
            curve = held[: int(self.plan.post_training["sft"]["curve_examples"])]
            selecting = spec["steps"] == "select"
            if not selecting and stop_after is None:
                stop_after = int(read_json(self.root / POST / spec["steps"] / "adapter.json")["chosen_step"])
            pm, res = pt.train_lora(base.model, train, cfg, work, base.tokenizer.pad_token_id or 0,
                                    progress=self.progress, heldout=curve if selecting else (), stop_after=stop_after)
            info.update({"n_examples": len(train), "data_sha256": _hash_examples(train), "steps_done": res.steps_done,
                         "chosen_step": res.chosen_step, "stopped_early": res.stopped_early,
                         "seconds": round(res.seconds, 1), "tokens_per_s": round(res.tokens_per_s, 2),
                         "heldout_loss_final": round(pt.heldout_loss(pm, curve, base.tokenizer.pad_token_id or 0), 6)
                         if curve else None})
            files = [pt.TRAIN_LOG, "train_config.json"] + ([pt.HELDOUT_LOG] if selecting else [])
        else:
            pairs = [Pair.from_dict(r) for r in read_jsonl(self.root / POST / "dpo_pairs.jsonl")]
            dp = self.plan.post_training["dpo"]
            hp = self.plan.post_training["sft"]
            steps = stop_after or math.ceil(len(pairs) / int(dp["batch_size"])) * int(dp["epochs"])
            cfg = DPOTrainConfig(steps=steps, batch_size=int(dp["batch_size"]), lr=float(dp["lr"]),
                                 warmup_steps=int(dp["warmup_steps"]), beta=float(dp["beta"]), lora_r=int(hp["lora_r"]),
                                 lora_alpha=int(hp["lora_alpha"]), lora_dropout=float(hp["lora_dropout"]),
                                 target_modules=str(hp["target_modules"]), seed=int(spec["seed"]))
            pm, res = train_dpo(base.model, base.tokenizer, pairs, cfg, work, progress=self.progress)
            info.update({"n_pairs": len(pairs), "steps_done": res.steps_done, "chosen_step": res.steps_done,
                         "seconds": round(res.seconds, 1)})
            files = [pt.TRAIN_LOG, "dpo_config.json"]
        info["adapter_sha256"] = adapter_sha256(Path(work) / pt.ADAPTER_DIR)
        if self.merge_rule is not None:
            info["merge_check"] = self.merge_check(pm)
        outs = []
        for f in files:
            if (Path(work) / f).exists():
                shutil.copyfile(Path(work) / f, dest / f)
                outs.append(dest / f)
        write_json(dest / "adapter.json", info)
        return [*outs, dest / "adapter.json"]

    @property
    def merge_rule(self) -> dict[str, Any] | None:
        """The plan's rule for merging adapters into the weights (``post_training.merge``); None = run unmerged."""
        return self.plan.post_training.get("merge")

    def merge_check(self, pm: Any) -> dict[str, Any]:
        """The plan's merge check on a freshly trained adapter: target-token log-probabilities of the first
        ``examples`` held-out human-turn examples (never a study item) under the base (adapter disabled), the
        adapter unmerged and the adapter merged into the weights' dtype; merged is used when it keeps the share
        ``gain_kept`` of the mean gain (nothing systematic rounded away) and its relative error is at most
        ``max_relative_error`` (bf16 numerics alone give a few hundredths of a nat per token). Merges ``pm`` in
        place (call it last)."""
        rule = self.merge_rule or {}
        ex = self.post_examples()["human"][1][: int(rule["examples"])]
        pm.eval()
        with pm.disable_adapter():
            lp_base = target_logprobs(pm, ex)
        lp_un = target_logprobs(pm, ex)
        merged = pm.merge_and_unload()
        lp_m = target_logprobs(merged, ex)
        res = merge_error(lp_base, lp_un, lp_m)
        lo, hi = (float(x) for x in rule["gain_kept"])
        res["rule"] = {"gain_kept": [lo, hi], "max_relative_error": float(rule["max_relative_error"])}
        res["use_merged"] = bool(lo <= res["gain_kept"] <= hi and res["relative_error"] <= float(rule["max_relative_error"]))
        res["examples"] = len(ex)
        return res

    def step_dpo_pairs(self) -> list[Path]:
        """Pairs from part 1's blind train labels (:func:`~mechprobe.study.interventions.post.audited_pairs`)."""
        rows, _ = self.parent.train_labels()
        turns = {r["turn_id"]: r for r in read_jsonl(self.parent.root / "train" / "turns.jsonl")}
        convs = {a.item_id: a for a in self.parent.conversations("train")}
        pairs, counts = audited_pairs(rows, turns, convs, self.lm.tokenizer)
        if not pairs:
            raise UserError("no audited DPO pair: no train conversation has a turn both labellers call strictly "
                            "genuine and one neither calls genuine")
        d = self.root / POST
        d.mkdir(parents=True, exist_ok=True)
        (d / "dpo_pairs.jsonl").write_text("".join(json.dumps(p.to_dict(), ensure_ascii=False) + "\n" for p in pairs),
                                           encoding="utf-8")
        write_json(d / "dpo_pairs.json", {**counts, "rule": self.plan.post_training["dpo"]["pairs"]})
        return [d / "dpo_pairs.jsonl", d / "dpo_pairs.json"]

    # ------------------------------------------------------------------ models
    def adapter_lm(self, name: str) -> LoadedModel:
        """The base model with adapter ``name`` applied unmerged (LoRA in float32 beside the bfloat16 weights:
        merging into bfloat16 would round small updates away); its weight hash joins the base's and the adapter's,
        and the adapter's bytes must match the sha256 its training step recorded."""
        if name in self._adapter_lms:
            return self._adapter_lms[name]
        try:
            from peft import PeftModel  # lazy: extra [train]
        except ImportError as e:
            raise MissingInput("post-trained arms need peft: pip install 'mechprobe[train]'") from e
        info = read_json(self.root / POST / name / "adapter.json")
        path = self.work / POST / name / pt.ADAPTER_DIR
        if adapter_sha256(path) != info["adapter_sha256"]:
            raise UserError(f"{path} does not hash to the adapter sha256 its training recorded; retrain {name}")
        base = load_model(self.plan.model, dtype=self.plan.dtype)
        pm = PeftModel.from_pretrained(base.model, str(path))
        pm.eval()
        merged = self.merge_rule is not None and bool(info.get("merge_check", {}).get("use_merged"))
        # merged: LoRA folded into the weights (the plan's merge check passed), the base's cost, own prefix store;
        # else the HF model with LoRA layers inside: a plain causal LM to every caller
        model = pm.merge_and_unload() if merged else pm.base_model.model
        tag = "|merged" if merged else ""
        wh = hashlib.sha256(f"{base.weight_hash}|{info['adapter_sha256']}{tag}".encode()).hexdigest()
        lm = LoadedModel(model=model, tokenizer=base.tokenizer, name=f"{self.plan.model}+{name}", weight_hash=wh,
                         device=base.device, dtype=base.dtype)
        if merged:
            self._adapter_stores[name] = PrefixStore(lm, disk_dir=self.work / f"prefix_{name}", progress=self.progress)
        self._adapter_lms[name] = lm
        return lm

    def store_for(self, lm: LoadedModel) -> PrefixStore | None:
        """The base model's prefix store for the base model, a merged adapter's own store for that model; None for
        an unmerged adapter (a store is never shared between weights: the store refuses another weight hash)."""
        if lm is self.lm:
            return self.store
        return next((self._adapter_stores.get(n) for n, m in self._adapter_lms.items() if m is lm), None)

    # ------------------------------------------------------------------ the post-training direction
    def step_post_train_turns(self) -> list[Path]:
        """The direction's adapter's greedy user turns on the train conversations (its own turns: the layer rule
        scores how much of their log-likelihood gap a vector recovers)."""
        name = self.plan.raw["direction"]["adapter"]
        lm = self.adapter_lm(name)
        out = self.root / POST / f"{name}_train_turns.jsonl"
        store = JsonlStore(out, key="item_id")
        have = {r["item_id"] for r in read_jsonl(out)}
        for row in user_turns(lm, self.conversations("train"), arm=f"train_{name}", kind="decode",
                              seed=self.plan.seed, max_new_tokens=self.plan.user_tokens, done=have,
                              progress=self.progress, prefix_store=self.store_for(lm)):
            store.append(row)
        return [out]

    def step_post_direction(self) -> list[Path]:
        """Mean (adapter - base) residual at the user-role boundary over the train conversations, per layer."""
        spec = self.plan.raw["direction"]
        layers = [int(x) for x in spec["layers"]]
        convs = self.conversations("train")
        ids = probe_ids(self.lm.tokenizer, convs)
        post = boundary_states(self.adapter_lm(spec["adapter"]).model, ids, layers)
        base = boundary_states(self.lm.model, ids, layers)
        tensors, info = {}, {"n_items": len(convs), "adapter": spec["adapter"], "layers": {}}
        for r in layers:
            diff = (post[r] - base[r]).mean(0)
            tensors[f"layer{r}"] = diff.float().contiguous()
            info["layers"][str(r)] = {"shift_norm": float(diff.norm()), "base_resid_norm":
                                      float(base[r].norm(dim=-1).mean())}
        d = self.root / POST / "direction"
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "post_direction.safetensors"))
        write_json(d / "post_direction.json", info)
        return [d / "post_direction.safetensors", d / "post_direction.json"]

    def post_vector(self, layer: int) -> SteeringVector:
        """The post-training direction at ``layer``; its ``resid_norm`` is its own norm, so alpha = 1 adds exactly
        the mean boundary shift."""
        raw = load_file(str(self.root / POST / "direction" / "post_direction.safetensors"))[f"layer{layer}"]
        n = float(raw.norm())
        return SteeringVector(raw, layer, "diff_means", {"resid_norm": n, "weight_hash": self.lm.weight_hash,
                                                         "construction": "post_training"})

    def step_post_select(self) -> list[Path]:
        """Layer by the recovered log-likelihood gap of the adapter's own train turns (alpha 1), then alpha by the
        degenerate-turn rule, on train items only; frozen in ``post_selection.json``."""
        spec = self.plan.raw["direction"]
        name = spec["adapter"]
        convs = self.conversations("train")
        rows = {r["item_id"]: r for r in read_jsonl(self.root / POST / f"{name}_train_turns.jsonl")}
        tok = self.lm.tokenizer
        tids = [turn_ids(tok, rows[a.item_id]["turn"]) for a in convs]
        ids = probe_ids(tok, convs)
        ll_base = turn_logliks(self.lm.model, ids, tids)
        ll_post = turn_logliks(self.adapter_lm(name).model, ids, tids)
        by_layer = {}
        for r in (int(x) for x in spec["layers"]):
            vec = self.post_vector(r).vector

            def edit(_i: int, b: int, r: int = r, vec: torch.Tensor = vec) -> Any:
                return add_from(self.lm.model, r, vec, b)

            by_layer[str(r)] = recovered_fraction(ll_base, ll_post, turn_logliks(self.lm.model, ids, tids, edit),
                                                 seed=self.plan.seed)
        layer = max((int(k) for k in by_layer), key=lambda k: (np.nan_to_num(by_layer[str(k)]["fraction"], nan=-1e9),
                                                               -k))
        out = self.root / POST / "post_selection_turns.jsonl"
        store = JsonlStore(out, key="turn_id")
        have = {r["turn_id"] for r in read_jsonl(out)}

        def bad_rate(alpha: float) -> float:
            tag = f"a{alpha:g}"
            done = {t.split("|")[0] for t in have if t.endswith(f"|{tag}")}
            for row in user_turns(self.lm, convs, arm=f"post_select_{tag}", kind="steer", vector=self.post_vector(layer),
                                  alpha=alpha, max_new_tokens=self.plan.user_tokens, done=done, progress=self.progress,
                                  prefix_store=self.store):
                store.append({"turn_id": f"{row['item_id']}|{tag}", **row})
                have.add(f"{row['item_id']}|{tag}")
            got = [r for r in read_jsonl(out) if r["turn_id"].endswith(f"|{tag}")]
            return degenerate_rate(r["turn"] for r in got)

        chosen, base_rate, tried = largest_safe_alpha(spec["alphas"], bad_rate,
                                                      float(spec["max_degenerate_increase"]))
        if chosen is None:
            raise UserError(f"no alpha in {spec['alphas']} keeps degenerate turns within "
                            f"+{spec['max_degenerate_increase']} of unsteered on train items ({tried})")
        write_json(self.root / POST / "post_selection.json",
                   {"layer": layer, "alpha": chosen, "recovered_by_layer": by_layer, "degenerate_rate_base": base_rate,
                    "degenerate_rate_by_alpha": tried, "layer_rule": spec["layer_rule"], "alpha_rule": spec["alpha_rule"]})
        return [self.root / POST / "post_selection.json", out]

    # ------------------------------------------------------------------ held-out arms
    def arm_file(self, arm_name: str) -> Path:
        """Where an arm's held-out turns are: the parent's file for a reused arm, this plan's otherwise."""
        arm = next(a for a in self.plan.arms if a.name == arm_name)
        root = self.parent.root if arm.reuse == "part1" else self.root
        return root / "heldout" / f"{arm.name}.jsonl"

    def step_heldout_post(self, arm_name: str) -> list[Path]:
        """One part-2 arm's user turns on the held-out conversations (the parent's), one row per item."""
        arm = next(a for a in self.plan.arms if a.name == arm_name)
        if arm.reuse:
            raise UsageError(f"arm {arm.name} reuses part 1's turns; nothing to generate")
        convs = self.conversations("heldout")
        out = self.root / "heldout" / f"{arm.name}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        store = JsonlStore(out, key="item_id")
        have = {r["item_id"] for r in read_jsonl(out)}
        common = dict(arm=arm.name, seed=self.plan.seed, max_new_tokens=self.plan.user_tokens, progress=self.progress)
        if arm.kind == "patch":
            for row in self._patched_turns(arm, convs, have):
                store.append(row)
            return [out]
        lm = self.adapter_lm(arm.adapter) if arm.adapter else self.lm
        vec, alpha, kind = None, 0.0, arm.kind
        if arm.kind == "adapter":
            kind = "decode"
        elif arm.kind == "steer":
            sel = read_json(self.root / POST / "post_selection.json")
            vec, alpha = self.post_vector(int(sel["layer"])), float(sel["alpha"])
        for row in user_turns(lm, convs, kind=kind, temperature=arm.temperature, vector=vec, alpha=alpha, done=have,
                              prefix_store=self.store_for(lm), **common):
            store.append({**row, "adapter": arm.adapter})
        return [out]

    def _patched_turns(self, arm: Any, convs: list[AssistantRecord], have: set[str]) -> Any:
        """Base greedy turns with the adapter's boundary residual written at the patch layer of ``arm.rank``: per
        item, the difference (adapter - base) at the boundary added there at the prefill's boundary position only
        (so the residual there becomes the adapter's), one item per decode call (the patch differs per item)."""
        best = read_json(self.root / POST / "patching.json")["best_layers"]
        layer = int(best[arm.rank - 1])
        todo = [a for a in convs if a.item_id not in have]
        ids = probe_ids(self.lm.tokenizer, todo)
        post = boundary_states(self.adapter_lm(arm.adapter).model, ids, [layer])[layer]
        base = boundary_states(self.lm.model, ids, [layer])[layer]
        for i, a in enumerate(todo):
            vec = SteeringVector(post[i] - base[i], layer, "diff_means",
                                 {"resid_norm": float((post[i] - base[i]).norm()) or 1.0,
                                  "weight_hash": self.lm.weight_hash, "construction": "patch"})
            for row in user_turns(self.lm, [a], arm=arm.name, kind="steer", vector=vec, alpha=1.0,
                                  positions="boundary", seed=self.plan.seed, max_new_tokens=self.plan.user_tokens,
                                  progress=False, prefix_store=self.store, batch_size=1):
                yield {**row, "adapter": arm.adapter, "patch_layer": layer}

    def step_patch(self) -> list[Path]:
        """Per patching layer, the fraction of the adapter-minus-base log-likelihood gap of the adapter's own
        held-out turns that its boundary residual alone recovers in the base model; the two best layers."""
        spec = self.plan.raw["patching"]
        name = spec["adapter"]
        arm = next(a for a in self.plan.arms if a.kind == "adapter" and a.adapter == name)
        rows = {r["item_id"]: r for r in read_jsonl(self.root / "heldout" / f"{arm.name}.jsonl")}
        convs = self.patch_items()
        tok = self.lm.tokenizer
        tids = [turn_ids(tok, rows[a.item_id]["turn"]) for a in convs]
        layers = [int(x) for x in spec["layers"]]
        post_lm = self.adapter_lm(name)
        ids = probe_ids(tok, convs)
        ll_base = turn_logliks(self.lm.model, ids, tids)
        ll_post = turn_logliks(post_lm.model, ids, tids)
        states = boundary_states(post_lm.model, ids, layers)
        res = {}
        for r in layers:
            def edit(i: int, b: int, r: int = r) -> Any:
                return patch_boundary(self.lm.model, r, states[r][i], b)

            res[str(r)] = recovered_fraction(ll_base, ll_post, turn_logliks(self.lm.model, ids, tids, edit),
                                             seed=self.plan.seed)
        best = sorted(layers, key=lambda r: (-np.nan_to_num(res[str(r)]["fraction"], nan=-1e9), r))[:2]
        out = self.root / POST / "patching.json"
        write_json(out, {"adapter": name, "turns_of": arm.name, "items": [a.item_id for a in convs],
                         "ll_base_mean": float(np.mean(ll_base)), "ll_post_mean": float(np.mean(ll_post)),
                         "by_layer": res, "best_layers": best,
                         "acting_layers": [r for r in layers if res[str(r)]["lo"] > 0]})
        return [out]

    def patch_items(self) -> list[AssistantRecord]:
        """The first ``n_items / n_datasets`` held-out conversations of each dataset, in the plan's order."""
        convs = self.conversations("heldout")
        dss = sorted({a.dataset for a in convs})
        per = int(self.plan.raw["patching"]["n_items"]) // max(1, len(dss))
        return [a for ds in dss for a in [c for c in convs if c.dataset == ds][:per]]

    # ------------------------------------------------------------------ accuracy
    def step_accuracy_answers(self, model: str) -> list[Path]:
        """Model ``model``'s own greedy answers to the accuracy items (exact match scored per answer)."""
        acc = self.plan.raw["accuracy"]
        lm = self.lm if model == "base" else self.adapter_lm(model)
        items = {it.item_id: it for it in load_dataset(acc["dataset"]).items}
        miss = [i for i in acc["items"] if i not in items]
        if miss:
            raise UserError(f"the plan's accuracy items are not in {acc['dataset']} (e.g. {miss[0]})")
        cfg = ProbeConfig(model=self.plan.model, dtype=self.plan.dtype, max_assistant_tokens=self.plan.answer_tokens,
                          temperatures=[0.0], samples=0)
        recs = assistant_answers(cfg, lm, [items[i] for i in acc["items"]], self.work / "accuracy" / model,
                                 progress=self.progress)
        order = {i: k for k, i in enumerate(acc["items"])}
        recs = sorted(recs, key=lambda r: order[r.item_id])  # the plan's order, whatever order they were decoded in
        out = self.root / "accuracy" / f"{model}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps({"item_id": r.item_id, "model": model, "score": r.score, "gold": r.gold,
                                           "stop_reason": r.stop_reason, "n_tokens": r.n_tokens, "answer": r.response},
                                          ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
        return [out]

    def step_accuracy(self) -> list[Path]:
        """Exact-match rate per model and each post-trained model's paired difference against base."""
        acc = self.plan.raw["accuracy"]
        got = {m: {r["item_id"]: bool(r["score"]) for r in read_jsonl(self.root / "accuracy" / f"{m}.jsonl")}
               for m in acc["models"]}
        cut = {m: sum(r["stop_reason"] == "max_tokens" for r in read_jsonl(self.root / "accuracy" / f"{m}.jsonl"))
               for m in acc["models"]}
        table = {m: {"rate": float(np.mean(list(v.values()))) if v else float("nan"), "n": len(v), "cut_at_cap": cut[m],
                     **({"vs_base": paired_difference(got["base"], v, seed=self.plan.seed)} if m != "base" else {})}
                 for m, v in got.items()}
        out = self.root / "accuracy" / "accuracy.json"
        write_json(out, {"metric": acc["metric"], "models": table})
        return [out]
