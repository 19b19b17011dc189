"""The LM head on the last positions only, at full speed in bf16 on CPU (``forward.logits_kept``).

torch's bf16 ``linear`` on CPU is ~70x slower for an input whose batch stride spans more positions than it
holds (what ``logits_to_keep`` hands the LM head); ``compact_lm_head_input`` copies it to fresh strides.
These tests check the values are unchanged and the hook never outlives its block. Speed is measured in
``benchmarks/bench_speed.py --prefill``, not asserted here.
"""

from __future__ import annotations

import pytest
import torch

from mechprobe.lm.forward import _compact, compact_lm_head_input, logits_kept, tiny_model


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_compact_copies_only_strided_views():
    base = torch.randn(2, 7, 5)
    assert _compact(base) is base
    view = base[:1, -1:, :]  # is_contiguous() is True (size-1 dims), yet the batch stride is 35
    assert view.is_contiguous() and view.stride() == (35, 5, 1)
    fresh = _compact(view)
    assert fresh is not view and fresh.stride() == (5, 5, 1)
    assert torch.equal(fresh, view)
    assert _compact(base[:, 2:4]).stride() == (10, 5, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_logits_kept_equal_the_full_logits_last_positions(arch, dtype):
    """Same values as slicing the full logits. Tolerance: fp32 1e-5 (one matmul, summation order may differ
    with the number of rows); bf16 one bf16 ulp at these magnitudes (2e-2 absolute)."""
    model = tiny_model(arch).to(dtype)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(input_ids=ids).logits
        for keep in (1, 3):
            kept = logits_kept(model, keep, input_ids=ids).logits
            assert kept.shape == (2, keep, full.shape[-1])
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(kept.float(), full[:, -keep:].float(), rtol=tol, atol=tol)
    assert _hooks(model) == 0


def test_hook_is_removed_after_an_exception():
    model = tiny_model("llama")
    before = _hooks(model)
    with pytest.raises(RuntimeError, match="boom"):
        with compact_lm_head_input(model):
            assert _hooks(model) == before + 1
            raise RuntimeError("boom")
    assert _hooks(model) == before


def test_the_lm_head_sees_fresh_strides():
    model = tiny_model("qwen2")
    seen = []
    h = model.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0].stride()))
    try:
        with torch.inference_mode():
            logits_kept(model, 1, input_ids=torch.tensor([[3, 4, 5, 6]]))
            model(input_ids=torch.tensor([[3, 4, 5, 6]]), logits_to_keep=1)
    finally:
        h.remove()
    hidden = model.config.hidden_size
    assert seen[0] == (hidden, hidden, 1)  # compact: what the fast bf16 kernel needs
    assert seen[1] == (4 * hidden, hidden, 1)  # transformers' own slice: the slow path's input
