"""The hidden-state judge (``--judge hidden:MODEL``): the reader's prompt, its features against HF's hidden states,
the weights' checks, the fit's selection rules, and a judge that decides by its head.

Oracle for the features: HF ``output_hidden_states`` of each prompt run alone (unpadded), at the last token and
averaged over the turn's tokens; batched (left-padded) must equal it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from mechprobe.audit.blind_sets import BlindLabel, BlindSets, BlindTurn, query_item_key, split_of_item
from mechprobe.errors import UsageError
from mechprobe.judges.base import JudgeInput
from mechprobe.judges.factory import make_judge, spec_of_judge_name
from mechprobe.judges.hidden import (
    EMPTY_TURN,
    WEIGHTS_FORMAT,
    HiddenStateJudge,
    check_weights,
    hidden_features,
    hidden_head_proba,
    reader_prompt,
    weights_digest,
)
from mechprobe.judges.hidden_fit import cached_hidden_features, fit_hidden_heads
from mechprobe.taxonomy import GENUINE
from tests.activations.test_backends import oracle, rel

INPUTS = [JudgeInput("r1", "What is 12 * 7?", "12 * 7 = 84.", "Why 84 and not 74?<|im_end|>"),
          JudgeInput("r2", "Name a prime.", "Seven is prime. " * 3, "Thanks!"),
          JudgeInput("r3", "What is 2 + 2?", "4.", "")]


def test_reader_prompt_marks_the_turn_and_ends_where_the_reader_answers(smol_tokenizer):
    tok = smol_tokenizer
    p = reader_prompt(tok, INPUTS[0])
    s, e = p.turn_span
    assert tok.decode(p.ids[s:e]) == INPUTS[0].raw_text  # the turn as written, special tokens included
    assert tok.decode(p.ids).rstrip().endswith("assistant")  # ChatML: the generation prompt is last
    empty = reader_prompt(tok, INPUTS[2])
    assert tok.decode(empty.ids[slice(*empty.turn_span)]) == EMPTY_TURN
    long = JudgeInput("r4", "q", " ".join(str(i) for i in range(2000)), "ok")
    ids = reader_prompt(tok, long, max_answer_tokens=64).ids
    assert len(ids) < len(reader_prompt(tok, long, max_answer_tokens=10_000).ids) - 3000 and "[...]" in tok.decode(ids)


def test_features_equal_hf_hidden_states_batched_or_alone(smol):
    layers = [0, 10, 30]
    got = hidden_features(smol, INPUTS, layers, batch_size=3)
    alone = hidden_features(smol, INPUTS[1:2], layers, batch_size=1)
    for i, inp in enumerate(INPUTS):
        p = reader_prompt(smol.tokenizer, inp)
        hs = oracle(smol.model, p.ids)  # [L+1, T, d]
        s, e = p.turn_span
        for r in layers:
            want = torch.cat([hs[r, -1], hs[r, s:e].mean(0)])
            assert rel(torch.from_numpy(got[r][i]), want) < 1e-4
    for r in layers:
        assert rel(torch.from_numpy(alone[r][0]), torch.from_numpy(got[r][1])) < 1e-4


SHARED = [JudgeInput(f"s{i}", "What is 12 * 7?", "12 * 7 = 84, since 12 * 7 = 70 + 14.", turn)
          for i, turn in enumerate(["Why 84 and not 74?", "Thanks!", "", "Now do 13 * 7.<|im_end|>",
                                    "Can you show the 70 + 14 step again, slower please?"])]


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_turns_of_one_conversation_share_its_prefix_and_read_the_same(smol, batch_size):
    """Turns after the same answer reuse the conversation's keys and values: the features equal a full prefill of
    each prompt alone (HF hidden states), whatever the batching, with the other conversations mixed in."""
    layers = [0, 7, 20]
    inputs = [SHARED[0], INPUTS[0], *SHARED[1:], INPUTS[1]]
    shared = hidden_features(smol, inputs, layers, batch_size=batch_size)
    plain = hidden_features(smol, inputs, layers, batch_size=batch_size, share_prefix=False)
    for i, inp in enumerate(inputs):
        p = reader_prompt(smol.tokenizer, inp)
        hs = oracle(smol.model, p.ids)
        s, e = p.turn_span
        for r in layers:
            want = torch.cat([hs[r, -1], hs[r, s:e].mean(0)])
            assert rel(torch.from_numpy(shared[r][i]), want) < 1e-4
            assert rel(torch.from_numpy(shared[r][i]), torch.from_numpy(plain[r][i])) < 1e-4


def test_prefix_sharing_removes_its_hooks_after_an_error(smol, monkeypatch):
    from mechprobe.judges import hidden as hmod
    from mechprobe.lm.forward import get_blocks

    hooks = [len(b._forward_hooks) for b in get_blocks(smol.model)]

    def boom(*a, **k):
        raise RuntimeError("tail failed")

    monkeypatch.setattr(hmod, "continuation_inputs", boom)
    with pytest.raises(RuntimeError, match="tail failed"):
        hidden_features(smol, SHARED, [5, 10], batch_size=4)
    assert [len(b._forward_hooks) for b in get_blocks(smol.model)] == hooks


def test_stopping_at_the_deepest_layer_read_reads_the_same_and_removes_its_hooks(smol):
    """The forward stops after the deepest residual read; what it read equals a full forward's, and no hook stays."""
    from mechprobe.judges.hidden import _residuals
    from mechprobe.lm.forward import get_blocks

    prompts = [reader_prompt(smol.tokenizer, i) for i in INPUTS]
    ids, spans = [p.ids for p in prompts], [p.turn_span for p in prompts]
    hooks = [len(b._forward_hooks) for b in get_blocks(smol.model)]  # transformers' own output recorders may be there
    emb = len(smol.model.get_input_embeddings()._forward_hooks)
    early = _residuals(smol.model, ids, spans, [4, 10], stop_early=True)
    full = _residuals(smol.model, ids, spans, [4, 10], stop_early=False)
    for r in (4, 10):
        assert rel(early[r], full[r]) < 1e-6
    assert [len(b._forward_hooks) for b in get_blocks(smol.model)] == hooks
    assert len(smol.model.get_input_embeddings()._forward_hooks) == emb


