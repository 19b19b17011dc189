"""The committed GSM8K steering split, and the frozen steering setting.

Fast tests check the split file (regenerates bit for bit, disjoint lists, only rows >= 500) and the freeze rule;
the slow test runs the steering experiment on the embedded 135M model with a split file of builtin items: a
second run with another alpha in the same directory is refused before any generation, held-out items come
only from the split's held-out list and selection only from its train list.
"""

from __future__ import annotations

import json

import pytest

from mechprobe.errors import UserError
from mechprobe.io import read_jsonl
from mechprobe.splits import (
    SPLIT_FORMAT,
    STEERING_SPLIT,
    STEERING_SPLIT_RULE,
    draw_item_split,
    load_split,
    split_text,
)
from mechprobe.stages import finding_split
from mechprobe.steering.evaluate import select_on_train
from mechprobe.steering.setting import SETTING_FILE, check_setting, freeze_setting
from tests.conftest import REPO, shared_data_dir


def test_committed_split_regenerates_bit_for_bit():
    data = shared_data_dir() or (REPO.parent / "shared" / "data")
    src = data / STEERING_SPLIT_RULE["source"]
    if not src.exists():
        pytest.skip("GSM8K test file not found (shared/data)")
    assert split_text(draw_item_split(src, **STEERING_SPLIT_RULE)) == STEERING_SPLIT.read_text()


def test_committed_split_is_disjoint_and_avoids_the_items_earlier_runs_used():
    sp = load_split(STEERING_SPLIT)
    d = json.loads(STEERING_SPLIT.read_text())
    assert d["format"] == SPLIT_FORMAT and d["seed"] == STEERING_SPLIT_RULE["seed"] and len(d["source"]["sha256"]) == 64
    assert len(sp.heldout) == 120 and len(sp.train) == 120 and not set(sp.heldout) & set(sp.train)
    assert all(i.startswith("gsm8k-") and int(i.split("-")[1]) >= 500 for i in (*sp.heldout, *sp.train))
    assert finding_split("qwen2.5-1.5b-instruct", "gsm8k") == str(STEERING_SPLIT)
    assert finding_split(None, "gsm8k") is None and finding_split("qwen2.5-1.5b-instruct", "builtin") is None


def test_frozen_setting_refuses_another_alpha_and_names_the_fix(tmp_path):
    setting = {"alpha_unit": "resid", "requested_alphas": [0.0, 0.1], "layer": 3, "alphas": [0.0, 0.1],
               "kinds": ["diff_means"], "positions": "boundary", "judge": "offline"}
    sha = freeze_setting(tmp_path, setting)
    assert json.loads((tmp_path / SETTING_FILE).read_text())["sha256"] == sha
    assert freeze_setting(tmp_path, dict(setting)) == sha  # the same setting passes
    with pytest.raises(UserError, match=r"requested_alphas=.*steer_dir=NEW_DIR"):
        check_setting(tmp_path, {**setting, "requested_alphas": [0.0, 0.2]})
    with pytest.raises(UserError, match="layer"):
        freeze_setting(tmp_path, {**setting, "layer": 4})
    d = json.loads((tmp_path / SETTING_FILE).read_text())
    d["setting"]["layer"] = 9
    (tmp_path / SETTING_FILE).write_text(json.dumps(d))
    with pytest.raises(UserError, match="edited by hand"):
        check_setting(tmp_path, setting)


def test_selection_with_a_split_file_takes_only_its_train_ids():
    class It:
        def __init__(self, i):
            self.item_id = i

    def run_setting(items, layer, alpha):
        return {"followup_rate": 0.5, "degenerate_rate": 0.0}

    sel = select_on_train(run_setting, [It("a"), It("b")], [1], [0.0, 0.1], 0.2, train_ids={"a", "b"})
    assert sel["items"] == ["a", "b"]
    with pytest.raises(ValueError, match="train items only"):
        select_on_train(run_setting, [It("a"), It("h")], [1], [0.0, 0.1], 0.2, train_ids={"a", "b"})


@pytest.mark.slow
def test_split_file_ids_and_refusal_before_generation(smol, tmp_path):
    from mechprobe.turns.pipeline import ProbeConfig, run_probe
    from tests.e2e.test_experiments import _write_labels

    run = tmp_path / "run"
    run_probe(ProbeConfig(dataset="builtin", limit=12, temperatures=[0.0, 1.0], samples=2, max_assistant_tokens=24,
                          max_user_tokens=8, batch_size=12), run, lm=smol, progress=False)
    items = sorted({r["item_id"] for r in read_jsonl(run / "assistant.jsonl")})
    _write_labels(run, set(items[::2]))
    split = {"format": SPLIT_FORMAT, "name": "builtin_test", "dataset": "builtin", "heldout": items[8:11],
             "train": items[4:7]}
    split_p = tmp_path / "split.json"
    split_p.write_text(json.dumps(split))

    import mechprobe.cli.steer as cli_steer
    import mechprobe.steering.conditions as exp  # where each condition's turns are generated

    calls: list[tuple[list[str], float]] = []
    gen = exp.steered_user_turns

    def rec_gen(lm, its, vector, alpha, *args, **kw):
        calls.append(([x.item_id for x in its], alpha if vector is not None else 0.0))
        return gen(lm, its, vector, alpha, *args, **kw)

    exp.steered_user_turns = rec_gen
    try:
        base = ["--run", str(run), "--candidate-layers", "10", "--select-items", "3", "--kinds", "diff_means",
                "--no-assistant-check", "--max-degenerate", "1.0", "--split-file", str(split_p),
                "--figures", str(tmp_path / "fig")]
        assert cli_steer.main([*base, "--alpha", "0", "0.1"]) == 0
        steer = run / "steering"
        sel = json.loads((steer / "select.json").read_text())
        assert set(sel["items"]) <= set(split["train"])
        res = json.loads((steer / "results.json").read_text())
        assert res["split"]["sha256"] and (steer / SETTING_FILE).exists()
        held = set(split["heldout"])
        for ids, _ in calls:
            assert set(ids) <= set(split["train"]) or set(ids) <= held, ids
        assert {i for ids, _ in calls for i in ids} & held
        n = len(calls)
        with pytest.raises(UserError, match="requested_alphas"):
            cli_steer.run(cli_steer.build_parser().parse_args([*base, "--alpha", "0", "0.2"]))
        assert len(calls) == n  # refused before any generation
    finally:
        exp.steered_user_turns = gen


def test_reports_name_the_split_without_a_machine_path():
    from mechprobe.splits import STEERING_SPLIT, load_split

    s = load_split(STEERING_SPLIT)
    assert s.display_path == "mechprobe/data/splits/gsm8k_steering_v1.json"
    assert not s.display_path.startswith("/")
