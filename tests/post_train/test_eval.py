"""Before/after statistics of post-training on hand-made runs (no model needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mechprobe.post_train import boundary
from mechprobe.post_train import evaluate as ev


def test_mcnemar_exact_known_values():
    assert ev.mcnemar_exact(0, 0) == 1.0
    assert ev.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    # 2 * P(X <= 1), X ~ Bin(10, 1/2) = 2 * 11 / 1024
    assert ev.mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert ev.mcnemar_exact(9, 1) == ev.mcnemar_exact(1, 9)
    assert ev.mcnemar_exact(4, 4) == 1.0
    with pytest.raises(ValueError):
        ev.mcnemar_exact(-1, 2)


def _write(run: Path, genuine: dict[str, bool | None], scores: list[float | None]) -> Path:
    run.mkdir(parents=True)
    turns = [{"record_id": rid, "item_id": rid.split("|")[0], "decoding": "greedy" if "greedy" in rid else "sample"}
             for rid in genuine]
    (run / "user_turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    labs = [{"record_id": rid, "genuine": g, "label": "judge_error" if g is None else
             ("genuine_followup" if g else "new_query")} for rid, g in genuine.items()]
    (run / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labs))
    (run / "assistant.jsonl").write_text("".join(json.dumps({"item_id": f"i{k}", "score": s}) + "\n"
                                                 for k, s in enumerate(scores)))
    return run


def test_rates_paired_and_accuracy(tmp_path):
    ids = [f"i{k}|greedy|s0" for k in range(6)] + [f"i{k}|T1|s0" for k in range(6)]
    base = dict.fromkeys(ids, False)
    base[ids[0]] = True
    post = dict.fromkeys(ids, True)
    post[ids[6]] = None  # judge error: left out of rates and pairs
    rb = _write(tmp_path / "b", base, [1.0, 0.0, None])
    rp = _write(tmp_path / "p", post, [0.0, 0.0, 1.0])
    fb, fp = ev.followup_rates(rb), ev.followup_rates(rp)
    assert (fb["greedy"].k, fb["greedy"].n) == (1, 6)
    assert (fp["sample"].k, fp["sample"].n) == (5, 5)
    assert fp["sample"].ci[1] == 1.0 and fp["sample"].ci[0] < 1.0
    acc = ev.task_accuracy(rb)
    assert (acc.k, acc.n) == (1, 2)
    pairs = {p.decoding: p for p in ev.paired_arm_test(rb, rp)}
    g, s = pairs["greedy"], pairs["sample"]
    assert (g.n, g.both, g.only_a, g.only_b) == (6, 1, 0, 5)
    assert g.p == pytest.approx(2 / 32)
    assert (s.n, s.only_b) == (5, 5)
    assert ev.label_distribution(rp) == {"genuine_followup": 11, "judge_error": 1}
    summ = ev.arm_summary({"gsm8k": rb})
    assert summ["all"]["followup"]["greedy"]["k"] == 1


def test_boundary_shift_recovers_planted_shift(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    items = [f"i{k}" for k in range(40)]
    base_vals = {i: float(rng.normal()) for i in items}
    gap = 2.0
    # The other arm sits half a class gap further along the direction, plus item noise.
    other_vals = {i: v + 0.5 * gap + float(rng.normal(scale=0.1)) for i, v in base_vals.items()}

    def fake(run, layer, unit):
        assert math.isclose(float(np.linalg.norm(unit)), 1.0, rel_tol=1e-6)
        return base_vals if run.name == "base" else other_vals

    monkeypatch.setattr(boundary, "_item_means", fake)
    d = np.zeros(8, dtype=np.float32)
    d[0] = gap
    rows = ev.boundary_shift(tmp_path / "base", tmp_path / "post", {3: d}, n_boot=500)
    assert len(rows) == 1 and rows[0]["n_items"] == 40
    assert rows[0]["shift_gap"] == pytest.approx(0.5, abs=0.05)
    assert rows[0]["ci_gap"][0] < rows[0]["shift_gap"] < rows[0]["ci_gap"][1]
    assert rows[0]["ci_gap"][0] > 0.4


def test_paired_test_keeps_only_selected_items(tmp_path):
    ids = [f"i{k}|greedy|s0" for k in range(4)]
    rb = _write(tmp_path / "b", dict.fromkeys(ids, False), [])
    rp = _write(tmp_path / "p", dict.fromkeys(ids, True), [])
    g = {p.decoding: p for p in ev.paired_arm_test(rb, rp, keep=lambda i: i in ("i1", "i3"))}["greedy"]
    assert (g.n, g.only_b) == (2, 2)
    assert {p.decoding: p for p in ev.paired_arm_test(rb, rp)}["greedy"].n == 4


def _args(**kw):
    import argparse

    from mechprobe.cli.post_train import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    a = ev.PostTrainConfig.from_namespace(p.parse_args([]))
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_steer_result_resolution(tmp_path, monkeypatch):
    """--steer-run wins; else an existing result in <out>/steer-gsm8k; else built (or skipped with --no-steer)."""
    monkeypatch.chdir(tmp_path)  # runs/<model>-gsm8k resolves under here: absent
    out = tmp_path / "out"
    notes: list[str] = []
    built: list[Path] = []
    monkeypatch.setattr(ev, "build_steering", lambda model, run, judge: built.append(run))
    assert ev._steer_result(_args(steer_run="elsewhere"), out, "offline", notes) == \
        Path("elsewhere") / "steering" / "results.json"
    assert ev._steer_result(_args(no_steer=True), out, "offline", notes) is None
    assert notes == ["baked steering arm skipped (no_steer=True)"] and not built
    res = ev._steer_result(_args(), out, "offline", notes)
    assert built == [out / "steer-gsm8k"] and res == out / "steer-gsm8k" / "steering" / "results.json"
    res.parent.mkdir(parents=True)
    res.write_text("{}")
    built.clear()
    assert ev._steer_result(_args(), out, "offline", notes) == res and not built  # reused, not rebuilt


def test_judge_defaults_to_the_best_available(monkeypatch):
    """No --judge means auto: the research default (the hidden-state judge) when its reader is fetched, else offline (never a silent weaker default on a
    machine that has the better judge) for any model but the embedded default (whose fast path is offline)."""
    from mechprobe.judges import factory as jm

    assert _args().judge == "auto"
    monkeypatch.delenv("MECHPROBE_JUDGE_MODEL", raising=False)
    monkeypatch.setattr(jm, "model_unavailable", lambda m: None)
    assert jm.default_judge("qwen2.5-coder-0.5b-instruct") == jm.BEST_JUDGE
    assert jm.default_judge("smollm2-135m-instruct") == "offline"
    monkeypatch.setattr(jm, "model_unavailable", lambda m: None)
    assert jm.best_judge() == jm.BEST_JUDGE
    monkeypatch.setattr(jm, "model_unavailable", lambda m: "not fetched")
    assert jm.best_judge() == "offline"