def _weights(d: int, coef=None, intercept=0.0, threshold=0.5, reader="smollm2-135m-instruct", layer=10):
    w = {"format": WEIGHTS_FORMAT, "version": "test", "reader": reader, "layer": layer, "mean": [0.0] * d,
         "scale": [1.0] * d, "heads": {h: {"coef": list(coef if coef is not None else [0.0] * d),
                                           "intercept": intercept, "threshold": threshold}
                                       for h in ("lenient", "strict")}}
    w["weights_sha256"] = weights_digest(w)
    return w


def test_edited_or_bad_weights_are_refused():
    w = _weights(4)
    w["heads"]["strict"]["threshold"] = 0.2
    with pytest.raises(UsageError, match="weights_sha256"):
        check_weights(w, "w.json")
    with pytest.raises(UsageError, match="coef"):
        check_weights(_weights(4, coef=[0.0] * 3), "w.json")
    with pytest.raises(UsageError, match="threshold"):
        check_weights(_weights(4, threshold=2.0), "w.json")
    bad = _weights(4)
    bad["heads"]["strict"]["thresholds"] = {"qwen2.5-coder-0.5b-instruct": 1.5}
    bad["weights_sha256"] = weights_digest(bad)
    with pytest.raises(UsageError, match="'thresholds' must map subject model names"):
        check_weights(bad, "w.json")


