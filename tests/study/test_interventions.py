"""The intervention study's machinery: plan pinning, item draws, blind sheets, the table, and one real run.

The end-to-end test runs every step of a miniature plan on the embedded SmolLM2 model (its turns are noise; the
point is the machinery): answers, stimuli, a train sheet filled by a scripted labeller, the direction, the
selection, every arm, the held-out sheet, the judge and the table, then a kill-free resume that runs nothing.
"""

from __future__ import annotations

import copy
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mechprobe.audit.arms import read_sheet_labels
from mechprobe.errors import UsageError, UserError
from mechprobe.study.interventions import (
    Study,
    draw_items,
    load_plan,
    paired_difference,
    study_table,
    used_item_ids,
)
from mechprobe.study.interventions.sheets import write_sheet
from tests.conftest import REPO, requires_smollm2

PLAN = REPO / "studies" / "interventions" / "plan.json"


def test_draw_items_is_seeded_and_excludes():
    a = draw_items("gsm8k", 50, 10, seed=3, exclude={"gsm8k-0010"}, min_index=5)
    assert a == draw_items("gsm8k", 50, 10, seed=3, exclude={"gsm8k-0010"}, min_index=5)
    assert "gsm8k-0010" not in a and all(int(x.split("-")[1]) >= 5 for x in a)
    assert a != draw_items("gsm8k", 50, 10, seed=4, exclude=set(), min_index=5)


@pytest.mark.parametrize("name", ["plan.json", "plan_v2.json", "plan_v2b.json", "plan_v2c.json"])
def test_committed_plan_items_are_fresh_and_disjoint(name):
    plan = load_plan(PLAN.parent / name)
    held = {i for ds in plan.datasets for i in plan.candidates("heldout", ds)}
    train = {i for ds in plan.datasets for i in plan.candidates("train", ds)}
    assert not held & train
    # no committed file outside the study itself names a held-out or train candidate
    outside = [p for p in ("reports", "mechprobe/data", "docs", "benchmarks", "scripts") if (REPO / p).exists()]
    used = used_item_ids([REPO / p for p in outside if p != "reports"] +
                         [d for d in (REPO / "reports").iterdir() if d.name != "interventions"])
    assert not (held | train) & used


