"""Steering judged properly: alpha in residual-norm units, selection on train items only, paired statistics.

Fast tests on a tiny random-init Llama and synthetic records. Oracles: in ``resid`` units every kind adds a
vector of exactly ``alpha x resid_norm`` (read back from ``output_hidden_states``); the steered NLL of a
continuation equals a token-by-token replay under the same hooks (the positions generation uses); the
selection sweep never sees a held-out item and follows its documented rule; McNemar counts are the
discordant pairs.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from mechprobe.errors import UsageError
from mechprobe.lm.forward import kv_kw, out_cache, tiny_model
from mechprobe.lm.generation import left_pad
from mechprobe.records import AssistantRecord
from mechprobe.stats import mcnemar_exact
from mechprobe.steering.evaluate import (
    NllScorer,
    SteeredTurn,
    choose_setting,
    paired_vs_base,
    select_on_train,
    split_of,
    steered_nll,
    summarize,
    turn_nll,
)
from mechprobe.steering.vector import diff_of_means, from_direction, in_alpha_units, steer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
CONTS = [[20, 21, 22, 23], [30], [40, 41, 42, 43, 44, 45]]
LAYER = 2


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.2 (default 0.02): near-uniform attention at the default would hide a wrong
    # position id or a wrongly steered position behind differences < 1e-4.
    return tiny_model("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def lm(model):
    return SimpleNamespace(model=model, tokenizer=SimpleNamespace(pad_token_id=0))


def _hidden(model, prompts, layer):
    ids, mask, pos = left_pad(prompts, 0, torch.device("cpu"))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    return out.hidden_states[layer]


def _kinds(model):
    """diff_means / random / negative / probe vectors from the tiny model's own boundary states."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 127, (6,), generator=g).tolist() for _ in range(12)]
    x = _hidden(model, prompts, LAYER)[:, -1]
    dm = diff_of_means(x[:6], x[6:], LAYER)
    probe = from_direction(torch.randn(x.shape[1], generator=g), dm, kind="probe")
    return dm, [dm, dm.random_like(0), dm.negated(), probe]


def test_resid_units_give_every_kind_exactly_alpha_times_resid_norm(model):
    dm, vecs = _kinds(model)
    r = dm.resid_norm
    assert r and r > 0
    alpha = 0.3
    for v in vecs:
        u = in_alpha_units(v, "resid")
        assert u.metadata["alpha_unit"] == "resid" and u.metadata["resid_norm"] == pytest.approx(r)
        assert u.kind == v.kind and u.layer == v.layer
        # Same direction, norm exactly the yardstick (float32 rescale: relative error ~1e-7).
        assert float(torch.nn.functional.cosine_similarity(u.vector, v.vector, dim=0)) == pytest.approx(1, abs=1e-6)
        assert u.norm == pytest.approx(r, rel=1e-6)
        # What steering actually adds at the boundary, read back from the residual stream.
        base = _hidden(model, PROMPTS, LAYER)
        with steer(model, u, alpha, "boundary", unit="raw"):
            moved = _hidden(model, PROMPTS, LAYER)
        delta = (moved - base)[:, -1]
        # Tolerance: h + d - h in float32 loses ~1e-7 x |h| per entry; |h| ~ r here.
        assert torch.allclose(delta.norm(dim=-1), torch.full((len(PROMPTS),), alpha * r), rtol=1e-4)
        assert torch.allclose((moved - base)[:, :-1], torch.zeros_like((moved - base)[:, :-1]), atol=1e-5)


def test_raw_units_keep_the_caa_vector_and_bad_units_are_named():
    v = diff_of_means(torch.randn(4, 8) + 1, torch.randn(4, 8), 1)
    raw = in_alpha_units(v, "raw")
    assert torch.equal(raw.vector, v.vector) and raw.metadata["alpha_unit"] == "raw"
    with pytest.raises(UsageError, match="alpha unit"):
        in_alpha_units(v, "percent")
    bare = type(v)(v.vector, 1, "diff_means", {})
    with pytest.raises(UsageError, match="resid_norm"):
        in_alpha_units(bare, "resid")
    assert in_alpha_units(bare, "resid", resid_norm=2.0).norm == pytest.approx(2.0, rel=1e-6)


