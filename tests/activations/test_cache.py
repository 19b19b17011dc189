"""The on-disk activation cache: round trip against the HF oracle, streaming shards, resume, refusals, labels.

Most tests use a tiny random-init model (wrapped in a ``LoadedModel``) over random-token prompts so they
run in about a second; the ``slow`` ones use the real embedded model with real probe prompts, through the
CLI, and measure the float16 round-off that docs/activations.md states.
"""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

from mechprobe.activations.cache import (
    ActivationCache,
    CacheCorrupt,
    CacheMismatch,
    cache_run,
    parse_layers,
    resid_name,
    shard_entry,
)
from mechprobe.cli import cache as cache_cli
from mechprobe.io import JsonlStore, write_json
from mechprobe.lm import chat
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.models import LoadedModel
from mechprobe.records import LabelRecord, UserTurnRecord, make_record_id
from tests.activations.test_backends import make_tiny_tokenizer, oracle, rel

POS3 = "boundary,assistant_last,assistant_mean"


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny_lm(tok, arch="llama", seed=0) -> LoadedModel:
    return LoadedModel(model=tiny_model(arch, seed=seed), tokenizer=tok, name=f"tiny-{arch}",
                       weight_hash=f"tiny-{arch}-{seed}", device=torch.device("cpu"), dtype=torch.float32)


def _record(item: int, k: int, ids: list[int], boundary: int, span: tuple[int, int]) -> dict:
    dec, temp = ("greedy", 0.0) if k == 0 else ("sample", 1.0)
    rid = make_record_id(f"it-{item}", dec, temp, 0 if k == 0 else k - 1)
    return UserTurnRecord(record_id=rid, item_id=f"it-{item}", dataset="t", decoding=dec, temperature=temp,
                          sample_index=0 if k == 0 else k - 1, seed=None if k == 0 else k, raw_text="x", text="x",
                          stop_reason="end_of_turn", prompt_ids=ids, boundary_index=boundary,
                          assistant_span=span).to_dict()


def tiny_run(tmp_path, n_items=4, per_item=3, first_item=0, name="run"):
    """A run directory of random-token probe prompts; the ``per_item`` turns of an item share one prompt."""
    run = tmp_path / name
    store = JsonlStore(run / "user_turns.jsonl", key="record_id")
    g = torch.Generator().manual_seed(7)
    for i in range(first_item, first_item + n_items):
        n = 6 + 3 * i
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        for k in range(per_item):
            store.append(_record(i, k, ids, n - 1, (2, n - 3)))
    return run


def write_run_manifest(run, lm: LoadedModel) -> None:
    write_json(run / "manifest.json", {"identity": {**lm.identity(), "config": {}}})


def rehash(out) -> None:
    """Record the current size and sha256 of every shard, as if the cache itself had written them."""
    man = json.loads((out / "manifest.json").read_text())
    man["shards"] = [shard_entry(out / sh["file"], sh["file"], sh["start"], sh["end"]) for sh in man["shards"]]
    (out / "manifest.json").write_text(json.dumps(man))


def turns(run) -> list[dict]:
    return [json.loads(x) for x in (run / "user_turns.jsonl").read_text().splitlines()]


def test_resid_names_and_layer_parsing():
    assert resid_name(0, 30).startswith("r0 = embeddings")
    assert resid_name(12, 30) == "r12 = output of block 11"
    assert "before final norm" in resid_name(30, 30)
    assert parse_layers("all", 3) == [0, 1, 2, 3] and parse_layers("3,0,3", 3) == [0, 3]
    with pytest.raises(ValueError, match="0..3"):
        parse_layers([4], 3)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_layers("first", 3)


