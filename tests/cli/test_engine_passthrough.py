"""`--engine` / `--dtype` reach the probe stage from the experiment scripts (issue 12: 1.5B runs need them)."""

from __future__ import annotations

import pytest

from mechprobe import stages
from tests.conftest import requires_smollm2, skip_without_working_llamacpp


def test_resolve_run_takes_engine_and_dtype(tmp_path):
    run, cfg = stages.resolve_run(tmp_path / "r", "smollm2-135m-instruct", "builtin", engine="llamacpp",
                                  dtype="bfloat16")
    assert (cfg.engine, cfg.dtype) == ("llamacpp", "bfloat16")
    _, cfg2 = stages.resolve_run(tmp_path / "r2", "smollm2-135m-instruct", "builtin")
    assert (cfg2.engine, cfg2.dtype) == ("hf", None)  # not given: the defaults, unchanged


def test_probe_stage_with_another_engine_does_not_load_the_hf_model(tmp_path, monkeypatch):
    _, cfg = stages.resolve_run(tmp_path / "r", "smollm2-135m-instruct", "builtin", engine="llamacpp")
    st = stages.Stages(tmp_path / "r", cfg)
    seen = {}

    def fake_run_probe(c, out, lm=None, **kw):
        seen["lm"] = lm
        return out

    monkeypatch.setattr(stages, "run_probe", fake_run_probe)
    monkeypatch.setattr(stages.Stages, "model", lambda self: pytest.fail("HF model loaded for a llamacpp probe"))
    st.probe()
    assert seen == {"lm": None}


@pytest.mark.slow
@requires_smollm2
def test_linear_probe_script_builds_a_llamacpp_run(tmp_path):
    skip_without_working_llamacpp()

    import mechprobe.cli.linear_probe as lp
    from mechprobe.io import read_json
    run = tmp_path / "run"
    code = lp.main(["--run", str(run), "--new", "--dataset", "builtin", "--limit", "4", "--samples", "1", "--max-assistant-tokens", "12",
                    "--max-user-tokens", "8", "--engine", "llamacpp", "--dtype", "bfloat16", "--layers", "0", "3",
                    "--n-boot", "20", "--no-shuffled", "--target", "turn"])
    assert code in (0, 3)  # 3 = too few positives on 4 items: the stages still ran
    cfg = read_json(run / "manifest.json")["identity"]["config"]
    assert (cfg["engine"], cfg["dtype"]) == ("llamacpp", "bfloat16")
    assert (run / "activations").is_dir()  # cached by the HF path (bf16) after a llama.cpp probe