def test_plan_errors_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_plan(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(UsageError, match="not valid"):
        load_plan(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "x"}', encoding="utf-8")
    with pytest.raises(UsageError, match="format"):
        load_plan(tmp_path / "other.json")
    raw = json.loads(PLAN.read_text(encoding="utf-8"))
    del raw["tests"]
    (tmp_path / "short.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(UsageError, match="lacks tests"):
        load_plan(tmp_path / "short.json")


def test_ledger_refuses_a_changed_plan(tmp_path):
    p = tmp_path / "plan.json"
    p.write_bytes(PLAN.read_bytes())
    s = Study(load_plan(p), tmp_path / "reports", tmp_path / "work", progress=False)
    s.ledger.record("train_answers", 1.0, [])
    raw = json.loads(p.read_text(encoding="utf-8"))
    raw["selection"]["alphas"] = [8.0]
    p.write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(UserError, match="plan changed"):
        Study(load_plan(p), tmp_path / "reports", tmp_path / "work")


def _fill(sheet: Path, out: Path, label_of) -> None:
    with sheet.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update(label_of(r))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_sheet_is_blind_and_labels_need_the_strict_reading(tmp_path):
    rows = [{"turn_id": f"i{k}|base", "query": "q", "answer": f"a{k}", "turn": f"t{k}", "item_id": f"i{k}",
             "arm": "base"} for k in range(4)]
    write_sheet(rows, tmp_path / "s.csv", tmp_path / "k.json", sample_id="S", seed=0)
    text = (tmp_path / "s.csv").read_text(encoding="utf-8")
    assert "base" not in text and "i0" not in text  # neither the arm nor the item is shown
    key = json.loads((tmp_path / "k.json").read_text(encoding="utf-8"))
    _fill(tmp_path / "s.csv", tmp_path / "a.csv", lambda r: {"label": "genuine_followup", "strict": "yes"})
    got = read_sheet_labels(tmp_path / "a.csv", "S", set(key["rows"]))
    assert all(v["strict_genuine"] and v["lenient_genuine"] for v in got.values())
    _fill(tmp_path / "s.csv", tmp_path / "b.csv", lambda r: {"label": "genuine_followup", "strict": ""})
    with pytest.raises(UsageError, match="strict reading"):
        read_sheet_labels(tmp_path / "b.csv", "S", set(key["rows"]))
    with pytest.raises(UsageError, match="not on sheet"):
        read_sheet_labels(tmp_path / "a.csv", "S", set(list(key["rows"])[:2]))


def test_study_vectors_add_the_same_push_in_the_resid_unit_as_raw():
    """The study builds vectors of norm = the layer's mean residual norm, with that norm as ``resid_norm``, and
    steers in the package's ``resid`` unit: the added push is exactly what ``raw`` would add (also for the
    random control, which keeps the norm and its metadata)."""
    import torch

    from mechprobe.lm.forward import tiny_model
    from mechprobe.steering import SteeringVector, steer
    from mechprobe.steering.steering_vector import random_like

    model = tiny_model("llama", seed=0).eval()
    raw = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    vec = SteeringVector(raw / raw.norm() * 7.3, 2, "diff_means", {"resid_norm": 7.3})
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
        for v in (vec, random_like(vec, seed=0)):
            with steer(model, v, 0.4, "all", unit="resid"):
                resid = model(ids).logits
            with steer(model, v, 0.4, "all", unit="raw"):
                as_raw = model(ids).logits
            assert torch.allclose(resid, as_raw, atol=1e-5)
            assert (resid - plain).abs().max() > 1e-2


def test_paired_difference_contains_its_point_and_is_seed_stable():
    rng = np.random.default_rng(0)
    a = {f"i{k}": bool(rng.random() < 0.1) for k in range(120)}
    b = {f"i{k}": bool(rng.random() < 0.3) for k in range(120)}
    r0 = paired_difference(a, b, seed=0)
    r1 = paired_difference(a, b, seed=1)
    assert r0["lo"] <= r0["diff"] <= r0["hi"] and r0["n"] == 120
    assert abs(r0["lo"] - r1["lo"]) < 0.01 and abs(r0["hi"] - r1["hi"]) < 0.01
    z = paired_difference({"x": False}, {"x": False})
    assert z["diff"] == 0 and z["lo"] <= 0 <= z["hi"]


def test_study_table_counts_a_turn_only_when_both_labellers_agree():
    key = {"r1": {"arm": "base", "item_id": "i1"}, "r2": {"arm": "steer_audited", "item_id": "i1"},
           "r3": {"arm": "base", "item_id": "i2"}, "r4": {"arm": "steer_audited", "item_id": "i2"}}
    yes = {"strict_genuine": True, "lenient_genuine": True}
    no = {"strict_genuine": False, "lenient_genuine": False}
    lenient_only = {"strict_genuine": False, "lenient_genuine": True}
    a = {"r1": no, "r2": yes, "r3": no, "r4": lenient_only}
    b = {"r1": no, "r2": yes, "r3": no, "r4": yes}
    t = study_table(key, [a, b], ["base", "steer_audited"])
    assert t["arms"]["steer_audited"]["strict"]["k"] == 1 and t["arms"]["steer_audited"]["lenient"]["k"] == 2
    assert t["arms"]["steer_audited"]["strict"]["vs_base"]["diff"] == 0.5
    assert [p["k"] for p in t["arms"]["steer_audited"]["strict"]["per_labeller"]] == [1, 2]


def _mini_plan(tmp_path: Path) -> Path:
    raw = json.loads(PLAN.read_text(encoding="utf-8"))
    raw = copy.deepcopy(raw)
    from mechprobe.lm.registry import EMBEDDED

    raw["name"] = "mini"
    raw["model"] = {"name": "smollm2-135m-instruct", "gguf_sha256": EMBEDDED["smollm2-135m-instruct"].sha256,
                    "dtype": "float32"}
    raw["conversations"].update(max_answer_tokens=24, max_user_tokens=8, require_complete=False)
    ids = [f"builtin-math-{k:02d}" for k in range(8)]
    raw["items"]["heldout"] = {"per_dataset": {"builtin": 2}, "candidates": {"builtin": ids[:4]}}
    raw["items"]["train"] = {"per_dataset": {"builtin": 3}, "candidates": {"builtin": ids[4:]}}
    raw["train"].update(sheet_batch=4, min_positives=2)
    raw["labels"]["judges"] = ["offline"]
    raw["selection"].update(layers=[3, 6], alphas=[0.5, 1.0], n_train_items=3, max_degenerate_increase=1.0)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(raw), encoding="utf-8")
    return p


@pytest.mark.slow
@requires_smollm2
def test_every_step_runs_and_resumes_on_the_embedded_model(tmp_path, monkeypatch):
    plan = load_plan(_mini_plan(tmp_path))
    s = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    first = ["train_answers", "train_turns", "train_sheet", "heldout_answers", "heldout_base", "heldout_base_t1",
             "heldout_answer_removed"]
    assert s.run() == first  # everything that does not wait for the train labels
    assert {st.name: st.state for st in s.status()}["train_labels"] == "external"
    assert {st.name: st.state for st in s.status()}["heldout_steer_audited"] == "pending"
    root = s.root
    for sheet in sorted((root / "train" / "sheets").glob("*.csv")):
        key = json.loads(sheet.with_suffix(".key.json").read_text(encoding="utf-8"))["rows"]
        for who in ("a", "b"):  # a scripted labeller: the 'react' stimuli are genuine, the rest not
            _fill(sheet, root / "train" / "labels" / sheet.stem / f"{who}.csv",
                  lambda r, key=key: ({"label": "genuine_followup", "strict": "yes"}
                                      if key[r["row"]]["decoding"] == "react" else {"label": "new_query", "strict": ""}))
    ran = s.run()
    arms = [a.name for a in plan.arms]
    assert ran == ["train_labels", "direction", "select", "heldout_steer_audited", "heldout_steer_random",
                   "heldout_sheet", "judge"]
    sel = json.loads((root / "selection.json").read_text(encoding="utf-8"))
    assert sel["layer"] in (3, 6) and sel["alpha"] in (0.5, 1.0)
    rows = {a: [json.loads(x) for x in (root / "heldout" / f"{a}.jsonl").read_text().splitlines()] for a in arms}
    assert all(len(v) == 2 for v in rows.values())
    assert all(r["shown_answer"] == "" for r in rows["answer_removed"])
    assert all(r["answer"] and r["query"] for v in rows.values() for r in v)  # full texts kept
    # the sheet shows every arm's turn with the real answer, arms hidden
    for who in ("a", "b"):
        _fill(root / "heldout" / "sheet.csv", root / "heldout" / "labels" / f"{who}.csv",
              lambda r: {"label": "new_query", "strict": ""})
    tab = s.table()
    assert set(tab["arms"]) == set(arms) and tab["arms"]["base"]["strict"]["n"] == 2
    assert (root / "table.md").read_text(encoding="utf-8").count("|") > 20
    assert s.verify() == []
    again = Study(plan, tmp_path / "reports", tmp_path / "work", progress=False)
    assert again.run() == []  # everything recorded: a resumed run does nothing


def test_authored_stimuli_are_an_external_step_checked_item_by_item(tmp_path):
    raw = json.loads((REPO / "studies" / "interventions" / "plan_v2.json").read_text(encoding="utf-8"))
    p = tmp_path / "plan_v2.json"
    p.write_text(json.dumps(raw), encoding="utf-8")
    (tmp_path / "plan.json").write_bytes(PLAN.read_bytes())  # answers_from_plan names it
    s = Study(load_plan(p), tmp_path / "reports", tmp_path / "work", progress=False)
    assert s.answers_dir() == tmp_path / "work" / "interventions-0.5b-v1" / "answers"
    root = s.root
    root.mkdir(parents=True)
    convs = [{"item_id": f"gsm8k-{k:04d}", "split": "train", "dataset": "gsm8k", "query": "q", "answer": "a",
              "stop_reason": "end_of_turn", "n_answer_tokens": 3, "score": None, "gold": None} for k in range(3)]
    (root / "conversations_train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    (root / "items_train.json").write_text(json.dumps({"items": [c["item_id"] for c in convs]}), encoding="utf-8")
    s.ledger.record("train_answers", 1.0, [])
    state = {st.name: st for st in s.status()}
    assert state["train_stimuli"].state == "external" and "waits for" in state["train_stimuli"].note
    f = root / "train" / "stimuli_authored.jsonl"
    f.parent.mkdir(parents=True)
    rows = [{"item_id": c["item_id"], "react": "Why 3?", "ignore": "Thanks!", "ignore_kind": "generic"} for c in convs]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]), encoding="utf-8")
    assert s.authored_stimuli()[0] == [] and "1 train items missing" in s.authored_stimuli()[1]
    rows[2]["react"] = " "
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert "1 empty" in s.authored_stimuli()[1]
    rows[2]["react"] = "Why is the second step 3?"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert len(s.authored_stimuli()[0]) == 3