def test_roundtrip_matches_oracle_and_reads_without_mechprobe(tmp_path, tiny_tok):
    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path)
    # shard_rows=5 would split the 3 turns of one prompt across shards: the shard is extended to the prompt's
    # last row instead (else that prompt runs twice, with other padding); batch 3 mixes lengths (left padding).
    out = cache_run(run, lm, positions=POS3, dtype="float32", batch_size=3, shard_rows=5, progress=False)
    cache = ActivationCache.load(run)
    rows = turns(run)
    assert len(cache) == 12 and cache.layers == [0, 1, 2, 3] and cache.positions == POS3.split(",")
    assert cache.record_ids == [r["record_id"] for r in rows] and cache.item_ids[:4] == ["it-0"] * 3 + ["it-1"]
    assert cache.resid(2).shape == (12, 64) and cache.resid(2).dtype == torch.float32
    for i, r in enumerate(rows):
        ref = oracle(lm.model, r["prompt_ids"])
        s, e = r["assistant_span"]
        assert rel(cache.stack("boundary")[i], ref[:, r["boundary_index"]]) < 1e-5
        assert rel(cache.stack("assistant_last")[i], ref[:, e - 1]) < 1e-5
        assert rel(cache.stack("assistant_mean")[i], ref[:, s:e].mean(1)) < 1e-5
    # Exact by construction: samples of one item share the prompt up to the boundary, which is computed
    # once per item and copied to each row, so no arithmetic differs between the two rows.
    for a in range(0, 12, 3):  # every item's rows, including the one shard_rows=5 would have split
        assert all(torch.equal(cache.resid(3)[a], cache.resid(3)[a + j]) for j in (1, 2))
    assert cache.to_numpy("assistant_mean").shape == (12, 4, 64)

    # Without mechprobe: manifest + safetensors, shards concatenated in manifest order.
    from safetensors.torch import load_file

    man = json.loads((out / "manifest.json").read_text())
    assert [s["end"] - s["start"] for s in man["shards"]] == [6, 6]
    raw = torch.cat([load_file(str(out / s["file"]))["boundary"] for s in man["shards"]])
    assert torch.equal(raw[:, man["layers"].index(2)], cache.resid(2))  # the same stored bytes, read twice
    assert man["identity"]["weight_hash"] == "tiny-llama-0" and "layer_convention" in man
    assert "tiny-llama" in repr(cache)


def test_interrupted_caching_resumes_without_redoing_shards(tmp_path, tiny_tok, monkeypatch):
    import mechprobe.activations.build as act

    lm = tiny_lm(tiny_tok)
    ref_run = tiny_run(tmp_path, name="ref")
    cache_run(ref_run, lm, dtype="float32", batch_size=2, shard_rows=3, progress=False)
    run = tiny_run(tmp_path)
    real, calls, crash = act._capture_records, [], {"at": 2}

    def crash_on_second_shard(*a, **k):
        calls.append(1)
        if len(calls) == crash["at"]:
            raise RuntimeError("killed mid-run")
        return real(*a, **k)

    monkeypatch.setattr(act, "_capture_records", crash_on_second_shard)
    with pytest.raises(RuntimeError, match="killed mid-run"):
        cache_run(run, lm, dtype="float32", batch_size=2, shard_rows=3, progress=False)
    man = json.loads((run / "activations" / "manifest.json").read_text())
    assert man["n_done"] == 3 and len(man["shards"]) == 1
    with pytest.raises(CacheMismatch, match="incomplete"):
        ActivationCache.load(run)
    (run / "activations" / "shard_00001.safetensors").write_bytes(b"half-written")  # not in the manifest
    calls.clear()
    crash["at"] = -1
    cache_run(run, lm, dtype="float32", batch_size=2, shard_rows=3, progress=False)
    assert len(calls) == 3  # shards 2, 3 and 4 only
    # Recomputed shards use the same batches as the reference run; equal up to fp32 reduction order
    # (rel 1e-6), while a wrong row or position after resume would differ by O(1).
    assert rel(ActivationCache.load(run).stack(), ActivationCache.load(ref_run).stack()) < 1e-6
    cache_run(run, lm, dtype="float32", batch_size=2, shard_rows=3, progress=False)  # complete: a no-op
    assert len(calls) == 3


