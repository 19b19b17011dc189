"""``experiments/steer.py --select-on-train`` on a tiny real run (the embedded 135M model, 12 builtin items).

Run in-process with the generation and NLL functions wrapped, so the test sees every set of items that is
ever steered: during selection only train items, and held-out items only at the chosen (layer, alpha).
Labels are written by the test (item-level) so the vectors exist whatever the judge would say.
"""

from __future__ import annotations

import json
import math

import pytest

from mechprobe.io import read_jsonl
from mechprobe.steering.evaluate import split_of
from mechprobe.turns.pipeline import ProbeConfig, run_probe
from tests.e2e.test_experiments import _write_labels

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(smol, tmp_path_factory):
    run = tmp_path_factory.mktemp("sel") / "run"
    cfg = ProbeConfig(dataset="builtin", limit=12, temperatures=[0.0, 1.0], samples=2, max_assistant_tokens=24,
                      max_user_tokens=10, batch_size=12)
    run_probe(cfg, run, lm=smol, progress=False)
    items = sorted({r["item_id"] for r in read_jsonl(run / "assistant.jsonl")})
    _write_labels(run, set(items[::2]))
    return run


def _script():
    """The experiment module (patched in place by the tests) with the command line's ``main`` attached."""
    import mechprobe.cli.steer as cli_steer
    import mechprobe.steering.experiment as exp
    exp.main = cli_steer.main
    return exp


def test_select_on_train_steers_heldout_only_at_the_chosen_setting(run_dir, tmp_path):
    """The default path (no flag): (layer, alpha) chosen on train items, held-out items steered only there."""
    import mechprobe.steering.conditions as conditions

    mod = _script()
    calls: list[tuple[str, list[str], int, float]] = []
    gen = mod.steered_user_turns

    def rec_gen(lm, items, vector, alpha, *args, **kw):
        if vector is not None and alpha != 0:
            calls.append(("gen", [x.item_id for x in items], vector.layer, alpha))
        return gen(lm, items, vector, alpha, *args, **kw)

    class RecScorer(mod.NllScorer):
        def __call__(self, prompts, conts, vector=None, alpha=0.0, *args, **kw):
            calls.append(("nll", [], vector.layer if vector is not None else -1, alpha))
            return super().__call__(prompts, conts, vector, alpha, *args, **kw)

    mod.steered_user_turns, mod.NllScorer = rec_gen, RecScorer
    conditions.steered_user_turns = rec_gen  # each condition's turns are generated there
    argv = ["--run", str(run_dir), "--candidate-layers", "10", "20", "--alpha", "0", "0.1",
            "1.0", "--select-items", "4", "--kinds", "diff_means,random,negative", "--acc-items", "3",
            "--max-degenerate", "1.0", "--figures", str(tmp_path),
            "--include-truncated"]  # 24-token answers all hit the cap; this test counts every held-out item
    assert mod.main(argv) == 0

    steering = run_dir / "steering"
    sel = json.loads((steering / "select.json").read_text())
    ch = (sel["chosen"]["layer"], sel["chosen"]["alpha"])
    assert len(sel["items"]) == 4 and all(split_of(i) == "train" for i in sel["items"])
    assert {(r["layer"], r["alpha"]) for r in sel["sweep"]} == {(la, al) for la in (10, 20) for al in (0.1, 1.0)}
    for r in sel["sweep"]:  # every kind and setting records its unit and push: |delta| = alpha x resid norm
        assert r["alpha_unit"] == "resid" and r["delta_norm"] == pytest.approx(r["alpha"] * r["resid_norm"], rel=1e-5)
    held = {x["item_id"] for x in read_jsonl(run_dir / "assistant.jsonl") if split_of(x["item_id"]) == "heldout"}
    assert held
    for what, ids, layer, alpha in calls:
        if set(ids) & held:
            assert (layer, alpha) == ch, f"held-out items steered at unchosen setting L{layer} a{alpha}"
        elif what == "gen":
            assert set(ids) <= set(sel["items"]), "selection steered items outside its train subset"
    assert any(set(ids) & held for _, ids, _, _ in calls)
    assert "Chosen: layer" in (steering / "select.md").read_text()

    res = json.loads((steering / "results.json").read_text())
    assert res["layer"] == ch[0] and res["alphas"] == [0.0, ch[1]] and res["alpha_unit"] == "resid"
    rows = res["heldout"]
    assert {r["kind"] for r in rows} == {"diff_means", "random", "negative"}
    steered = [r for r in rows if r["alpha"] != 0]
    # Equal norm at equal alpha in resid units: |delta| = alpha x resid norm for every kind.
    for r in steered:
        assert r["delta_norm"] == pytest.approx(ch[1] * res["resid_norm"], rel=1e-5)
        assert r["delta_over_resid"] == pytest.approx(ch[1], rel=1e-5)
    for r in rows:
        m = r["mcnemar"]
        assert m["n_paired"] == r["n"] == len(held) and 0.0 <= m["p"] <= 1.0
        for lo, hi in (r["ci"], r["degenerate_ci"]):
            assert 0.0 <= lo <= hi <= 1.0
        assert r["nll_unsteered_text"] is not None and math.isfinite(r["nll_unsteered_text"])
        if r["alpha"] == 0:
            assert m["b"] == m["c"] == 0 and m["p"] == 1.0
    dm = next(r for r in steered if r["kind"] == "diff_means")
    base = next(r for r in rows if r["alpha"] == 0)
    assert dm["task_accuracy"] is not None and base["task_accuracy"] is not None
    assert dm["nll_unsteered_text"] != pytest.approx(base["nll_unsteered_text"], abs=1e-6)
    md = (steering / "results.md").read_text()
    assert "McNemar" in md and "NLL unsteered text" in md and "task accuracy" in md
    assert (tmp_path / f"steer_{run_dir.name}.png").stat().st_size > 10_000

    # Resume: a second run generates nothing new and gives the same table.
    calls.clear()
    assert mod.main(argv) == 0
    assert not [c for c in calls if c[0] == "gen"]
    assert json.loads((steering / "results.json").read_text())["heldout"] == rows