def test_reusing_answers_of_a_plan_with_another_cap_is_refused(tmp_path):
    raw = json.loads((REPO / "studies" / "interventions" / "plan_v2.json").read_text(encoding="utf-8"))
    (tmp_path / "plan_v2.json").write_text(json.dumps(raw), encoding="utf-8")
    v1 = json.loads(PLAN.read_text(encoding="utf-8"))
    v1["conversations"]["max_answer_tokens"] = 256
    (tmp_path / "plan.json").write_text(json.dumps(v1), encoding="utf-8")
    s = Study(load_plan(tmp_path / "plan_v2.json"), tmp_path / "reports", tmp_path / "work", progress=False)
    with pytest.raises(UserError, match="answers_from"):
        s.answers_dir()


def test_a_plan_that_changes_only_the_heldout_side_reuses_the_train_side(tmp_path):
    """plan_v2b takes v2's train outputs and labels (checked against v2's ledger), and refuses them when a field
    the train side depends on differs or a source file was changed."""
    src = REPO / "studies" / "interventions"
    for name in ("plan_v2.json", "plan_v2b.json"):
        (tmp_path / name).write_text((src / name).read_text(encoding="utf-8"), encoding="utf-8")
    rep = tmp_path / "reports"
    shutil.copytree(REPO / "reports" / "interventions" / "interventions-0.5b-v2", rep / "interventions-0.5b-v2")
    s = Study(load_plan(tmp_path / "plan_v2b.json"), rep, tmp_path / "work", progress=False)
    states = {st.name: st.state for st in s.status()}
    assert all(states[k] == "done" for k in ("train_answers", "train_stimuli", "train_turns", "train_sheet"))
    assert s.ledger.steps["train_turns"].info["reused_from"] == "interventions-0.5b-v2"
    assert (rep / "interventions-0.5b-v2b" / "train" / "labels").is_dir() and not s.ledger.verify()
    assert states["heldout_answers"] == "pending"

    raw = json.loads((tmp_path / "plan_v2b.json").read_text(encoding="utf-8"))
    raw["name"] = "other"
    raw["train"]["min_positives"] = 31
    (tmp_path / "plan_x.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(UserError, match="differs in train"):
        Study(load_plan(tmp_path / "plan_x.json"), rep, tmp_path / "work", progress=False)
    raw["train"]["min_positives"] = 30
    (tmp_path / "plan_x.json").write_text(json.dumps(raw), encoding="utf-8")
    f = rep / "interventions-0.5b-v2" / "train" / "turns.jsonl"
    f.write_text(f.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="no longer match"):
        Study(load_plan(tmp_path / "plan_x.json"), rep, tmp_path / "work", progress=False)


def test_a_plan_that_changes_only_code_reuses_the_steps_it_lists(tmp_path):
    """plan_v2c reuses v2b's steps up to the direction and reruns select from v2b's store of train turns; any
    change of a choice (not only the name and the story) refuses the reuse."""
    src = REPO / "studies" / "interventions"
    for name in ("plan_v2.json", "plan_v2b.json", "plan_v2c.json"):
        (tmp_path / name).write_text((src / name).read_text(encoding="utf-8"), encoding="utf-8")
    rep = tmp_path / "reports"
    for d in ("interventions-0.5b-v2", "interventions-0.5b-v2b"):
        shutil.copytree(REPO / "reports" / "interventions" / d, rep / d)
    s = Study(load_plan(tmp_path / "plan_v2c.json"), rep, tmp_path / "work", progress=False)
    states = {st.name: st.state for st in s.status()}
    assert states["direction"] == "done" and states["heldout_base"] == "done" and states["select"] == "pending"
    assert (rep / "interventions-0.5b-v2c" / "train" / "selection_turns.jsonl").is_file()
    raw = json.loads((tmp_path / "plan_v2c.json").read_text(encoding="utf-8"))
    raw["name"] = "other"
    raw["selection"]["alphas"] = [0.5]
    (tmp_path / "plan_x.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(UserError, match="differs in selection"):
        Study(load_plan(tmp_path / "plan_x.json"), rep, tmp_path / "work", progress=False)


def test_the_committed_selection_follows_from_its_committed_train_turns():
    """v2c's frozen alpha is the plan's rule applied to the committed steered train turns (it fails if the
    degenerate detector or the rule changes what was chosen)."""
    from mechprobe.steering.degenerate import degenerate_rate, largest_safe_alpha

    root = REPO / "reports" / "interventions" / "interventions-0.5b-v2c"
    plan = load_plan(REPO / "studies" / "interventions" / "plan_v2c.json")
    sel = json.loads((root / "selection.json").read_text(encoding="utf-8"))
    turns: dict[float, list[str]] = {}
    for line in (root / "train" / "selection_turns.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        turns.setdefault(float(r["alpha"]), []).append(r["turn"])
    chosen, base, tried = largest_safe_alpha(plan.selection["alphas"], lambda a: degenerate_rate(turns[a]),
                                             float(plan.selection["max_degenerate_increase"]))
    assert (chosen, base, tried) == (sel["alpha"], sel["degenerate_rate_base"], sel["degenerate_rate_by_alpha"])
    assert chosen == 0.5 and tried["2.0"] == 1.0  # the one-token loops at alpha 2.0 count as degenerate