def _replay_nll(model, prompt, cont, vec, alpha, positions):
    """Reference: prefill, then one forward per token on the KV cache -- exactly how generation runs."""
    from transformers import DynamicCache

    lps = []
    with steer(model, vec, alpha, positions, unit="raw"), torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=torch.tensor([prompt]), **kv_kw(model, cache), use_cache=True)
        for t in cont:
            lps.append(torch.log_softmax(out.logits[0, -1].float(), -1)[t])
            out = model(input_ids=torch.tensor([[t]]), **kv_kw(model, out_cache(out)), use_cache=True)
    return float(-torch.stack(lps).mean())


@pytest.mark.parametrize("positions", ["boundary", "generated", "boundary+generated", "all"])
def test_steered_nll_matches_token_by_token_replay_and_batching(model, lm, positions):
    dm, _ = _kinds(model)
    u = in_alpha_units(dm, "resid")
    got = steered_nll(lm, PROMPTS, CONTS, u, 0.5, positions)
    one = [steered_nll(lm, [p], [c], u, 0.5, positions)[0] for p, c in zip(PROMPTS, CONTS)]
    ref = [_replay_nll(model, p, c, u, 0.5, positions) for p, c in zip(PROMPTS, CONTS)]
    # Tolerance 1e-4: padded batch vs unpadded single rows differ only by float32 summation order.
    assert got == pytest.approx(ref, abs=1e-4)
    assert one == pytest.approx(ref, abs=1e-4)
    unsteered = steered_nll(lm, PROMPTS, CONTS, None, 0.0, positions)
    assert any(abs(g - s) > 1e-3 for g, s in zip(got, unsteered)), "a 0.5 x resid push changed no likelihood"


def test_steered_nll_at_alpha_zero_is_the_unsteered_nll(model, lm):
    dm, _ = _kinds(model)
    zero = steered_nll(lm, PROMPTS, CONTS, in_alpha_units(dm, "resid"), 0.0, "boundary+generated")
    assert zero == pytest.approx(turn_nll(lm, PROMPTS, CONTS), abs=1e-4)
    assert steered_nll(lm, PROMPTS[:2], [[], [7]], None, 0.0, "all")[0] is None


@pytest.mark.parametrize("positions", ["boundary+generated", "generated", "all"])
def test_nll_scorer_with_shared_prefixes_equals_steered_nll(model, lm, positions):
    """The prefix-sharing scorer == :func:`steered_nll` (itself == a token-by-token replay), steered or not,
    in batches of rows with different prompt lengths, and again from its kept prefixes (which must not have
    been changed by the first scores). Other positions fall back to steered_nll (equal by construction)."""
    dm, _ = _kinds(model)
    u = in_alpha_units(dm, "resid")
    sc = NllScorer(lm, batch_size=2)  # 2: the three rows span two batches, one of them ragged
    for _ in range(2):
        # Tolerance 1e-4: left-padded keys/values vs unpadded rows differ only by float32 summation order.
        assert sc(PROMPTS, CONTS) == pytest.approx(turn_nll(lm, PROMPTS, CONTS), abs=1e-4)
        got = sc(PROMPTS, CONTS, u, 0.5, positions)
        assert got == pytest.approx(steered_nll(lm, PROMPTS, CONTS, u, 0.5, positions), abs=1e-4)
    assert len(sc._kv) == len(PROMPTS)  # one kept prefix per prompt, reused by every later score
    assert sc(PROMPTS[:2], [[], [7]])[0] is None
    assert sc(PROMPTS, CONTS, u, 0.0, positions) == pytest.approx(sc(PROMPTS, CONTS), abs=1e-6)


def test_nll_scorer_bounds_its_kept_prefixes(model, lm):
    sc = NllScorer(lm, max_items=2)
    ref = turn_nll(lm, PROMPTS, CONTS)
    assert sc(PROMPTS, CONTS) == pytest.approx(ref, abs=1e-4)
    assert len(sc._kv) <= 2
    assert sc(PROMPTS[::-1], CONTS[::-1]) == pytest.approx(ref[::-1], abs=1e-4)  # evicted ones recomputed


