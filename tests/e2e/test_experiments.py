"""The experiment scripts as a user runs them, on a small real run (real model, real activations).

Labels are written by the test (item-level, so the outcome does not depend on the judge's verdicts on a
tiny run); the scripts must reuse them, cache activations, and produce metrics, directions, steering
rows and figures. The steering script's alpha-0 condition must reproduce the run's own greedy turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mechprobe.io import JsonlStore, read_jsonl
from mechprobe.judges.factory import make_judge
from mechprobe.records import LabelRecord
from mechprobe.steering.evaluate import split_of
from mechprobe.turns.pipeline import ProbeConfig, run_probe
from tests.conftest import REPO

pytestmark = pytest.mark.slow

MAX_USER = 12


@pytest.fixture(scope="module")
def small_run(smol, tmp_path_factory):
    run = tmp_path_factory.mktemp("exp") / "run"
    cfg = ProbeConfig(dataset="builtin", limit=12, temperatures=[0.0, 1.0], samples=2, max_assistant_tokens=32,
                      max_user_tokens=MAX_USER, batch_size=12)
    run_probe(cfg, run, lm=smol, progress=False)
    return run


def _write_labels(run, genuine_items):
    name = make_judge("offline").name
    p = run / "labels.jsonl"
    if p.exists():
        p.unlink()
    st = JsonlStore(p, key="record_id")
    for r in read_jsonl(run / "user_turns.jsonl"):
        g = r["item_id"] in genuine_items
        st.append(LabelRecord(record_id=r["record_id"], label="genuine_followup" if g else "new_query", genuine=g,
                              rationale="test label", judge=name).to_dict())


def _py(*args, check=True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, check=check)


def test_linear_probe_and_steer_scripts(small_run, tmp_path):
    items = sorted({r["item_id"] for r in read_jsonl(small_run / "assistant.jsonl")})
    _write_labels(small_run, set(items[::2]))
    figs = tmp_path / "figs"
    p = _py("experiments/linear_probe.py", "--run", str(small_run), "--layers", "0,10,20,30", "--folds", "3",
            "--figures", str(figs))
    assert "best layer" in p.stdout, p.stdout + p.stderr
    m = json.loads((small_run / "probes" / "metrics.json").read_text())
    assert m["status"] == "ok" and [r["layer"] for r in m["per_layer"]] == [0, 10, 20, 30]
    assert set(m["controls"]) >= {"random_direction", "text_baseline"}
    for r in m["per_layer"]:
        assert 0.0 <= r["logreg_auroc"]["lo"] <= r["logreg_auroc"]["value"] <= r["logreg_auroc"]["hi"] <= 1.0
    assert (figs / f"linear_probe_{small_run.name}.png").stat().st_size > 10_000
    assert (small_run / "activations" / "manifest.json").exists()
    from safetensors.numpy import load_file

    d = load_file(str(small_run / "probes" / "directions.safetensors"))
    assert d["probe_10"].shape == (576,) and d["diff_means_20"].shape == (576,)

    p = _py("experiments/steer.py", "--run", str(small_run), "--layer", "10", "--alpha", "0", "2", "--no-select-on-train",
            "--max-user-tokens", str(MAX_USER), "--no-assistant-check", "--kinds", "diff_means,random",
            "--figures", str(figs))
    res = json.loads((small_run / "steering" / "results.json").read_text())
    assert res["layer"] == 10 and {r["kind"] for r in res["heldout"]} == {"diff_means", "random"}
    assert (figs / f"steer_{small_run.name}.png").exists()
    # alpha 0 reproduces the run's own greedy user turns on held-out items, token for token (as text).
    greedy = {r["item_id"]: r for r in read_jsonl(small_run / "user_turns.jsonl") if r["decoding"] == "greedy"}
    zero = read_jsonl(small_run / "steering" / "alpha_0_none.jsonl")
    assert zero and all(split_of(z["item_id"]) == "heldout" for z in zero)
    for z in zero:
        assert z["raw_text"] == greedy[z["item_id"]]["raw_text"]
    # alpha is in resid units by default: steered rows live under the setting's folder (layer, positions, unit).
    assert res["alpha_unit"] == "resid"
    steered = small_run / "steering" / "L10_boundary+generated_resid" / "alpha_2_diff_means.jsonl"
    assert len(read_jsonl(steered)) == len(zero)


def test_steer_script_on_the_llamacpp_engine(small_run, tmp_path):
    """--steer-engine llamacpp steers with control vectors, writes apart from the HF rows, and alpha 0 is the
    engine's own unsteered greedy turn, token for token."""
    pytest.importorskip("llama_cpp")
    from mechprobe.lm import chat
    from mechprobe.lm.llamacpp import LlamaCppBroken, load_engine

    try:
        lm, eng = load_engine("smollm2-135m-instruct")
    except LlamaCppBroken as e:
        pytest.skip(str(e))
    items = sorted({r["item_id"] for r in read_jsonl(small_run / "assistant.jsonl")})
    _write_labels(small_run, set(items[::2]))
    p = _py("experiments/steer.py", "--run", str(small_run), "--layer", "10", "--alpha", "0", "2", "--no-select-on-train",
            "--max-user-tokens", str(MAX_USER), "--no-assistant-check", "--kinds", "diff_means",
            "--steer-engine", "llamacpp", "--figures", str(tmp_path), check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    out = small_run / "steering_llamacpp"
    res = json.loads((out / "results.json").read_text())
    assert res["layer"] == 10 and {r["kind"] for r in res["heldout"]} == {"diff_means"}
    zero = read_jsonl(out / "alpha_0_none.jsonl")
    steered = read_jsonl(out / "L10_boundary+generated_resid" / "alpha_2_diff_means.jsonl")
    assert zero and len(steered) == len(zero)
    asst = {r["item_id"]: r for r in read_jsonl(small_run / "assistant.jsonl")}
    prompts = [chat.build_probe_prompt(lm.tokenizer, asst[z["item_id"]]["prompt"], asst[z["item_id"]]["response"]
                                       ).input_ids for z in zero]
    stops = chat.stop_token_ids(lm.tokenizer, lm.model)
    mine = eng.decode_batch(prompts, stop_ids=stops, max_new_tokens=MAX_USER, temperatures=0.0)
    assert [z["token_ids"] for z in zero] == [g.token_ids for g in mine]
    assert any(s["token_ids"] != z["token_ids"] for s, z in zip(steered, zero))  # alpha 2 x resid norm moves text


def test_linear_probe_refuses_to_report_noise(small_run, tmp_path):
    items = sorted({r["item_id"] for r in read_jsonl(small_run / "assistant.jsonl")})
    _write_labels(small_run, {items[0]})
    p = _py("experiments/linear_probe.py", "--run", str(small_run), "--layers", "5", "--figures",
            str(tmp_path), check=False)
    assert p.returncode == 3
    assert "Not reporting probe metrics" in p.stderr and "positive rows" in p.stderr
    m = json.loads((small_run / "probes" / "metrics.json").read_text())
    assert m["status"] == "insufficient_positives"


SYSTEM = "You are a terse tutor. Answer in one line."
SYS_MAX_USER = 10


@pytest.fixture(scope="module")
def system_run(smol, tmp_path_factory):
    """A run with its own system prompt and user-token cap, neither of them the scripts' defaults."""
    run = tmp_path_factory.mktemp("sys") / "run"
    cfg = ProbeConfig(dataset="builtin", limit=8, temperatures=[0.0, 1.0], samples=2, max_assistant_tokens=24,
                      max_user_tokens=SYS_MAX_USER, system=SYSTEM, batch_size=8)
    run_probe(cfg, run, lm=smol, progress=False)
    return run


def _files(run):
    return {n: (run / n).read_bytes() for n in ("assistant.jsonl", "user_turns.jsonl")}


def test_item6_steer_on_existing_run_adds_nothing_and_uses_its_system_prompt_and_caps(system_run, tmp_path):
    items = sorted({r["item_id"] for r in read_jsonl(system_run / "assistant.jsonl")})
    train = [i for i in items if split_of(i) == "train"]
    heldout = [i for i in items if split_of(i) == "heldout"]
    assert len(train) >= 2 and heldout, "the fixed builtin ids must give both splits"
    _write_labels(system_run, set(train[::2]) | set(heldout[::2]))
    before = _files(system_run)
    p = _py("experiments/steer.py", "--run", str(system_run), "--layer", "10", "--alpha", "0", "2", "--no-select-on-train",
            "--no-assistant-check", "--kinds", "diff_means", "--figures", str(tmp_path), check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _files(system_run) == before  # no item generated, judged or cached into the user's run
    assert len(read_jsonl(system_run / "labels.jsonl")) == len(read_jsonl(system_run / "user_turns.jsonl"))
    # alpha 0 reproduces the run's own greedy turns: same system prompt, same user-token cap.
    greedy = {r["item_id"]: r for r in read_jsonl(system_run / "user_turns.jsonl") if r["decoding"] == "greedy"}
    zero = read_jsonl(system_run / "steering" / "alpha_0_none.jsonl")
    assert {z["item_id"] for z in zero} == set(heldout)
    for z in zero:
        assert z["raw_text"] == greedy[z["item_id"]]["raw_text"]


def test_steer_advice_names_only_flags_that_exist(system_run, tmp_path):
    import argparse
    import re

    from mechprobe.cli.linear_probe import add_args

    _write_labels(system_run, set())  # no genuine follow-up at all: a difference of means is impossible
    # its own steering directory: the fixture run's steering/ is frozen at another test's setting
    p = _py("experiments/steer.py", "--run", str(system_run), "--layer", "10", "--alpha", "2",
            "--no-assistant-check", "--figures", str(tmp_path), "--steer-dir", str(tmp_path / "steer"), check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()[-1]
    assert "genuine follow-ups" in err
    flags = set(re.findall(r"(--[a-z][a-z-]+)", err))
    assert flags, err
    if "linear_probe.py" in err or "mechprobe probes" in err:  # advice to re-run the probes command
        parser = argparse.ArgumentParser()
        add_args(parser)
    else:  # advice without a command is advice about steer.py's own flags
        import mechprobe.cli.steer as mod
        parser = mod.build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    assert flags <= known, f"advice names flags the command does not have: {sorted(flags - known)}"