def test_grown_run_warns_then_extends(tmp_path, tiny_tok):
    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path, n_items=2)
    cache_run(run, lm, progress=False)
    first = ActivationCache.load(run).resid(3)
    more = tiny_run(tmp_path, n_items=1, first_item=2)  # same run dir name: appends to user_turns.jsonl
    assert more == run and len(turns(run)) == 9
    with pytest.warns(UserWarning, match="covers 6 of the run's 9"):
        ActivationCache.load(run)
    cache_run(run, lm, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grown = ActivationCache.load(run)
    assert len(grown) == 9
    assert torch.equal(grown.resid(3)[:6], first)  # exact: the first shards are kept, not recomputed


def test_refuses_other_model_template_or_options(tmp_path, tiny_tok):
    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path)
    cache_run(run, lm, positions="boundary", progress=False)
    with pytest.raises(CacheMismatch, match="weight_hash"):
        cache_run(run, tiny_lm(tiny_tok, seed=1), progress=False)
    with pytest.raises(CacheMismatch, match="dtype: cache has 'float16', now 'float32'"):
        cache_run(run, lm, dtype="float32", progress=False)
    with pytest.raises(CacheMismatch, match="positions"):
        cache_run(run, lm, positions=POS3, progress=False)
    with pytest.raises(CacheMismatch, match="layers"):
        cache_run(run, lm, layers="0,3", progress=False)
    # The run's own manifest pins model and template: another template is refused before any work ...
    write_run_manifest(run, lm)
    other = tiny_lm(tiny_tok)
    other.tokenizer = make_tiny_tokenizer(tmp_path / "tok2")
    other.tokenizer.chat_template = "{{ messages }}"
    with pytest.raises(CacheMismatch, match="template_hash"):
        cache_run(run, other, progress=False)
    # ... and a cache whose hashes differ from the run's is refused on load.
    write_run_manifest(run, other)
    with pytest.raises(CacheMismatch, match="another model/template"):
        ActivationCache.load(run)


def test_load_detects_regenerated_run_nan_and_bad_shapes(tmp_path, tiny_tok):
    from safetensors.torch import load_file, save_file

    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path)
    out = cache_run(run, lm, progress=False)
    p = run / "user_turns.jsonl"
    lines = p.read_text().splitlines()
    p.write_text("\n".join(reversed(lines)) + "\n")
    with pytest.raises(CacheMismatch, match="regenerated"):
        ActivationCache.load(run)
    with pytest.raises(CacheMismatch, match="regenerated"):
        cache_run(run, lm, progress=False)
    p.write_text("\n".join(lines) + "\n")
    shard = out / "shard_00000.safetensors"
    t = load_file(str(shard))
    t["boundary"][3, 1, 5] = float("nan")
    save_file(t, str(shard))
    with pytest.raises(CacheCorrupt, match="shard_00000.safetensors"):  # the checksum sees the edit first
        ActivationCache.load(run)
    rehash(out)  # as if NaN had been written by the cache itself: the content check must catch it
    with pytest.raises(CacheMismatch, match="NaN"):
        ActivationCache.load(run)
    man = json.loads((out / "manifest.json").read_text())
    man["layers"] = [0, 1, 2]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CacheMismatch, match="shape"):
        ActivationCache.load(run)
    with pytest.raises(FileNotFoundError, match="mechprobe cache"):
        ActivationCache.load(tmp_path / "nowhere")


def test_labels_mask_and_dataset(tmp_path, tiny_tok):
    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path)
    cache_run(run, lm, progress=False)
    cache = ActivationCache.load(run)
    with pytest.raises(FileNotFoundError, match=f"mechprobe judge {run}"):
        cache.labels("genuine")
    store = JsonlStore(run / "labels.jsonl", key="record_id")
    for i, rid in enumerate(cache.record_ids[:-1]):  # the last row is never judged
        err = i == 3
        store.append(LabelRecord(record_id=rid, label="judge_error" if err else ("genuine_followup" if i % 2 else
                                 "new_query"), genuine=None if err else bool(i % 2), rationale="", judge="t",
                                 error="timeout" if err else None).to_dict())
    y = cache.labels("genuine")
    assert y[1] == 1 and y[0] == 0 and torch.isnan(y[3]) and torch.isnan(y[-1])
    mask = cache.labeled_mask()
    assert mask.tolist() == [i not in (3, 11) for i in range(12)]
    assert cache.labels("label")[1] == "genuine_followup" and cache.labels("label")[3] is None
    X, yy, groups, ids = cache.dataset(2)
    assert X.shape == (10, 64) and yy.dtype == torch.long and yy.tolist() == y[mask].long().tolist()
    torch.testing.assert_close(X, cache.resid(2)[mask])
    assert groups == [g for g, m in zip(cache.item_ids, mask) if m] and ids[3] == cache.record_ids[4]
    with pytest.raises(ValueError, match="field must be"):
        cache.labels("score")
    with pytest.raises(KeyError, match="not cached"):
        cache.resid(2, "assistant_mean")
    with pytest.raises(KeyError, match="layer 9 not cached"):
        cache.resid(9)