def test_turn_nll_in_chunks_on_kept_positions_equals_the_full_logits_computation(model, lm):
    """The memory-bounded turn_nll (chunks, LM head on the continuation's positions) == full logits, any chunking.

    Tolerance 1e-4: padding and chunking change only the float32 summation order."""
    ref = []
    for p, c in zip(PROMPTS, CONTS):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits.float(), -1)[0]
        ref.append(float(-torch.stack([logp[len(p) - 1 + j, t] for j, t in enumerate(c)]).mean()))
    assert turn_nll(lm, PROMPTS, CONTS) == pytest.approx(ref, abs=1e-4)
    assert turn_nll(lm, PROMPTS, CONTS, batch_size=1) == pytest.approx(ref, abs=1e-4)
    assert turn_nll(lm, PROMPTS + [[3, 4]], CONTS + [[]], batch_size=2)[-1] is None


def _records(n=40):
    return [AssistantRecord(item_id=f"it{i}", dataset="builtin", prompt=f"q{i}", response="a",
                            stop_reason="end_of_turn", n_tokens=1) for i in range(n)]


def test_selection_sees_train_items_only_and_sweeps_every_setting():
    recs = _records()
    train = [x for x in recs if split_of(x.item_id) == "train"]
    held = {x.item_id for x in recs if split_of(x.item_id) == "heldout"}
    assert train and held
    calls = []

    def run_setting(items, layer, alpha):
        calls.append(([x.item_id for x in items], layer, alpha))
        rate = {0.1: 0.2, 0.4: 0.5, 0.8: 0.9}[alpha] + (0.05 if layer == 3 else 0.0)
        deg = 0.6 if alpha == 0.8 else 0.1  # the highest rate breaks the text: must not be chosen
        return {"followup_rate": rate, "degenerate_rate": deg}

    sel = select_on_train(run_setting, train[:8], [2, 3], [0.0, 0.1, 0.4, 0.8], max_degenerate=0.2)
    assert {(la, al) for _, la, al in calls} == {(la, al) for la in (2, 3) for al in (0.1, 0.4, 0.8)}
    assert all(not set(ids) & held for ids, _, _ in calls)
    assert all(ids == [x.item_id for x in train[:8]] for ids, _, _ in calls)
    assert sel["chosen"] == {"layer": 3, "alpha": 0.4} and sel["cap_met"]
    assert set(sel["items"]).isdisjoint(held)
    with pytest.raises(ValueError, match="train items only"):
        select_on_train(run_setting, recs, [2], [0.4], 0.2)


def test_choose_setting_rule():
    rows = [dict(layer=4, alpha=0.2, followup_rate=0.5, degenerate_rate=0.1),
            dict(layer=2, alpha=0.4, followup_rate=0.5, degenerate_rate=0.1),
            dict(layer=2, alpha=0.1, followup_rate=0.5, degenerate_rate=0.0),
            dict(layer=2, alpha=0.8, followup_rate=0.7, degenerate_rate=0.5)]
    best, ok = choose_setting(rows, 0.2)
    assert ok and (best["layer"], best["alpha"]) == (2, 0.1)  # tie on rate -> less degenerate
    best, ok = choose_setting(rows[:2], 0.2)
    assert ok and (best["layer"], best["alpha"]) == (4, 0.2)  # tie on rate and degeneration -> smaller alpha
    best, ok = choose_setting(rows[3:], 0.2)
    assert not ok and best["alpha"] == 0.8  # nothing meets the cap: said so, not hidden
    with pytest.raises(ValueError):
        choose_setting([], 0.2)


def test_paired_vs_base_counts_discordant_items():
    base = {"a": True, "b": False, "c": False, "d": True, "e": False}
    cond = {"a": True, "b": True, "c": True, "d": False, "e": False, "z": True}  # z unpaired: ignored
    m = paired_vs_base(cond, base)
    assert (m["n_paired"], m["b"], m["c"]) == (5, 2, 1)
    assert m["p"] == pytest.approx(mcnemar_exact(2, 1))
    assert paired_vs_base(base, base)["p"] == 1.0


