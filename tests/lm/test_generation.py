"""Decoding invariants: batched == unbatched, seeds make rows reproducible alone, padding is exact."""

from __future__ import annotations

import pytest
import torch

from mechprobe.lm import chat
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.generation import batches_by_length, generate, left_pad


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_left_padded_logits_equal_unpadded(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(0)
    short = torch.randint(1, 128, (5,), generator=g).tolist()
    long = torch.randint(1, 128, (11,), generator=g).tolist()
    ids, mask, pos = left_pad([short, long], pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        alone = model(input_ids=torch.tensor([short])).logits
    torch.testing.assert_close(batched[0, -1], alone[0, -1], rtol=1e-5, atol=1e-5)


def test_tiny_batched_greedy_equals_unbatched_and_hf_generate():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 9, 6, 12)]
    batched = generate(model, prompts, stop_ids={}, max_new_tokens=12, pad_id=0)
    for p, b in zip(prompts, batched):
        alone = generate(model, [p], stop_ids={}, max_new_tokens=12, pad_id=0)[0]
        hf = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):]
        assert b.token_ids == alone.token_ids == hf.tolist()
        assert b.stop_reason == "max_tokens"


def test_sampling_is_per_row_reproducible():
    model = tiny_model("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    a = generate(model, prompts, stop_ids={}, max_new_tokens=10, temperatures=1.0, seeds=[1, 2, 3], pad_id=0)
    b = generate(model, [prompts[1]], stop_ids={}, max_new_tokens=10, temperatures=1.0, seeds=[2], pad_id=0)
    assert a[1].token_ids == b[0].token_ids
    c = generate(model, [prompts[1]], stop_ids={}, max_new_tokens=10, temperatures=1.0, seeds=[99], pad_id=0)
    assert c[0].token_ids != b[0].token_ids  # the seed matters
    with pytest.raises(ValueError, match="seed"):
        generate(model, prompts, stop_ids={}, temperatures=1.0, pad_id=0)


def test_stop_tokens_and_reasons():
    model = tiny_model("llama")
    free = generate(model, [[1, 2, 3]], stop_ids={}, max_new_tokens=8, pad_id=0)[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = generate(model, [[1, 2, 3]], stop_ids={stop_at: "end_of_turn"}, max_new_tokens=8, pad_id=0)[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.stop_reason == "end_of_turn"


def test_batches_by_length_groups_and_caps():
    lengths = [10, 3, 50, 4, 11, 49]
    b = batches_by_length(lengths, batch_size=2)
    assert sorted(i for bb in b for i in bb) == list(range(6))
    assert all(len(bb) <= 2 for bb in b)
    assert b[0] == [1, 3]
    b2 = batches_by_length(lengths, batch_size=10, token_budget=100)
    assert all(max(lengths[i] for i in bb) * len(bb) <= 100 or len(bb) == 1 for bb in b2)


@pytest.mark.slow
def test_real_model_batched_equals_unbatched_user_turns(smol):
    tok = smol.tokenizer
    convs = [("What is 7*8?", "7*8 = 56."),
             ("Give me a tip for sleeping better.", "Keep a regular schedule and avoid screens before bed."),
             ("Hi", "Hello! How can I help you today?")]
    prompts = [chat.build_probe_prompt(tok, q, a).input_ids for q, a in convs]
    stops = chat.stop_token_ids(tok, smol.model)
    batched = generate(smol.model, prompts, stop_ids=stops, max_new_tokens=24, pad_id=tok.pad_token_id)
    for p, b in zip(prompts, batched):
        alone = generate(smol.model, [p], stop_ids=stops, max_new_tokens=24, pad_id=tok.pad_token_id)[0]
        assert b.token_ids == alone.token_ids
    sampled = generate(smol.model, prompts, stop_ids=stops, max_new_tokens=16, temperatures=1.0,
                       seeds=[11, 12, 13], pad_id=tok.pad_token_id)
    again = generate(smol.model, [prompts[2]], stop_ids=stops, max_new_tokens=16, temperatures=1.0,
                     seeds=[13], pad_id=tok.pad_token_id)[0]
    assert sampled[2].token_ids == again.token_ids


def _plan_batch(prompts: list[list[int]], k: int) -> tuple[list[list[int]], list[float], list[int | None]]:
    """Rows as the probe stage builds them: per prompt one greedy row and k sampled rows."""
    rows, temps, seeds = [], [], []
    for i, p in enumerate(prompts):
        for j in range(k + 1):
            rows.append(p)
            temps.append(0.0 if j == 0 else 1.0)
            seeds.append(None if j == 0 else 100 * i + j)
    return rows, temps, seeds


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_shared_prefill_changes_no_token(arch):
    """Prefilling duplicate prompts once and copying their KV rows is an optimisation, not a new sampler."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 11, 7)]
    rows, temps, seeds = _plan_batch(prompts, k=3)
    kw = dict(stop_ids={}, max_new_tokens=10, temperatures=temps, seeds=seeds, pad_id=0)
    shared = generate(model, rows, share_prefill=True, **kw)
    plain = generate(model, rows, share_prefill=False, **kw)
    assert [s.token_ids for s in shared] == [p.token_ids for p in plain]
    assert len({tuple(s.token_ids) for s in shared}) > len(prompts)  # sampled rows did diverge
    for i in (0, 4, 8):  # greedy rows equal the prompt decoded alone
        assert shared[i].token_ids == generate(model, [rows[i]], stop_ids={}, max_new_tokens=10, pad_id=0)[0].token_ids


def test_shared_prefill_calls_the_model_once_per_unique_prompt():
    model = tiny_model("llama")
    seen: list[int] = []
    h = model.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    try:
        rows, temps, seeds = _plan_batch([[5, 6, 7], [8, 9]], k=2)
        generate(model, rows, stop_ids={}, max_new_tokens=3, temperatures=temps, seeds=seeds, pad_id=0)
    finally:
        h.remove()
    assert seen[0] == 2 and seen[1:] == [6, 6]  # prefill on 2 unique prompts, decode on all 6 rows


@pytest.mark.slow
def test_real_model_shared_prefill_equals_separate_prefill(smol):
    tok = smol.tokenizer
    prompts = [chat.build_probe_prompt(tok, q, a).input_ids
               for q, a in [("What is 7*8?", "7*8 = 56."), ("Name a fruit.", "An apple.")]]
    rows, temps, seeds = _plan_batch(prompts, k=3)
    stops = chat.stop_token_ids(tok, smol.model)
    kw = dict(stop_ids=stops, max_new_tokens=16, temperatures=temps, seeds=seeds, pad_id=tok.pad_token_id)
    shared = generate(smol.model, rows, share_prefill=True, **kw)
    plain = generate(smol.model, rows, share_prefill=False, **kw)
    assert [s.token_ids for s in shared] == [p.token_ids for p in plain]


def _mixed_stop(free: list[list[int]]) -> int:
    """A token that ends some rows early and others later or never (so rows leave the batch at different steps)."""
    for row in free:
        for t in row[1:]:
            ends = {r.index(t) if t in r else None for r in free}
            if len(ends) >= 2 and any(e is not None and e < len(row) - 2 for e in ends):
                return t
    raise AssertionError("no token ends the rows at different steps")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dropping_finished_rows_changes_no_token(arch):
    """Finished rows leave the batch (fewer rows per decode step) and every row's tokens stay the same."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 9, 6, 12)]
    rows, temps, seeds = _plan_batch(prompts, k=1)
    free = generate(model, rows, stop_ids={}, max_new_tokens=12, temperatures=temps, seeds=seeds, pad_id=0)
    stop = _mixed_stop([f.token_ids for f in free])
    kw = dict(stop_ids={stop: "end_of_turn"}, max_new_tokens=12, temperatures=temps, seeds=seeds, pad_id=0)
    seen: list[int] = []
    h = model.model.layers[0].register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    try:
        dropped = generate(model, rows, drop_finished=True, **kw)
    finally:
        h.remove()
    kept = generate(model, rows, drop_finished=False, **kw)
    assert [(d.token_ids, d.stop_reason) for d in dropped] == [(k.token_ids, k.stop_reason) for k in kept]
    assert len({len(d.token_ids) for d in dropped}) > 1  # rows ended at different steps
    decode_sizes = seen[1:]  # seen[0] is the prefill of the unique prompts
    assert max(decode_sizes) <= len(rows) and decode_sizes[-1] < len(rows)  # rows left the batch
    assert decode_sizes == sorted(decode_sizes, reverse=True)


@pytest.mark.slow
def test_real_model_dropping_finished_rows_changes_no_token(smol):
    tok = smol.tokenizer
    prompts = [chat.build_probe_prompt(tok, q, a).input_ids
               for q, a in [("What is 7*8?", "7*8 = 56."), ("Name a fruit.", "An apple."),
                            ("Hi", "Hello! How can I help you today?")]]
    rows, temps, seeds = _plan_batch(prompts, k=2)
    stops = chat.stop_token_ids(tok, smol.model)
    kw = dict(stop_ids=stops, max_new_tokens=40, temperatures=temps, seeds=seeds, pad_id=tok.pad_token_id)
    dropped = generate(smol.model, rows, drop_finished=True, **kw)
    kept = generate(smol.model, rows, drop_finished=False, **kw)
    assert [(d.token_ids, d.stop_reason) for d in dropped] == [(k.token_ids, k.stop_reason) for k in kept]
    lengths = {len(d.token_ids) for d in dropped if d.stop_reason == "end_of_turn"}
    assert lengths and len(lengths | {40}) > 1  # some rows did stop early, at different steps than others


def test_auto_batch_size_follows_free_memory_and_model_shape():
    """``--batch-size auto``: rows grow with free memory and shrink with prompt length and vocabulary."""
    from mechprobe.lm.generation import AUTO_MAX_ROWS, auto_batch_size

    model = tiny_model("llama")
    cfg = model.config
    per_row = (200 * cfg.vocab_size * 4 + 232 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
               * (cfg.hidden_size // cfg.num_attention_heads) * 4 + 3 * 200 * cfg.intermediate_size * 4)
    assert auto_batch_size(model, 200, 32, free_bytes=10 * per_row) == 5  # half of the free memory
    assert auto_batch_size(model, 200, 32, free_bytes=10 * per_row, fraction=1.0) == 10
    assert auto_batch_size(model, 200, 32, free_bytes=per_row) == 1  # never below one row
    assert auto_batch_size(model, 200, 32, free_bytes=1 << 50) == AUTO_MAX_ROWS
    assert auto_batch_size(model, 400, 32, free_bytes=40 * per_row) < auto_batch_size(model, 200, 32,
                                                                                       free_bytes=40 * per_row)
    assert 1 <= auto_batch_size(model, 200, 32) <= AUTO_MAX_ROWS  # reads this machine's free memory
    # A prompt continued from a stored prefix prefills only its rest: its logits and activations cost a few rows,
    # its KV cache the whole prompt. Sized as whole prefills, one decode call would split into several.
    kv = 232 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    stored = 8 * cfg.vocab_size * 4 + kv + 3 * 8 * cfg.intermediate_size * 4
    assert auto_batch_size(model, 200, 32, free_bytes=20 * stored, prefill_len=8) == 10
    assert auto_batch_size(model, 200, 32, free_bytes=20 * stored, prefill_len=8) > auto_batch_size(
        model, 200, 32, free_bytes=20 * stored)
    assert auto_batch_size(model, 200, 32, free_bytes=10 * per_row, prefill_len=10_000) == 5  # never above the prompt


def test_batch_size_argument_accepts_auto_and_refuses_nonsense():
    import argparse

    from mechprobe.cli.common import batch_size_arg
    from mechprobe.turns.pipeline import ProbeConfig

    assert batch_size_arg("auto") is None and batch_size_arg("AUTO") is None
    assert batch_size_arg("16") == 16
    for bad in ("0", "-3", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'auto'"):
            batch_size_arg(bad)
    ProbeConfig(model="m", batch_size=None).validate()  # auto is valid
    with pytest.raises(Exception, match="batch_size"):
        ProbeConfig(model="m", batch_size=0).validate()


def test_auto_batch_size_gives_the_same_tokens_as_fixed_batches(tmp_path):
    """The pipeline's auto rows decode the same turns as batch 1 (batched == unbatched, tiny model)."""
    from mechprobe.lm.models import LoadedModel
    from mechprobe.turns.config import ProbeConfig
    from mechprobe.turns.engines import rows_per_call

    model = tiny_model("llama")
    prompts = [[1, 5, 9, 2], [3, 4], [7, 7, 7, 7, 7, 1], [2, 8, 6]]
    rows = rows_per_call(ProbeConfig(model="m", batch_size=None), None,
                         LoadedModel(model=model, tokenizer=None, name="tiny", weight_hash="x",
                                     device=torch.device("cpu"), dtype=torch.float32), 6, 5)
    assert rows >= 4
    together = generate(model, prompts[:rows], stop_ids={}, max_new_tokens=5, pad_id=0)
    alone = [generate(model, [p], stop_ids={}, max_new_tokens=5, pad_id=0)[0] for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_kv_keyword_follows_each_models_signature_and_no_deprecation_is_hit():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``: ``kv_kw`` must pick the name the model's
    forward declares (a model on the old name keeps it), and a cached generation must not go through the
    deprecated name (it is removed in 5.40)."""
    import inspect
    import warnings

    from torch import nn

    from mechprobe.lm.forward import kv_kw, out_cache

    model = tiny_model("llama")
    name = next(iter(kv_kw(model, None)))
    assert name in inspect.signature(type(model).forward).parameters

    class OldStyle(nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    assert kv_kw(OldStyle(), 1) == {"past_key_values": 1}
    assert out_cache(type("O", (), {"past_key_values": 7})()) == 7  # an output object of an old release
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        generate(model, [[1, 2, 3]], stop_ids={}, max_new_tokens=3, pad_id=0)