def test_float16_overflow_is_refused_not_stored_as_inf(tmp_path, tiny_tok):
    lm = tiny_lm(tiny_tok)
    with torch.no_grad():
        lm.model.get_input_embeddings().weight.mul_(1e8)  # embeddings far beyond float16's 65504
    run = tiny_run(tmp_path)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cache_run(run, lm, progress=False)
    assert not list((run / "activations").glob("shard_*"))
    cache_run(run, lm, dtype="bfloat16", progress=False)
    assert ActivationCache.load(run).resid(0).abs().max() > 1e5


def test_bad_input_errors(tmp_path, tiny_tok):
    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path)
    with pytest.raises(ValueError, match="unknown backend"):
        cache_run(run, lm, backend="pyvene", progress=False)
    with pytest.raises(ValueError, match="unknown positions"):
        cache_run(run, lm, positions="boundary,last_token", progress=False)
    with pytest.raises(ValueError, match="dtype must be"):
        cache_run(run, lm, dtype="int8", progress=False)
    with pytest.raises(FileNotFoundError, match="mechprobe probe"):
        cache_run(tmp_path / "empty", lm, progress=False)
    with pytest.raises(FileNotFoundError, match="pass a model"):
        cache_run(run, None, progress=False)


@pytest.mark.parametrize("backend", ["nnsight", "transformer-lens"])
def test_backends_write_the_same_cache(tmp_path, tiny_tok, backend):
    lm = tiny_lm(tiny_tok, arch="gemma3")
    ref = ActivationCache.load(cache_run(tiny_run(tmp_path, name="hooks"), lm, positions=POS3, dtype="float32",
                                         progress=False))
    other = ActivationCache.load(cache_run(tiny_run(tmp_path, name=backend), lm, backend=backend, positions=POS3,
                                           dtype="float32", progress=False))
    assert other.meta["backend"] == backend
    for pos in POS3.split(","):
        assert rel(other.stack(pos), ref.stack(pos)) < 1e-5


# ---------------------------------------------------------------- real model

def _real_run(tmp_path, lm) -> object:
    run = tmp_path / "real"
    store = JsonlStore(run / "user_turns.jsonl", key="record_id")
    qa = [("What is 3*3?", "3*3 = 9."), ("Capital of France?", "Paris is the capital of France.")]
    for i, (q, a) in enumerate(qa):
        pp = chat.build_probe_prompt(lm.tokenizer, q, a)
        for k in range(2):
            store.append(_record(i, k, pp.input_ids, pp.boundary_index, pp.assistant_span))
    write_run_manifest(run, lm)
    return run


@pytest.mark.slow
def test_real_model_cli_and_float16_roundoff(smol, tmp_path, capsys, monkeypatch):
    """`mechprobe cache` on real probe prompts; fp16 storage vs the fp32 oracle stays within 1e-3 relative."""
    run = _real_run(tmp_path, smol)
    p = argparse.ArgumentParser()
    cache_cli.add_args(p)
    a = p.parse_args([str(run), "--positions", "boundary,assistant_last", "--no-progress"])
    # The CLI loads the run's model from its manifest; hand it the loaded one instead to keep the test short.
    import mechprobe.activations.build as act

    monkeypatch.setattr(act, "load_model", lambda name, **kw: smol if name == smol.name else None)
    assert cache_cli.run(a) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 4 and summary["layers"] == 31 and summary["dtype"] == "float16"
    cache = ActivationCache.load(run)
    rows = turns(run)
    errs = []
    for i in (0, 2):
        ref = oracle(smol.model, rows[i]["prompt_ids"])[:, rows[i]["boundary_index"]]
        errs.append(rel(cache.stack()[i], ref))
        assert torch.equal(cache.stack()[i], cache.stack()[i + 1])  # exact: one item's rows are copies
    assert 1e-5 < max(errs) < 1e-3, errs  # fp16 round-off: measured ~3e-4 (docs/activations.md)