def test_summarize_has_a_degeneration_ci():
    turns = [SteeredTurn(f"i{k}", "diff_means", 0.2, 2, "boundary", t, t, "end_of_turn", 1.0)
             for k, t in enumerate(["what about the second step?", "", "ok ok ok ok ok ok ok ok ok"])]
    s = summarize(turns, {"k|i0": "genuine_followup", "k|i1": "empty_or_degenerate", "k|i2": "new_query"}, "k")
    assert s["degenerate"] == 2 and s["degenerate_rate"] == pytest.approx(2 / 3)
    lo, hi = s["degenerate_ci"]
    assert 0 <= lo < 2 / 3 < hi <= 1 and all(math.isfinite(x) for x in (lo, hi))


def _script():
    """The steering experiment's names (cli, driver, conditions and setting modules) in one namespace."""
    import types

    import mechprobe.cli.steer as cli_steer
    import mechprobe.steering.conditions as conditions
    import mechprobe.steering.experiment as exp
    import mechprobe.steering.setting as setting
    return types.SimpleNamespace(**{**vars(conditions), **vars(setting), **vars(exp), **vars(cli_steer)})


def test_one_resid_alpha_is_the_end_of_the_ladder():
    m = _script()
    assert m.resid_ladder(4) == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 4]
    assert m.resid_ladder(0.3) == [0.0, 0.05, 0.1, 0.2, 0.3]
    assert m.resid_ladder(0.8) == m.DEFAULT_ALPHAS["resid"]
    a = m.build_parser().parse_args([])
    assert a.alpha_unit == "resid" and a.alpha is None and a.select_on_train  # chosen on train by default
    assert not m.build_parser().parse_args(["--no-select-on-train"]).select_on_train
    assert (a.select_items, a.max_degenerate) == (None, 0.2)  # None: 16 for the embedded default, else 32


@pytest.mark.parametrize("flags, needle", [(["--alpha", "-1"], "end of the sweep"),
                                           (["--max-degenerate", "1.5"], "--max-degenerate"),
                                           (["--select-items", "0"], "--select-items"),
                                           (["--alpha", "0", "0"], "nonzero"),
                                           (["--acc-kinds", "bogus"], "--acc-kinds")])
def test_new_flags_are_checked_before_any_stage(tmp_path, flags, needle):
    from mechprobe.errors import UserError

    run = tmp_path / "run"
    with pytest.raises(UserError, match=needle):
        m = _script()
        m.run(m.build_parser().parse_args(["--run", str(run), "--dataset", "no-such-dataset", *flags]))
    assert not run.exists()


@pytest.mark.parametrize("alphas", [[0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 4.0], [0.0, 2.0, 4.0]])
def test_plot_draws_rates_and_degeneration_with_cis(tmp_path, alphas):
    from mechprobe.plots import plot_steering

    rows = [dict(kind=k, alpha=a, followup_rate=0.2, ci=[0.1, 0.4], degenerate_rate=0.1, degenerate_ci=[0.0, 0.3])
            for k in ("diff_means", "random") for a in alphas]
    out = plot_steering(rows, tmp_path / "s.png", "t", xlabel="alpha (x resid)")
    assert out.stat().st_size > 10_000


def test_probe_direction_for_steering_sees_train_rows_only():
    """The steering 'probe' vector is fitted on train rows: held-out labels cannot change it (no leakage),
    and a direction planted in the train rows is recovered (cosine with the plant well above chance)."""
    from mechprobe.steering.kinds.probe import train_probe_direction

    g = torch.Generator().manual_seed(0)
    n, d, layer = 240, 16, 3
    item_ids = [f"item{i // 2}" for i in range(n)]  # two rows per item, as samples of one prompt
    plant = torch.zeros(d)
    plant[0] = 1.0
    y = (torch.rand(n, generator=g) < 0.5).long()
    x = torch.randn(n, d, generator=g) + 1.5 * y[:, None] * plant

    class Cache:
        def __init__(self, labels):
            self.item_ids, self._y = item_ids, labels

        def resid(self, la):
            assert la == layer
            return x

        def labels(self, name):
            return self._y

    train = torch.tensor([split_of(i) == "train" for i in item_ids])
    assert 0 < int((~train).sum()) < n
    w = train_probe_direction(Cache(y), layer, train, seed=0)
    flipped = torch.where(train, y, 1 - y)  # every held-out label inverted
    w2 = train_probe_direction(Cache(flipped), layer, train, seed=0)
    assert torch.equal(w, w2)
    assert float(torch.nn.functional.cosine_similarity(w, plant, dim=0)) > 0.6  # chance: ~0.25 (1/sqrt(16))


