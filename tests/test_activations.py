"""Activation capture against the HF oracle, padding invariance, hook hygiene, and the on-disk cache."""

from __future__ import annotations

import json

import pytest
import torch

from mechprobe import chat
from mechprobe.activations import ActivationCache, CacheMismatch, cache_run
from mechprobe.backends import _capture_hooks, capture
from mechprobe.io import JsonlStore
from mechprobe.models import get_blocks, tiny_model
from mechprobe.records import LabelRecord, UserTurnRecord, make_record_id

BACKENDS = ["hooks", "nnsight", "transformer-lens"]


def _oracle(model, prompt):
    """HF hidden states for one unpadded prompt, in mechprobe's residual convention (last one pre-norm)."""
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    out = [h[0] for h in hs[:-1]]
    blocks = get_blocks(model)
    got = {}
    h = blocks[-1].register_forward_hook(lambda m, i, o: got.setdefault("last", o if torch.is_tensor(o) else o[0]))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
    finally:
        h.remove()
    out.append(got["last"][0])
    # The raw last-block output, normalised, is HF's last hidden state: check the convention itself.
    norm = model.model.norm
    torch.testing.assert_close(norm(got["last"])[0], hs[-1][0], rtol=1e-4, atol=1e-4)
    return torch.stack(out)  # [L+1, T, d]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _check_parity(model, prompts, spans, backend, tokenizer):
    layers = list(range(len(get_blocks(model)) + 1))
    tp = [{"boundary": len(p) - 1, "span": s} for p, s in zip(prompts, spans)]
    got = capture(model, prompts, tp, ["boundary", "assistant_last", "assistant_mean"], layers,
                  backend=backend, tokenizer=tokenizer)
    for i, (p, (s, e)) in enumerate(zip(prompts, spans)):
        ref = _oracle(model, p)
        assert _rel(got["boundary"][i], ref[:, -1]) < 1e-4
        assert _rel(got["assistant_last"][i], ref[:, e - 1]) < 1e-4
        assert _rel(got["assistant_mean"][i], ref[:, s:e].mean(1)) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_parity_with_hidden_states(arch, backend, smol_tokenizer):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 12, 4)]
    spans = [(2, 5), (3, 9), (1, 3)]
    _check_parity(model, prompts, spans, backend, smol_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_model_parity_at_boundary(smol, backend):
    tok = smol.tokenizer
    pps = [chat.build_probe_prompt(tok, q, a) for q, a in
           [("What is 2+2?", "2+2 = 4."), ("Name a primary colour.", "Red is a primary colour, as are blue and yellow.")]]
    _check_parity(smol.model, [p.input_ids for p in pps], [p.assistant_span for p in pps], backend, tok)


def test_hooks_removed_after_exception():
    model = tiny_model("llama")
    blocks = get_blocks(model)
    before = [len(b._forward_hooks) + len(b._forward_pre_hooks) for b in blocks]

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    h = blocks[1].mlp.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        _capture_hooks(model, [[1, 2, 3]], [{"boundary": 2, "span": (0, 1)}], ["boundary"], [0, 1, 2, 3])
    h.remove()
    assert [len(b._forward_hooks) + len(b._forward_pre_hooks) for b in blocks] == before


class _TupleBlock(torch.nn.Module):
    """A block that returns a tuple, the way transformers 4.x decoder layers did."""

    def __init__(self, d, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, hidden_states, **_k):
        return (hidden_states + torch.tanh(self.lin(hidden_states)), None)


class _ToyTupleLM(torch.nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.config = type("C", (), {"num_hidden_layers": n})()
        self.embed = torch.nn.Embedding(50, d)
        self.layers = torch.nn.ModuleList([_TupleBlock(d, i) for i in range(n)])
        self.trace = []

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, **_k):
        h = self.embed(input_ids)
        self.trace = [h]
        for blk in self.layers:
            h = blk(h)[0]
            self.trace.append(h)
        return h


def test_tuple_block_outputs_are_handled():
    model = _ToyTupleLM()
    prompts = [[5, 6, 7, 8], [9, 10]]
    tp = [{"boundary": 3, "span": (0, 2)}, {"boundary": 1, "span": (0, 1)}]
    got = capture(model, prompts, tp, ["boundary"], [0, 1, 2, 3], backend="hooks")["boundary"]
    model(torch.tensor([prompts[1]]))
    ref = torch.stack([h[0, -1] for h in model.trace])
    # Row 1 was left-padded inside a batch; the toy has no attention, so padding cannot leak into it.
    torch.testing.assert_close(got[1], ref)


def _fake_run(tmp_path, model_tok, n_items=3, samples=2):
    """A run directory with real probe prompts (no generation needed for caching)."""
    run = tmp_path / "run"
    store = JsonlStore(run / "user_turns.jsonl", key="record_id")
    qa = [("What is 3*3?", "3*3 = 9."), ("Say hi.", "Hi there!"), ("Capital of France?", "Paris is the capital.")]
    for i, (q, a) in enumerate(qa[:n_items]):
        pp = chat.build_probe_prompt(model_tok, q, a)
        for k in range(samples):
            rid = make_record_id(f"it-{i}", "sample", 1.0, k)
            store.append(UserTurnRecord(record_id=rid, item_id=f"it-{i}", dataset="t", decoding="sample",
                                        temperature=1.0, sample_index=k, seed=k, raw_text="x", text="x",
                                        stop_reason="end_of_turn", prompt_ids=pp.input_ids,
                                        boundary_index=pp.boundary_index, assistant_span=pp.assistant_span).to_dict())
    return run


@pytest.mark.slow
def test_cache_run_roundtrip_resume_and_labels(smol, tmp_path):
    run = _fake_run(tmp_path, smol.tokenizer)
    out = cache_run(run, smol, positions="boundary,assistant_mean", dtype="float32", batch_size=2, shard_rows=4,
                    progress=False)
    cache = ActivationCache.load(run)
    assert len(cache) == 6 and cache.layers == list(range(31)) and cache.item_ids[0] == "it-0"
    x = cache.resid(12)
    assert x.shape == (6, 576)
    torch.testing.assert_close(x[0], x[1])  # two samples of one prompt share the boundary state
    recs = [json.loads(line) for line in (run / "user_turns.jsonl").read_text().splitlines()]
    ref = _oracle(smol.model, recs[2]["prompt_ids"])
    assert _rel(cache.resid(12)[2], ref[12, -1]) < 1e-4
    # Readable without mechprobe.
    from safetensors.torch import load_file

    man = json.loads((out / "manifest.json").read_text())
    raw = load_file(str(out / man["shards"][0]["file"]))
    assert raw["boundary"].shape == (4, 31, 576)
    assert cache.to_numpy().shape == (6, 31, 576)

    # Labels: missing file -> clear error; judge_error -> NaN and masked out.
    with pytest.raises(FileNotFoundError, match="mechprobe judge"):
        cache.labels("genuine")
    ls = JsonlStore(run / "labels.jsonl", key="record_id")
    for i, rid in enumerate(cache.record_ids):
        err = i == 3
        ls.append(LabelRecord(record_id=rid, label="judge_error" if err else ("genuine_followup" if i % 2 else "new_query"),
                              genuine=None if err else bool(i % 2), rationale="", judge="t",
                              error="x" if err else None).to_dict())
    y = cache.labels("genuine")
    assert torch.isnan(y[3]) and y[1] == 1 and y[0] == 0
    assert cache.labeled_mask().tolist() == [True, True, True, False, True, True]

    # Interrupted caching resumes: drop the last shard from the manifest, re-run, same tensors.
    man["shards"] = man["shards"][:1]
    man["n_done"] = man["shards"][0]["end"]
    (out / "manifest.json").write_text(json.dumps(man))
    cache_run(run, smol, positions="boundary,assistant_mean", dtype="float32", batch_size=2, shard_rows=4,
              progress=False)
    torch.testing.assert_close(ActivationCache.load(run).resid(12), x)

    # Another dtype / positions -> refused, not mixed.
    with pytest.raises(CacheMismatch, match="different"):
        cache_run(run, smol, positions="boundary", dtype="float16", progress=False)


@pytest.mark.slow
def test_fp16_roundoff_and_stale_cache(smol, tmp_path):
    run = _fake_run(tmp_path, smol.tokenizer, n_items=2, samples=1)
    cache_run(run, smol, dtype="float16", progress=False)
    c16 = ActivationCache.load(run)
    ref = _oracle(smol.model, json.loads((run / "user_turns.jsonl").read_text().splitlines()[0])["prompt_ids"])
    errs = [_rel(c16.resid(r)[0], ref[r, -1]) for r in c16.layers]
    assert max(errs) < 1e-3  # fp16 storage: relative error per vector (docs/activations.md states the number)
    # The run regenerated with other rows: loading refuses the stale cache.
    p = run / "user_turns.jsonl"
    rows = p.read_text().splitlines()
    p.write_text("\n".join(reversed(rows)) + "\n")
    with pytest.raises(CacheMismatch, match="regenerated"):
        ActivationCache.load(run)
