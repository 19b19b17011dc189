"""Mistakes a user can make that used to lose work or give silently wrong results: each must be refused in
one line (exit 2) before anything expensive runs, or handled correctly. No test here loads a model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mechprobe.errors import UsageError, UserError

# --------------------------------------------------------------------------- study.py


def _study(argv, tmp_path):
    from mechprobe.cli.study import main

    return main([*argv, "--no-progress", "--report-dir", str(tmp_path / "rep"), "--figures-dir",
                 str(tmp_path / "figs")])


def test_study_report_only_never_replaces_a_report_with_an_empty_one(tmp_path, capsys):
    rep = tmp_path / "rep" / "README.md"
    rep.parent.mkdir()
    rep.write_text("# the committed study report\n" + "line\n" * 180)
    before = rep.read_text()
    code = _study(["--report-only", "--judge", "offline", "--root", str(tmp_path / "no-such-root")], tmp_path)
    assert code == 2
    assert rep.read_text() == before
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--judge", "bogus"], "unknown judge"),
    (["--judge", "hybrid:nosuch-model"], "nosuch-model"),
    (["--models", "bogus"], "--models 'bogus'"),
    (["--variant-samples", "-2"], "--variant-samples"),
    (["--max-user-tokens", "0"], "max_user_tokens"),
    (["--max-assistant-tokens", "0"], "max_assistant_tokens"),
    (["--limit", "-1"], "--limit"),
    (["--samples", "-1"], "samples"),
    (["--temperatures", "nan"], "temperatures"),
    (["--datasets", "nosuch"], "nosuch"),
    (["--data-path", "/no/such/folder"], "--data-path"),
])
def test_study_refuses_bad_options_before_anything_is_written(tmp_path, capsys, argv, needle):
    root = tmp_path / "root"
    t = time.time()
    code = _study([*argv, "--judge" if "--judge" not in argv else "--quick", *(["offline"] if "--judge" not in argv
                   else []), "--root", str(root)], tmp_path)
    assert code == 2 and time.time() - t < 5
    assert not (root / "plan.json").exists()  # a resume would inherit a bad value
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_study_exits_nonzero_when_every_model_failed(tmp_path, monkeypatch, capsys):
    import mechprobe.study.run as study

    monkeypatch.setattr(study, "model_unavailable", lambda m: "weights not fetched")
    code = _study(["--judge", "offline", "--models", "smollm2-135m-instruct", "--datasets", "gsm8k", "--root",
                   str(tmp_path / "root")], tmp_path)
    assert code == 2
    assert "every model failed" in capsys.readouterr().err
    assert json.loads((tmp_path / "root" / "plan.json").read_text())["unavailable"]


# --------------------------------------------------------------------------- weight identity


def test_weight_fingerprint_sees_an_interior_edit_and_reuses_unchanged_hashes(tmp_path, monkeypatch):
    import mechprobe.lm.models as models

    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    w = d / "model.safetensors"
    w.write_bytes(bytes(3 << 20))
    old = time.time() - 100
    os.utime(w, (old, old))
    calls = []
    real = models.sha256_file
    monkeypatch.setattr(models, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    name, h1 = models.weight_identity(str(d))
    assert models.weight_identity(str(d))[1] == h1 and len(calls) == 1  # second call: cached, not re-hashed
    assert str(w.resolve()) in json.loads((tmp_path / "cache" / models.HASH_CACHE).read_text())
    with open(w, "r+b") as f:  # an interior layer edited in place: same size, same first and last MiB
        f.seek(3 << 19)
        f.write(b"\x01")
    assert models.weight_identity(str(d))[1] != h1


# --------------------------------------------------------------------------- agreement


def _run_with_labels(root: Path, texts: dict[str, str], label: str = "new_query") -> Path:
    root.mkdir(parents=True)
    with open(root / "user_turns.jsonl", "w") as f:
        for rid, t in texts.items():
            f.write(json.dumps({"record_id": rid, "item_id": rid.split("|")[0], "raw_text": t, "text": t}) + "\n")
    with open(root / "labels.jsonl", "w") as f:
        for rid in texts:
            f.write(json.dumps({"record_id": rid, "label": label, "genuine": False, "rationale": "",
                                "judge": "offline-v3+lexical"}) + "\n")
    return root


def test_agreement_refuses_to_join_different_turns(tmp_path, capsys):
    from mechprobe.cli import main

    a = _run_with_labels(tmp_path / "a", {"i0|greedy|s0": "What about 5?", "i1|greedy|s0": "Thanks"})
    b = _run_with_labels(tmp_path / "b", {"i0|greedy|s0": "Tell me a joke", "i1|greedy|s0": "Thanks"})
    assert main(["agreement", str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "i0|greedy|s0" in err[0]
    same = _run_with_labels(tmp_path / "c", {"i0|greedy|s0": "What about 5?", "i1|greedy|s0": "Thanks"})
    assert main(["agreement", str(a), str(same)]) == 0


# --------------------------------------------------------------------------- a mistyped run path


def _probes_args(*argv):
    import argparse

    from mechprobe.cli.linear_probe import add_args, config_from_args

    p = argparse.ArgumentParser()
    add_args(p)
    return config_from_args(p.parse_args(list(argv)))


def _fake_run(run: Path, limit: int = 10) -> Path:
    """A run directory as far as resolution is concerned: a manifest with the full probe config."""
    from dataclasses import asdict

    from mechprobe.turns.pipeline import ProbeConfig

    cfg = ProbeConfig(dataset="builtin", limit=limit)
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"config": asdict(cfg), "identity": {"config": cfg.identity()}}))
    return run


@pytest.mark.parametrize("cmd", [["probes", "{run}", "--dataset", "builtin"],
                                 ["steer", "{run}", "--dataset", "builtin"],
                                 ["steer", "--run", "{run}"]])
def test_a_mistyped_run_is_refused_not_built(tmp_path, capsys, cmd):
    from mechprobe.cli import main

    typo = tmp_path / "runs" / "smol-gsm8kk"
    t = time.time()
    assert main([c.format(run=typo) for c in cmd]) == 2 and time.time() - t < 5
    assert not typo.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--new" in err[0]


def test_transfer_runs_typo_is_refused_before_any_stage(tmp_path):
    from mechprobe.linear.experiment import run_linear_probe

    run = _fake_run(tmp_path / "run")
    with pytest.raises(UserError, match="--transfer-runs"):
        run_linear_probe(_probes_args("--run", str(run), "--transfer-runs", str(tmp_path / "typo")))
    assert not (tmp_path / "typo").exists()


def test_new_and_default_runs_are_still_built(tmp_path, monkeypatch):
    from mechprobe.linear.experiment import run_linear_probe

    built = []

    def fake_ensure(run, cfg, *a, **kw):
        built.append(run)
        raise KeyboardInterrupt  # stop here: the build was reached

    import mechprobe.linear.experiment as experiment

    monkeypatch.setattr(experiment, "ensure_stages", fake_ensure)
    monkeypatch.chdir(tmp_path)
    for argv in (["--dataset", "builtin"], ["--run", str(tmp_path / "fresh"), "--new", "--dataset", "builtin"]):
        with pytest.raises(KeyboardInterrupt):
            run_linear_probe(_probes_args(*argv))
    assert built[0] == Path("runs/smollm2-135m-instruct-builtin") and built[1] == tmp_path / "fresh"


def test_limit_below_an_existing_runs_items_is_refused(tmp_path, capsys):
    from mechprobe.cli import main

    run = _fake_run(tmp_path / "run", limit=10)
    assert main(["probes", str(run), "--limit", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--limit 5 would not apply" in err[0]


# --------------------------------------------------------------------------- post_train.py


def _post_train(argv):
    import importlib.util

    from mechprobe.cli.common import friendly
    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("post_train_script", REPO / "experiments" / "post_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return friendly(lambda: mod.main(argv))


@pytest.mark.parametrize("argv, needle", [
    (["--judge", "bogus"], "unknown judge"),
    (["--judge", "local:nosuch"], "nosuch"),
    (["--model", "bogus"], "--model 'bogus'"),
    (["--eval-datasets", "nosuch"], "--eval-datasets"),
    (["--sources", "nosuch"], "--sources"),
    (["--temperature", "0"], "--temperature"),
    (["--held-out-fraction", "1.5"], "--held-out-fraction"),
    (["--max-user-tokens", "0"], "--max-user-tokens"),
    (["--warmup-steps", "-1"], "warmup_steps"),
    (["--lora-alpha", "0"], "lora_alpha"),
    (["--target-modules", "q_proj,,v_proj"], "target_modules"),
    (["--device", "gpu7"], "--device"),
])
def test_post_train_refuses_bad_options_before_any_model_loads(tmp_path, monkeypatch, capsys, argv, needle):
    import mechprobe.lm.models as models

    def no_load(*a, **kw):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(models, "load_model", no_load)
    t = time.time()
    assert _post_train([*argv, "--out", str(tmp_path / "out")]) == 2 and time.time() - t < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_target_modules_are_checked_against_the_model_before_training():
    from mechprobe.lm.forward import tiny_model
    from mechprobe.post_train.train import TrainConfig, check_target_modules

    model = tiny_model("llama")
    check_target_modules(model, TrainConfig(target_modules="q_proj,v_proj"))
    check_target_modules(model, TrainConfig())  # all-linear
    with pytest.raises(UsageError, match=r"\['nosuch'\].*q_proj"):
        check_target_modules(model, TrainConfig(target_modules="q_proj,nosuch"))


# --------------------------------------------------------------------------- lesser items


def _judge_run_dir(tmp_path: Path) -> Path:
    from tests.judges.test_judge_stage import make_run

    return make_run(tmp_path)


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


def test_read_only_run_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    import errno

    import mechprobe.io as mio
    from mechprobe.cli import main

    run = _judge_run_dir(tmp_path)
    real_open = os.open

    def ro_open(path, flags, *a):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(mio.os, "open", ro_open)
    assert main(["judge", str(run), "--judge", "offline-lexical", "--no-progress"]) == 2
    assert "read-only" in _one_line(capsys)
    with pytest.raises(UserError, match="read-only"):
        with mio.writer_lock(run / "labels.jsonl"):
            pass


@pytest.mark.parametrize("cmd", [["probes", "{run}"], ["cache", "{run}"], ["probe", "--out", "{run}", "--dataset",
                                                                              "builtin"]])
def test_truncated_manifest_is_a_one_line_error(tmp_path, capsys, cmd, monkeypatch):
    import mechprobe.lm.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("model loaded"))
    from mechprobe.cli import main

    run = _judge_run_dir(tmp_path)  # turns on disk, so each command gets as far as the manifest
    (run / "manifest.json").write_text('{"config": {"model": "smollm2-135m-instruct", "dataset": "bu')
    assert main([c.format(run=run) for c in cmd]) == 2
    line = _one_line(capsys)
    assert "manifest.json is not valid JSON" in line and "delete it" in line


def test_plain_offline_judge_warns_once_about_the_lexical_fallback(monkeypatch, capsys):
    import mechprobe.judges.offline as jo

    monkeypatch.setattr(jo, "embeddings_available", lambda: False)
    monkeypatch.setattr(jo, "_LEXICAL_WARNED", False)
    monkeypatch.delenv("MECHPROBE_NO_EMBED", raising=False)
    j1, _ = jo.OfflineJudge(), jo.OfflineJudge()
    assert j1.name.endswith("+lexical") and j1.public_config()["variant"] == "lexical"
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "mechprobe[embed]" in err and "offline-lexical" in err
    monkeypatch.setattr(jo, "_LEXICAL_WARNED", False)
    jo.OfflineJudge(embed=False)  # asked for explicitly: quiet
    assert capsys.readouterr().err == ""


def test_all_judge_error_run_exits_2(tmp_path, monkeypatch, capsys):
    import mechprobe.judges.run as judge
    from mechprobe.records import LabelRecord
    from mechprobe.taxonomy import JUDGE_ERROR

    class Broken:
        name = "broken"

        def label_many(self, inputs):
            for i in inputs:
                yield LabelRecord(record_id=i.record_id, label=JUDGE_ERROR, genuine=None, rationale="",
                                  judge=self.name, error="http_503")

    monkeypatch.setattr(judge, "make_judge", lambda *a, **kw: Broken())
    run = _judge_run_dir(tmp_path)
    from mechprobe.cli.judge import main as main_judge

    assert main_judge([str(run), "--judge", "offline", "--no-progress"]) == 2
    assert "every judged turn" in capsys.readouterr().err


def test_serve_on_a_busy_port_is_one_line_before_loading(monkeypatch, capsys):
    import socket

    import mechprobe.lm.models as models
    from mechprobe.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("model loaded"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        t = time.time()
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2 and time.time() - t < 5
    assert "another --port" in _one_line(capsys)


def test_numeric_list_flags_take_negative_numbers():
    import mechprobe.cli.steer as steer
    from mechprobe.cli import build_parser
    from mechprobe.cli.study import build_parser as study_parser
    assert steer.build_parser().parse_args(["--alpha", "0", "-1e308"]).alpha == [0.0, -1e308]
    assert steer.build_parser().parse_args(["--alpha", "-.5", "-2E-3"]).alpha == [-0.5, -0.002]
    assert build_parser().parse_args(["probes", "r", "--temperatures", "0", "-1e-3"]).temperatures == [0.0, -0.001]
    assert study_parser().parse_args(["--temperatures", "-1e2"]).temperatures == ["-1e2"]


@pytest.mark.parametrize("labels", ["../x.jsonl", "sub/../../x.jsonl", "/tmp/elsewhere.jsonl"])
def test_judge_labels_outside_the_run_is_refused(tmp_path, capsys, labels):
    from mechprobe.cli import main

    run = _judge_run_dir(tmp_path)
    assert main(["judge", str(run), "--judge", "offline-lexical", "--labels", labels, "--no-progress"]) == 2
    assert "outside the run directory" in _one_line(capsys)
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.lock").exists()