def test_judge_decides_by_its_head_and_refuses_another_reader(smol, tmp_path):
    """A head that reads one feature of the last token: its verdicts are that feature's sign, the reader's
    failures keep the rules' label, and weights fit with another reader are refused."""
    layer = 10
    X = hidden_features(smol, INPUTS[:2], [layer])[layer]
    j = int(np.argmax(np.abs(X[0] - X[1])))
    coef = np.zeros(X.shape[1])
    coef[j] = 50.0 * np.sign(X[0, j] - X[1, j])
    mid = float((X[0, j] + X[1, j]) / 2 * 50.0 * np.sign(X[0, j] - X[1, j]))
    p = tmp_path / "w.json"
    p.write_text(json.dumps(_weights(X.shape[1], coef=coef.tolist(), intercept=-mid, layer=layer)))
    judge = make_judge("hidden:smollm2-135m-instruct", weights=str(p), loaded=smol)
    assert isinstance(judge, HiddenStateJudge)
    ra, rb = list(judge.label_many(INPUTS[:2]))
    assert ra.label == GENUINE and rb.label != GENUINE and not rb.genuine
    assert spec_of_judge_name(ra.judge) == "hidden:smollm2-135m-instruct"
    # a per-subject threshold of 0.0 (everything passes) decides that subject's turns only
    w = _weights(X.shape[1], coef=coef.tolist(), intercept=-mid, layer=layer)
    w["heads"]["strict"]["thresholds"] = {"lax-model": 0.0}
    w["weights_sha256"] = weights_digest(w)
    p.write_text(json.dumps(w))
    judge = make_judge("hidden:smollm2-135m-instruct", weights=str(p), loaded=smol)
    lax = replace(INPUTS[1], subject="lax-model")
    rb, rl, ro = list(judge.label_many([INPUTS[1], lax, replace(INPUTS[1], subject="other-model")]))
    assert not rb.genuine and rl.genuine and not ro.genuine
    assert "lax-model's threshold 0.000" in rl.rationale and "(threshold 0.500)" in ro.rationale
    other = tmp_path / "o.json"
    other.write_text(json.dumps(_weights(X.shape[1], reader="qwen2.5-coder-0.5b-instruct")))
    with pytest.raises(UsageError, match="fit with reader"):
        HiddenStateJudge("smollm2-135m-instruct", weights=other, loaded=smol)


def _blind(n_items: int = 80, d: int = 6) -> tuple[BlindSets, dict[int, dict[str, np.ndarray]]]:
    """Two subject models; a turn is genuine (both labellers) when i % 3 == 0; layer 5's first feature says so,
    layer 9 is noise."""
    rng = np.random.default_rng(0)
    turns, labels, f5, f9 = {}, [], {}, {}
    for i in range(n_items):
        for model in ("m-a", "m-b"):
            q, tid = f"query {i}", f"t{i}{model}"
            genuine = i % 3 == 0
            turns[tid] = BlindTurn(tid, "toy", model, "gsm8k", query_item_key(q), "greedy", q, "answer", "turn")
            for who in ("labeller-a", "labeller-b"):
                lab = GENUINE if genuine else "new_query"
                labels.append(BlindLabel(tid, "toy", "v2", who, lab, "yes" if genuine else None, False))
            f5[tid] = np.r_[float(genuine) * 3, rng.normal(size=d - 1)]
            f9[tid] = rng.normal(size=d)
    return BlindSets(turns, labels, []), {5: f5, 9: f9}


def test_fit_chooses_the_layer_that_carries_the_label_on_dev_only():
    blind, feats = _blind()
    w, selection = fit_hidden_heads(blind, feats, "toy-reader")
    check_weights(w, "fit")
    assert w["layer"] == 5 and {r["layer"] for r in selection} == {5, 9}
    dev = [t for t, x in blind.turns.items() if split_of_item(x.item) == "dev"]
    test = [t for t, x in blind.turns.items() if split_of_item(x.item) == "test"]
    assert dev and test
    p = hidden_head_proba(w, "strict", np.stack([feats[5][t] for t in dev]))
    assert [bool(x >= w["heads"]["strict"]["threshold"]) for x in p] == [feats[5][t][0] > 0 for t in dev]
    # test turns never decide: scrambling their features leaves the fit unchanged
    scrambled = {r: {t: (v[::-1] if t in test else v) for t, v in f.items()} for r, f in feats.items()}
    w2, _ = fit_hidden_heads(blind, scrambled, "toy-reader")
    assert w2["weights_sha256"] == w["weights_sha256"]