def test_turns_judged_by_another_judge_are_rejudged_not_reused(tmp_path):
    """A steering file written under judge A, read under judge B: B's verdicts, from the stored turns (no
    generation), kept in a sidecar; A's rows untouched; B's verdicts reused on the next read."""
    import json

    m = _script()
    calls: list[list[str]] = []

    class FakeJudge:
        name = "judge-B"

        def label_many(self, inputs):
            calls.append([x.item_id for x in inputs])
            for x in inputs:
                yield SimpleNamespace(record_id=x.record_id, label="genuine_followup" if "step" in x.raw_text
                                      else "new_query")

    path = tmp_path / "alpha_0.2_diff_means.jsonl"
    turns = [SteeredTurn(f"i{k}", "diff_means", 0.2, 2, "boundary", t, t, "end_of_turn", 1.0)
             for k, t in enumerate(["what about the second step?", "a new problem"])]
    rows = [{**t.__dict__, "label": "new_query", "judge": "judge-A"} for t in turns[:1]] + \
           [{**turns[1].__dict__, "label": "genuine_followup"}]  # an older row: no judge recorded
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = path.read_text()
    by_item = {f"i{k}": AssistantRecord(item_id=f"i{k}", dataset="d", prompt="q", response="r", stop_reason="eos", n_tokens=1) for k in range(2)}
    got = m.other_judge_labels(FakeJudge(), turns, rows, by_item, "diff_means|a0.2", path)
    assert got == {"diff_means|a0.2|i0": "genuine_followup", "diff_means|a0.2|i1": "new_query"}
    assert calls == [["i0", "i1"]] and path.read_text() == before
    assert m.other_judge_labels(FakeJudge(), turns, rows, by_item, "diff_means|a0.2", path) == got
    assert calls == [["i0", "i1"]]  # second read: from the sidecar, nothing judged again
    same = [{**r, "judge": "judge-B"} for r in rows]
    assert m.other_judge_labels(FakeJudge(), turns, same, by_item, "diff_means|a0.2", path) == {}


def test_pinned_vector_refuses_turns_of_another_vector(tmp_path):
    """Relabelling changes the difference of means: turns stored for the old vector must not pass as the new one's."""
    from mechprobe.errors import UserError
    from mechprobe.steering.vector import SteeringVector

    m = _script()
    v = SteeringVector(torch.tensor([1.0, 2.0, 3.0]), 2, "diff_means", {})
    d = tmp_path / "L2"
    m.pin_vector(d / "vector_diff_means", v, d)  # first time: saved
    m.pin_vector(d / "vector_diff_means", SteeringVector(v.vector * (1 + 1e-6), 2, "diff_means", {}), d)  # noise
    with pytest.raises(UserError, match="another steering vector"):
        m.pin_vector(d / "vector_diff_means", SteeringVector(torch.tensor([1.0, 2.0, 3.5]), 2, "diff_means", {}), d)
    old = tmp_path / "old"
    old.mkdir()
    (old / "alpha_0.4_diff_means.jsonl").write_text("")
    with pytest.raises(UserError, match="no record of the vector"):
        m.pin_vector(old / "vector_diff_means", v, old)


def test_selection_stops_a_layer_once_its_text_breaks():
    train = [x for x in _records() if split_of(x.item_id) == "train"][:6]
    calls = []

    def run_setting(items, layer, alpha):
        calls.append((layer, alpha))
        broken = abs(alpha) >= (0.4 if layer == 2 else 1.6)
        return {"followup_rate": 0.3 if alpha == -0.1 else 0.1, "degenerate_rate": 0.9 if broken else 0.0}

    alphas = [0.0, 0.1, 0.2, 0.4, 0.8, 1.6, -0.1, -0.4, -0.8]
    sel = select_on_train(run_setting, train, [2, 3], alphas, max_degenerate=0.2)
    assert set(calls) == {(2, 0.1), (2, 0.2), (2, 0.4), (2, -0.1), (2, -0.4), (3, 0.1), (3, 0.2), (3, 0.4),
                          (3, 0.8), (3, 1.6), (3, -0.1), (3, -0.4), (3, -0.8)}
    assert len(calls) == len(set(calls))
    assert {(r["layer"], r["alpha"], r["broke_at"]) for r in sel["skipped"]} == {
        (2, 0.8, 0.4), (2, 1.6, 0.4), (2, -0.8, -0.4)}
    assert sel["chosen"] == {"layer": 2, "alpha": -0.1}
    assert [(r["layer"], r["alpha"]) for r in sel["sweep"]][:5] == [(2, -0.4), (2, -0.1), (2, 0.1), (2, 0.2),
                                                                   (2, 0.4)]
    calls.clear()
    full = select_on_train(run_setting, train, [2, 3], alphas, max_degenerate=0.2, stop_at_break=False)
    assert len(calls) == 16 and not full["skipped"]


