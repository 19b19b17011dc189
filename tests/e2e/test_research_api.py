"""The public research loop: cache -> fit_probe -> SteeringVector -> vec.apply -> generate.

Fast tests run the loop on a tiny random-init model through the real cache writer (a planted signal:
the boundary token decides the label); the slow test runs the README's Python API example on the
embedded model, as a user would paste it.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from mechprobe import (
    ActivationCache,
    LinearProbe,
    LoadedModel,
    SteeringVector,
    cache_run,
    diff_of_means,
    fit_probe,
    generate,
    tiny_model,
)
from mechprobe.errors import UsageError, UserError
from mechprobe.io import dumps_row
from mechprobe.records import LabelRecord, UserTurnRecord
from mechprobe.steering.vector import placeholder_tokenizer
from tests.conftest import REPO, requires_smollm2

POS_TOKEN, NEG_TOKEN = 5, 9  # the boundary token of genuine / other rows: the planted signal


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run of 30 items x 2 user turns on a tiny random model, cached at every layer, labels planted."""
    run = tmp_path_factory.mktemp("api") / "run"
    run.mkdir()
    model = tiny_model("llama", seed=0)
    lm = LoadedModel(model=model, tokenizer=placeholder_tokenizer(int(model.config.vocab_size)), name="tiny-llama",
                     weight_hash="t" * 64, device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    turns, labels = [], []
    for i in range(30):
        genuine = i % 3 == 0
        ids = [*torch.randint(10, 100, (6,), generator=g).tolist(), POS_TOKEN if genuine else NEG_TOKEN]
        for k, dec in enumerate(("greedy", "sample")):
            rid = f"it{i}|{dec}|s{k}"
            turns.append(UserTurnRecord(record_id=rid, item_id=f"it{i}", dataset="synthetic", decoding=dec,
                                        temperature=0.0 if k == 0 else 1.0, sample_index=0, seed=None if k == 0 else k,
                                        raw_text="x", text="x", stop_reason="end_of_turn", prompt_ids=ids,
                                        boundary_index=len(ids) - 1, assistant_span=(2, 4)).to_dict())
            labels.append(LabelRecord(record_id=rid, label="genuine_followup" if genuine else "restatement",
                                      genuine=genuine, rationale="planted", judge="planted").to_dict())
    (run / "user_turns.jsonl").write_text("".join(dumps_row(t) + "\n" for t in turns))
    (run / "labels.jsonl").write_text("".join(dumps_row(r) + "\n" for r in labels))
    cache = ActivationCache.load(cache_run(run, lm, dtype="float32", progress=False))
    return lm, cache


def test_cache_names_its_model(tiny_run):
    _, cache = tiny_run
    assert cache.model_name == "tiny-llama"
    assert cache.weight_hash == "t" * 64


def test_fit_probe_on_the_run_labels_separates_the_planted_signal(tiny_run):
    _, cache = tiny_run
    probe = fit_probe(cache, layer=2)
    assert isinstance(probe, LinearProbe)
    assert math.isclose(float(probe.direction.norm()), 1.0, rel_tol=1e-5)
    assert (probe.n_pos, probe.n_neg, probe.n_items) == (20, 40, 30)
    assert probe.auroc > 0.95 and probe.train_auroc > 0.95  # grouped CV, not only the training rows
    x = cache.resid(2)
    s_torch, s_numpy = probe.score(x), probe.score(x.numpy())
    assert isinstance(s_torch, np.ndarray) and np.allclose(s_torch, s_numpy, atol=1e-4)
    y = cache.labels("genuine").numpy()
    assert s_torch[y == 1].min() > s_torch[y == 0].max()
    assert probe.metadata["model"] == "tiny-llama" and probe.metadata["resid_norm"] > 0


def test_fit_probe_direction_recovers_a_planted_direction(tmp_path):
    # A synthetic cache: noise plus a fixed direction on the genuine rows. The probe must find that direction.
    rng = np.random.default_rng(0)
    n, d = 240, 32
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    y = (np.arange(n) % 4 == 0).astype(float)
    x = rng.standard_normal((n, d)) + 3.0 * y[:, None] * u
    ids = [f"r{i}" for i in range(n)]
    meta = {"record_ids": ids, "item_ids": [f"it{i // 2}" for i in range(n)], "layers": [4], "positions": ["boundary"],
            "d_model": d, "n_layers_model": 6, "model": "synthetic", "dtype": "float32", "identity": {}}
    cache = ActivationCache(path=tmp_path / "activations", meta=meta,
                            _tensors={"boundary": torch.tensor(x, dtype=torch.float32)[:, None, :]})
    probe = fit_probe(cache, 4, labels=y)
    assert math.isclose(float(probe.direction.norm()), 1.0, rel_tol=1e-5)
    assert float(probe.direction.double() @ torch.from_numpy(u)) > 0.9
    assert probe.auroc > 0.95
    # The labels can leave rows out (NaN), and bad labels are refused with a one-line error.
    y_part = y.copy()
    y_part[:40] = np.nan
    assert fit_probe(cache, 4, labels=y_part, folds=0).n_pos + fit_probe(cache, 4, labels=y_part, folds=0).n_neg == 200
    with pytest.raises(UsageError, match="one label per row"):
        fit_probe(cache, 4, labels=y[:10])
    with pytest.raises(UsageError, match="not cached"):
        fit_probe(cache, 3, labels=y)
    with pytest.raises(UserError, match="at least 2 rows of each class"):
        fit_probe(cache, 4, labels=np.zeros(n))


def test_alpha_zero_is_token_identical_and_steering_moves_the_boundary(tiny_run):
    lm, cache = tiny_run
    vec = SteeringVector.from_probe(fit_probe(cache, layer=2, folds=0))
    assert vec.kind == "probe" and vec.layer == 2 and vec.metadata["weight_hash"] == lm.weight_hash
    prompts = [[11, 12, 13, POS_TOKEN], [20, 21, NEG_TOKEN]]
    base = generate(lm, prompts, stop_ids={}, max_new_tokens=8)
    with vec.apply(lm, alpha=0.0):
        zero = generate(lm, prompts, stop_ids={}, max_new_tokens=8)
    assert [g.token_ids for g in zero] == [g.token_ids for g in base]
    assert all(g.text is not None for g in base)  # a LoadedModel gives decoded text
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        before = lm.model(ids).logits[0, -1]
        with vec.apply(lm, alpha=2.0):
            steered = lm.model(ids).logits[0, -1]
    assert not torch.allclose(before, steered, atol=1e-4)


def test_apply_in_resid_units_adds_alpha_times_the_residual_norm(tiny_run):
    lm, cache = tiny_run
    vec = diff_of_means(cache, 2)
    assert vec.metadata["model"] == "tiny-llama" and vec.metadata["n_pos"] == 20
    added: list[torch.Tensor] = []
    block = lm.model.model.layers[1]  # residual index 2 = output of block 1
    ids = torch.tensor([[11, 12, 13, POS_TOKEN]])

    def grab(_m, _i, out):
        added.append((out if isinstance(out, torch.Tensor) else out[0])[0, -1].clone())

    with torch.no_grad():
        h = block.register_forward_hook(grab)  # registered before apply: sees the unsteered output
        try:
            lm.model(ids)
            with vec.apply(lm, alpha=0.5, positions="boundary"):
                lm.model(ids)
        finally:
            h.remove()
    # steer's hook is prepended, so `grab` sees the steered value in the second call.
    delta = float((added[1] - added[0]).norm())
    assert math.isclose(delta, 0.5 * vec.resid_norm, rel_tol=1e-3)
    with pytest.raises(UsageError, match="alpha unit"):
        vec.apply(lm, alpha=1.0, unit="sigma").__enter__()


def test_hooks_are_removed_after_an_exception(tiny_run):
    lm, cache = tiny_run
    vec = SteeringVector.from_probe(fit_probe(cache, layer=2, folds=0))
    n0 = _hooks(lm.model)
    ids = torch.tensor([[11, 12, 13, POS_TOKEN]])
    with torch.no_grad():
        before = lm.model(ids).logits
    with pytest.raises(RuntimeError, match="boom"), vec.apply(lm, alpha=3.0):
        assert _hooks(lm.model) > n0
        raise RuntimeError("boom")
    assert _hooks(lm.model) == n0
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, before)


def test_generate_needs_stop_ids_or_a_loaded_model():
    with pytest.raises(UsageError, match="stop_ids"):
        generate(tiny_model("llama"), [[1, 2, 3]])


def readme_python_example() -> str:
    """The ```python block under the README's "Python API" heading."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README.md: no ```python block under ## Python API"
    return m.group(1)


def test_readme_example_uses_the_public_api():
    code = readme_python_example()
    for name in ("fit_probe", "SteeringVector.from_probe", ".apply(", "generate("):
        assert name in code, f"the README example no longer shows {name}"


@pytest.mark.slow
@requires_smollm2
def test_readme_python_example_runs_on_the_embedded_model(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", readme_python_example()], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LinearProbe(layer=" in r.stdout, r.stdout
