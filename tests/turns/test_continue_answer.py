"""User turns that continue from the answer batch's KV cache (``run_probe(continue_from_answer=True)``, the default
on the HF engine) are the turns of a whole-prompt prefill: fp32, token for token, greedy and sampled."""

from __future__ import annotations

import pytest

from mechprobe.io import read_jsonl
from mechprobe.lm import generation
from mechprobe.turns import pipeline
from mechprobe.turns.pipeline import ProbeConfig, assistant_answers, run_probe
from tests.conftest import requires_smollm2

CFG = dict(model="smollm2-135m-instruct", dataset="builtin", limit=4, temperatures=[0.0, 1.0], samples=1,
           max_assistant_tokens=40, max_user_tokens=16, batch_size=2)


def _turns(run) -> dict[str, tuple[list[int], list[int], int]]:
    return {r["record_id"]: (r["generated_ids"], r["prompt_ids"], r["boundary_index"])
            for r in read_jsonl(run / "user_turns.jsonl")}


@pytest.mark.slow
@requires_smollm2
def test_turns_continued_from_the_answers_equal_a_whole_prefill_fp32(smol, tmp_path, monkeypatch):
    plain = run_probe(ProbeConfig(**CFG), tmp_path / "plain", lm=smol, progress=False, continue_from_answer=False)
    prefilled: list[int] = []
    real = generation.continuation_inputs

    def spy(tails, *a, **kw):
        prefilled.extend(len(t) for t in tails)
        return real(tails, *a, **kw)
    monkeypatch.setattr(generation, "continuation_inputs", spy)
    reused = run_probe(ProbeConfig(**CFG), tmp_path / "reused", lm=smol, progress=False)
    assert _turns(reused) == _turns(plain) and len(_turns(plain)) == 4 * 2
    assert prefilled and max(prefilled) <= 8  # the end of the answer and the user header, not the conversation
    assert read_jsonl(reused / "assistant.jsonl") == read_jsonl(plain / "assistant.jsonl")


@pytest.mark.slow
@requires_smollm2
def test_a_run_resumed_after_its_answers_prefills_the_turns_and_gets_the_same_ones(smol, tmp_path, monkeypatch):
    cfg = ProbeConfig(**CFG)
    out = tmp_path / "resumed"
    items, _ = pipeline.load_items(cfg)
    assistant_answers(cfg, smol, items, out, progress=False)  # answers exist, as after a kill in the user stage
    stores: list[object] = []
    real = pipeline._user_stage

    def spy(*a, **kw):
        stores.append(kw.get("prefix_store"))
        return real(*a, **kw)
    monkeypatch.setattr(pipeline, "_user_stage", spy)
    run_probe(cfg, out, lm=smol, progress=False)
    assert stores == [None]  # no answer of this process to continue from: a plain prefill
    plain = run_probe(cfg, tmp_path / "plain", lm=smol, progress=False, continue_from_answer=False)
    assert _turns(out) == _turns(plain)