def test_item9_corrupt_shards_are_named_on_load_and_rebuilt_by_cache(tmp_path, tiny_tok, monkeypatch):
    """Issue 11 item 9: a truncated, a zeroed and a deleted shard each give a UserError naming the file and
    the fix on load; ``cache_run`` (what ``mechprobe cache`` runs) rebuilds exactly those shards' rows."""
    from mechprobe.activations import build as activations
    from mechprobe.errors import UserError

    lm = tiny_lm(tiny_tok)
    run = tiny_run(tmp_path)  # 12 records
    out = cache_run(run, lm, progress=False, shard_rows=3)  # 4 shards of 3 rows (one item each)
    man = json.loads((out / "manifest.json").read_text())
    assert [(s["start"], s["end"]) for s in man["shards"]] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in man["shards"])
    assert man["residual_convention"] == "resid_pre: r = input of block r; 0 = embeddings"
    good = ActivationCache.load(run).stack().clone()
    files = [out / s["file"] for s in man["shards"]]

    # Truncated: the first half of shard 1 only.
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"shard_00001\.safetensors has \d+ bytes.*mechprobe cache"):
        ActivationCache.load(run)
    files[1].write_bytes(data)
    # Zeroed bytes, same size: the old loader returned different values without a word.
    data2 = bytearray(files[2].read_bytes())
    data2[-64:] = bytes(64)
    files[2].write_bytes(bytes(data2))
    with pytest.raises(CacheCorrupt, match=r"shard_00002\.safetensors does not match its recorded sha256"):
        ActivationCache.load(run)

    # Repair: shard 2 is corrupt and shard 0 is deleted; shard 1 is intact and must not be recomputed.
    files[0].unlink()
    untouched = (files[1].stat().st_mtime_ns, files[1].read_bytes())
    captured: list[int] = []
    real = activations._capture_records

    def counting(cap, recs, *a, **k):
        captured.append(len(recs))
        return real(cap, recs, *a, **k)

    monkeypatch.setattr(activations, "_capture_records", counting)
    cache_run(run, lm, progress=False, shard_rows=3)
    assert captured == [3, 3]  # shard 0 and shard 2 rows, nothing else
    assert (files[1].stat().st_mtime_ns, files[1].read_bytes()) == untouched
    man2 = json.loads((out / "manifest.json").read_text())
    assert man2["repaired"] == ["shard_00000.safetensors", "shard_00002.safetensors"]
    assert [(s["start"], s["end"]) for s in man2["shards"]] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    again = ActivationCache.load(run).stack()
    # Same model, prompts and batches recomputed: equal up to float16 storage round-off of the CPU kernels
    # (identical in practice; 1e-3 relative is one float16 ulp, the most a re-run could differ by).
    torch.testing.assert_close(again, good, rtol=1e-3, atol=1e-3)
    captured.clear()
    cache_run(run, lm, progress=False, shard_rows=3)  # a healthy cache: nothing to do
    assert captured == [] and json.loads((out / "manifest.json").read_text())["repaired"] == []


def test_a_run_without_a_cache_is_a_clear_error_not_a_keyerror(tmp_path):
    """ActivationCache.load(run) on a run that was never cached read the run's own manifest (KeyError)."""
    from mechprobe.errors import MissingInput

    (tmp_path / "manifest.json").write_text(json.dumps({"config": {}, "identity": {}}))
    with pytest.raises(MissingInput, match=r"mechprobe cache"):
        ActivationCache.load(tmp_path)