def test_nll_dtype_is_pinned_per_steering_directory(tmp_path):
    m = _script()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert m.pin_nll_dtype(fresh, "bfloat16", legacy=None) == "bfloat16"
    assert m.pin_nll_dtype(fresh, None, legacy=None) == "bfloat16"  # pinned: a resume keeps it
    old = tmp_path / "old"
    (old / "select" / "L9_boundary+generated_resid").mkdir(parents=True)
    (old / "select" / "L9_boundary+generated_resid" / "alpha_0.4_diff_means.jsonl").write_text("{}\n")
    assert m.pin_nll_dtype(old, "bfloat16", legacy=None) is None  # scored by the run's own model before
    assert json.loads((old / "nll.json").read_text()) == {"dtype": None}


def test_steered_user_turns_with_a_scorer_over_several_batches(smol):
    """Real 135M model, 3 items in batches of 2: the scorer's NLLs equal turn_nll's on every batch (the loop
    variable once shadowed the ``nll`` argument, so a second batch called a float)."""
    from mechprobe.lm import chat
    from mechprobe.steering.evaluate import steered_user_turns

    items = [AssistantRecord(item_id=f"b{i}", dataset="builtin", prompt=q, response=r, stop_reason="end_of_turn",
                             n_tokens=5) for i, (q, r) in enumerate([("What is 2+2?", "2+2 = 4."),
                                                                      ("Name a colour.", "Blue."),
                                                                      ("Capital of France?", "Paris.")])]
    sc = NllScorer(smol)
    got = steered_user_turns(smol, items, None, 0.0, "boundary+generated", 8, batch_size=2, nll=sc)
    ref = steered_user_turns(smol, items, None, 0.0, "boundary+generated", 8, batch_size=2)
    assert [t.token_ids for t in got] == [t.token_ids for t in ref]
    # Tolerance 1e-4: kept-prefix scoring vs one padded forward differ only by float32 summation order.
    assert [t.nll for t in got] == pytest.approx([t.nll for t in ref], abs=1e-4)
    prompts = [list(chat.build_probe_prompt(smol.tokenizer, x.prompt, x.response).input_ids) for x in items]
    assert [t.nll for t in ref] == pytest.approx(turn_nll(smol, prompts, [t.token_ids for t in ref]), abs=1e-6)


@pytest.mark.parametrize("text,bad", [
    ("2222222222222222222222222222222222222222222222222222222222222222", True),  # one token, no spaces
    ("I666666666666666666666666666666666666666666666666666666666666666", True),
    ("I'm not a 0.000000000000000000000000000000000000000000000000000000000", True),
    ("abababababababababababab", True),
    ("I'm not eating, so I'm not eating. I'm not eating. I'm not eating. I'm not eating. I'm not eating.", True),
    ("", True),
    ("Is it ethical to eat wild animals?<|im_end|>", False),
    ("What is 1000000 divided by 25? I think the answer is 40000.", False),
    ("Why did you use 3.14159265358979 there?", False),
    ("Can you write hahahahaha more?", False),
])
def test_is_degenerate_catches_loops_without_spaces(text, bad):
    """The plan's alpha rule reads this detector: a loop of one token without spaces is one 'word', and before the
    character check it passed as fluent (the v2b select step chose alpha 2.0 on such turns)."""
    from mechprobe.steering.degenerate import degenerate_rate, is_degenerate

    assert is_degenerate(text) is bad
    assert degenerate_rate([text, "Why 40?"]) == (0.5 if bad else 0.0)