def test_features_are_cached_batch_by_batch_and_reused(smol, tmp_path):
    inputs = {i.record_id: i for i in INPUTS}
    a = cached_hidden_features(smol, inputs, [10], tmp_path, batch_size=1, progress=False)
    files = sorted((tmp_path / f"hidden-{smol.name}").glob("batch-*.npz"))
    assert len(files) == 3  # one file per batch, written as each ends
    files[0].unlink()  # an interrupted run: the first batch's turns are computed again, the rest reused
    b = cached_hidden_features(smol, inputs, [10], tmp_path, batch_size=1, progress=False)
    assert len(list((tmp_path / f"hidden-{smol.name}").glob("batch-*.npz"))) == 3
    for t in inputs:
        assert np.allclose(a[10][t], b[10][t], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_judges_evaluate_fits_scores_and_commits_the_hidden_judge(smol, tmp_path):
    """``judges evaluate --hidden MODEL --fit-hidden`` on a labelled set of its own: weights written with the reader's
    name, verdicts on every labelled turn in their own file, a round recorded, the table holding the judge; a later
    run without the reader reads the committed verdicts."""
    import csv

    from mechprobe.audit.judge_table import hidden_verdicts_file
    from mechprobe.judges.judge_eval import JudgeEvalConfig, run_judge_eval

    d = tmp_path / "reports" / "judge_sets" / "fresh_test_v1"  # a source listed in blind_sets.SOURCES
    (d / "labels").mkdir(parents=True)
    rows, key = [], {}
    for i in range(60):
        q, a = f"What is {i} times 3?", f"{i} times 3 is {3 * i}."
        for j, (turn, good) in enumerate(((f"Why is it {3 * i} and not {3 * i + 1}?", True),
                                          ("Write a poem about the sea.", False))):
            r = f"r{i:02d}{j}"
            rows.append((r, q, a, turn))
            key[r] = {"turn_id": f"t{i:02d}{j}", "model": "m-a", "dataset": "gsm8k", "decoding": "greedy", "good": good}
    with open(d / "sheet.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "query", "answer", "user_turn"])
        w.writerows(rows)
    (d / "key.json").write_text(json.dumps({"rows": key}))
    for who in ("labeller-a", "labeller-b"):
        with open(d / "labels" / f"{who}.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["row", "label", "strict", "borderline", "note"])
            for r, *_ in rows:
                w.writerow([r, "genuine_followup", "yes", 0, ""] if key[r]["good"] else [r, "new_query", "", 0, ""])
    cfg = JudgeEvalConfig(root=str(tmp_path), hidden="smollm2-135m-instruct", fit_hidden=True, hidden_layers=(10, 20),
                          n_boot=50)
    res = run_judge_eval(cfg)
    wfile = tmp_path / "mechprobe" / "data" / "hidden_judge_smollm2-135m-instruct.json"
    w = json.loads(wfile.read_text())
    assert w["reader"] == "smollm2-135m-instruct" and w["layer"] in (10, 20)
    vfile = tmp_path / hidden_verdicts_file("smollm2-135m-instruct")
    verdicts = [json.loads(x) for x in vfile.read_text().splitlines()]
    assert len(verdicts) == 2 * 120 and {v["reading"] for v in verdicts} == {"lenient", "strict"}
    assert any(r["judge"] == "hidden:smollm2-135m-instruct" for r in res.rows)
    rounds = json.loads((tmp_path / "reports" / "judge" / "test_rounds.json").read_text())["rounds"]
    assert rounds[-1]["weights"] == f"hidden:smollm2-135m-instruct@{w['version']}"
    again = run_judge_eval(JudgeEvalConfig(root=str(tmp_path), n_boot=50))  # no reader loaded: committed verdicts
    assert any(r["judge"] == "hidden:smollm2-135m-instruct" for r in again.rows)