def _pooled_store(lm, prompts):
    """A judge-like KV store over ``lm`` holding exactly ``prompts`` in its pool (as the hybrid judge leaves them)."""
    from mechprobe.lm.choice import ChoiceScorer

    store = ChoiceScorer(lm.model, lm.tokenizer, ["x"], pool_bytes=2**26)
    for ids in prompts:
        store.remember("real", ids)
        store.forget("real", pool=True)
    return store


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cache_from_the_judges_kept_prefixes_equals_the_full_forward(tmp_path, tiny_tok, arch):
    # Oracle: the ordinary batched, left-padded capture of the same prompts. The pooled prompts run one token
    # from the judge's keys and values; the others run as before. fp32: equal up to summation order.
    lm = tiny_lm(tiny_tok, arch)
    ref, run = tiny_run(tmp_path, name="ref"), tiny_run(tmp_path)
    cache_run(ref, lm, dtype="float32", batch_size=3, progress=False)
    prompts = list(dict.fromkeys(tuple(r["prompt_ids"]) for r in turns(run)))
    store = _pooled_store(lm, [list(p) for p in prompts[1:3]])  # two of the four items' conversations
    out = cache_run(run, lm, dtype="float32", batch_size=3, progress=False, prefixes=store)
    torch.testing.assert_close(ActivationCache.load(run).stack(), ActivationCache.load(ref).stack(),
                               rtol=1e-4, atol=1e-5)
    assert json.loads((out / "manifest.json").read_text())["timing"]["prefix_hits"] == 2


def test_prefixes_of_another_model_or_position_are_not_used(tmp_path, tiny_tok):
    lm, other = tiny_lm(tiny_tok), tiny_lm(tiny_tok)  # same seed, same values, but another loaded model
    run = tiny_run(tmp_path)
    prompts = [list(p) for p in dict.fromkeys(tuple(r["prompt_ids"]) for r in turns(run))]
    out = cache_run(run, lm, dtype="float32", progress=False, prefixes=_pooled_store(other, prompts))
    assert "prefix_hits" not in json.loads((out / "manifest.json").read_text())["timing"]
    run2 = tiny_run(tmp_path, name="two_positions")
    out2 = cache_run(run2, lm, dtype="float32", progress=False, positions="boundary,assistant_last",
                     prefixes=_pooled_store(lm, prompts))
    assert "prefix_hits" not in json.loads((out2 / "manifest.json").read_text())["timing"]


def test_continued_capture_removes_its_hooks_after_an_error(tiny_tok):
    from mechprobe.activations.backends import HooksBackend
    from mechprobe.lm.forward import get_blocks

    lm = tiny_lm(tiny_tok)
    cap = HooksBackend(lm.model)
    ids = list(range(3, 15))
    store = _pooled_store(lm, [ids])
    kv = store.pooled(ids)
    # keys of another width: the forward fails inside attention, after the hooks were registered
    bad = [(k[..., :-1], v[..., :-1]) for k, v in kv]
    with pytest.raises(RuntimeError):
        cap.capture_continued(ids + [5], 12, [0, 1, 2], bad)
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in get_blocks(lm.model))
    with pytest.raises(ValueError, match="boundary 3 must lie"):
        cap.capture_continued(ids + [5], 3, [1], kv)  # the boundary lies inside the given keys


def test_the_judges_pool_is_sized_for_the_runs_conversations_within_free_memory(tmp_path, tiny_tok, monkeypatch):
    from mechprobe import stages

    lm = tiny_lm(tiny_tok)  # 3 layers x 2 KV heads x head_dim 16, fp32: 768 bytes of keys and values per token
    run = tiny_run(tmp_path)  # 4 items (prompts of 6, 9, 12, 15 tokens), 3 turns each
    monkeypatch.setattr(stages, "free_memory_bytes", lambda device: 10**9)
    assert stages.pool_bytes_for(run, lm.model) == (6 + 9 + 12 + 15) * 768
    monkeypatch.setattr(stages, "free_memory_bytes", lambda device: 40_000)
    assert stages.pool_bytes_for(run, lm.model) == 10_000  # a quarter of the free memory
