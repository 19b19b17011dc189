"""Issue 11, "silent wrong data": each test is named after its item and failed on the code before the fix.

Fast: a tiny random-init Llama with a word-level chat tokenizer runs the real probe stage (real files,
real generation, real manifests) in well under a second per call. Items 6 and the steering advice need
the real model and live in tests/e2e/test_experiments.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from mechprobe.activations.cache import ActivationCache
from mechprobe.cli.judge import main as main_judge
from mechprobe.errors import UserError
from mechprobe.io import JsonlStore, ManifestMismatch, check_or_write_manifest, read_jsonl, write_json
from mechprobe.judges.run import judge_run
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.models import LoadedModel
from mechprobe.lm.server import ChatServer, Fault, ScriptedResponder
from mechprobe.records import Item
from mechprobe.turns.pipeline import ProbeConfig, run_probe
from tests.judges.test_judge_stage import make_run

CTX = 64  # the tiny model's context: small, so item 7 can overflow it with a short prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    """Tiny Llama (context CTX) + a word-level tokenizer with a role-aware chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok")
    vocab = {"<unk>": 0, "<s>": 1, "<end>": 2, "<start>": 3, "user": 4, "assistant": 5, "system": 6}
    vocab.update({f"w{i}": i for i in range(7, 128)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="<end>", unk_token="<unk>",
                                  pad_token="<unk>", additional_special_tokens=["<start>", "<end>"])
    tok.chat_template = ("{% for m in messages %}<start> {{ m['role'] }} {{ m['content'] }} <end> {% endfor %}"
                         "{% if add_generation_prompt %}<start> assistant {% endif %}")
    tok.save_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d))
    return LoadedModel(tiny_model("llama", max_position_embeddings=CTX), tok, "tiny-llama", "tiny-weights",
                       torch.device("cpu"), torch.float32)


def _cfg(**kw) -> ProbeConfig:
    base = dict(model="tiny-llama", dataset="builtin", limit=2, temperatures=[0.0, 1.0], samples=1,
                max_assistant_tokens=4, max_user_tokens=4, batch_size=4)
    return ProbeConfig(**{**base, **kw})


def _builtin_file(path, prompts: list[str]):
    """A prompt file in the builtin row format; ids are positions, as in every dataset's files."""
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"item_id": f"row-{i}", "dataset": "builtin", "prompt": p}) + "\n")
    return path


def _snapshot(run):
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.suffix in (".jsonl", ".json")}


# ------------------------------------------------------------------------------------------- item 1


def test_item1_other_data_file_with_same_dataset_name_is_refused(tiny, tmp_path):
    a = _builtin_file(tmp_path / "a.jsonl", [f"w{10 + i} w20 w21" for i in range(4)])
    b = _builtin_file(tmp_path / "b.jsonl", [f"w{40 + i} w50 w51" for i in range(4)])
    run = tmp_path / "run"
    run_probe(_cfg(data_path=str(a)), run, lm=tiny, progress=False)
    before = _snapshot(run)
    with pytest.raises(ManifestMismatch, match=r"data_source: run has 'sha256:[0-9a-f]+', command has 'sha256:"):
        run_probe(_cfg(data_path=str(b), limit=4), run, lm=tiny, progress=False)
    assert _snapshot(run) == before  # nothing of b.jsonl got in
    # The identity is the content, not the path: the same file elsewhere extends the run.
    copy = tmp_path / "elsewhere" / "a.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(a.read_bytes())
    run_probe(_cfg(data_path=str(copy), limit=4), run, lm=tiny, progress=False)
    assert [r["item_id"] for r in read_jsonl(run / "assistant.jsonl")] == [f"row-{i}" for i in range(4)]


def test_item1_items_with_known_ids_but_other_prompts_are_refused(tiny, tmp_path):
    run = tmp_path / "run"
    items = [Item(item_id=f"x-{i}", dataset="mine", prompt=f"w{10 + i} w11") for i in range(2)]
    run_probe(_cfg(dataset="mine", limit=None), run, lm=tiny, progress=False, items=items)
    other = [Item(item_id="x-0", dataset="mine", prompt="w90 w91")]
    with pytest.raises(UserError, match="x-0"):
        run_probe(_cfg(dataset="mine", limit=None), run, lm=tiny, progress=False, items=other)


# ------------------------------------------------------------------------------------------- item 2


@pytest.mark.parametrize("bad, needle", [
    (dict(temperatures=[0.0, float("nan")]), "temperature nan"),
    (dict(temperatures=[0.0, float("inf")]), "temperature inf"),
    (dict(temperatures=[-0.5]), "temperature -0.5"),
    (dict(temperatures=[1.0, 1.0]), "more than once"),
    (dict(samples=-1), "samples must be"),
    (dict(samples=0), "samples is 0"),
    (dict(limit=-3), "limit must be"),
    (dict(max_user_tokens=0), "max_user_tokens"),
    (dict(max_assistant_tokens=-1), "max_assistant_tokens"),
    (dict(batch_size=0), "batch_size"),
])
def test_item2_invalid_temperatures_and_counts_are_rejected(tiny, tmp_path, bad, needle):
    run = tmp_path / "run"
    with pytest.raises(UserError, match=needle):
        run_probe(_cfg(**bad), run, lm=tiny, progress=False)
    assert not run.exists()  # rejected before anything was written (item 5)


def test_item2_cli_rejects_nan_temperature_before_loading_anything(tmp_path, capsys):
    from mechprobe.cli import main

    out = tmp_path / "run"
    t = time.time()
    code = main(["probe", "--dataset", "builtin", "--limit", "1", "--temperatures", "0", "nan",
                 "--max-assistant-tokens", "2", "--max-user-tokens", "2", "--out", str(out)])
    assert code == 2 and "temperature nan" in capsys.readouterr().err
    assert not out.exists() and time.time() - t < 5  # no model was loaded


def test_item2_writers_never_write_bare_nan(tmp_path):
    s = JsonlStore(tmp_path / "rows.jsonl", key="id")
    with pytest.raises(ValueError, match="non-finite"):
        s.append({"id": "a", "temperature": float("nan")})
    assert not (tmp_path / "rows.jsonl").exists() or (tmp_path / "rows.jsonl").read_text() == ""
    write_json(tmp_path / "m.json", {"rate": float("nan"), "ci": [0.1, float("inf")]})
    text = (tmp_path / "m.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"rate": None, "ci": [0.1, None]}


# ------------------------------------------------------------------------------------------- item 3


def test_item3_second_judge_writer_is_refused(tmp_path):
    run = make_run(tmp_path)
    # Another process holds the labels file's writer lock, as a running `mechprobe judge` does.
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(run / 'labels.jsonl.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'pid {os.getpid()}, mechprobe judge'.encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"labels.jsonl is being written by another process \(pid {holder.pid}"):
            judge_run(run, "offline-lexical", progress=False)
        assert not (run / "labels.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: the kernel released its lock, no stale lock file blocks the next judge.
    assert judge_run(run, "offline-lexical", progress=False).n_new == 8


def test_item3_duplicate_record_ids_are_refused_by_readers(tmp_path):
    run = make_run(tmp_path)
    judge_run(run, "offline-lexical", progress=False)
    labels = run / "labels.jsonl"
    rows = read_jsonl(labels)
    dup = {**rows[0], "label": "genuine_followup" if rows[0]["label"] != "genuine_followup" else "new_query",
           "genuine": not rows[0]["genuine"]}
    with open(labels, "a") as f:  # what two judges appending at once leave behind
        f.write(json.dumps(dup) + "\n")
    cache = ActivationCache(path=run / "activations", meta={"record_ids": [r["record_id"] for r in rows]},
                            _tensors={})
    with pytest.raises(UserError, match=rf"labels.jsonl:9: duplicate record_id='{rows[0]['record_id']}'"):
        cache.labels()
    with pytest.raises(UserError, match="duplicate record_id"):
        judge_run(run, "offline-lexical", progress=False)
    with pytest.raises(UserError, match="duplicate record_id"):
        JsonlStore(labels, key="record_id")
    with pytest.raises(UserError, match="duplicate record_id"):
        read_jsonl(labels, key="record_id")


# ------------------------------------------------------------------------------------------- item 4


def test_item4_malformed_middle_line_is_an_error_not_a_truncation(tmp_path):
    p = tmp_path / "user_turns.jsonl"
    good = [json.dumps({"record_id": f"r{i}", "v": i}) for i in range(4)]
    p.write_text("\n".join([good[0], '{"record_id": "r9", "v"', *good[1:]]) + "\n")
    before = p.read_bytes()
    with pytest.raises(UserError, match=r"user_turns.jsonl:2: malformed line"):
        JsonlStore(p, key="record_id")
    assert p.read_bytes() == before  # the three valid rows after the bad line are still there
    with pytest.raises(UserError, match=r"user_turns.jsonl:2"):
        read_jsonl(p)
    # A torn *last* line is still what a killed writer leaves, and is still repaired.
    p.write_text("\n".join(good) + '\n{"record_id": "r4", "v"')
    assert JsonlStore(p, key="record_id").keys() == {"r0", "r1", "r2", "r3"}
    assert p.read_text().endswith("\n")


def test_item4_garbage_in_labels_names_file_and_line(tmp_path):
    run = make_run(tmp_path)
    judge_run(run, "offline-lexical", progress=False)
    labels = run / "labels.jsonl"
    ids = [r["record_id"] for r in read_jsonl(labels)]
    lines = labels.read_text().splitlines(keepends=True)
    labels.write_text("".join(lines[:3]) + "this is not json\n" + "".join(lines[3:]))
    cache = ActivationCache(path=run / "activations", meta={"record_ids": ids}, _tensors={})
    with pytest.raises(UserError, match=r"labels.jsonl:4: malformed line"):
        cache.labels()
    with pytest.raises(UserError, match=r"labels.jsonl:4"):
        cache.label_records()
    # Valid JSON that is not a label record: file and row named too.
    labels.write_text("".join(lines[:3]) + json.dumps({"record_id": ids[3], "lable": "x"}) + "\n")
    with pytest.raises(UserError, match=r"labels.jsonl: row 4 is not a label record"):
        cache.labels()


# ------------------------------------------------------------------------------------------- item 5


def test_item5_rejected_command_writes_nothing_and_the_corrected_one_runs(tiny, tmp_path):
    run = tmp_path / "run"
    with pytest.raises((UserError, ValueError)):  # the type is checked in item 2; here: what is left behind
        run_probe(_cfg(temperatures=[0.0, -1.0]), run, lm=tiny, progress=False)
    assert not run.exists()
    run_probe(_cfg(temperatures=[0.0, 1.0]), run, lm=tiny, progress=False)
    assert len(read_jsonl(run / "user_turns.jsonl")) == 2 * 2
    # An existing run: a rejected extension leaves its files byte for byte as they were.
    before = _snapshot(run)
    with pytest.raises(UserError):
        run_probe(_cfg(temperatures=[0.0, 1.0], samples=-1, limit=4), run, lm=tiny, progress=False)
    assert _snapshot(run) == before


def test_item5_cli_validation_error_leaves_no_run_directory(tmp_path, capsys):
    from mechprobe.cli import main

    out = tmp_path / "run"
    assert main(["probe", "--dataset", "builtin", "--limit", "1", "--temperatures", "-1", "--out", str(out)]) == 2
    assert "temperature -1" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------------------- item 7


def test_item7_prompt_longer_than_context_is_skipped_per_row_and_recorded(tiny, tmp_path):
    run = tmp_path / "run"
    items = [Item(item_id="short", dataset="mine", prompt="w10 w11 w12"),
             Item(item_id="huge", dataset="mine", prompt=" ".join(f"w{7 + i % 100}" for i in range(300))),
             # fits the assistant stage (prompt + 4 new tokens), not the user stage (+ response + header + 20)
             Item(item_id="edge", dataset="mine", prompt=" ".join(["w30"] * 44))]
    cfg = _cfg(dataset="mine", limit=None, max_user_tokens=20)
    run_probe(cfg, run, lm=tiny, progress=False, items=items)
    skipped = {r["item_id"]: r for r in read_jsonl(run / "skipped_rows.jsonl")}
    assert set(skipped) == {"huge", "edge"}
    assert skipped["huge"]["stage"] == "assistant" and skipped["huge"]["prompt_tokens"] > CTX
    assert skipped["edge"]["stage"] == "user" and skipped["edge"]["context"] == CTX
    assert all(r["reason"] == "too_long_for_context" for r in skipped.values())
    assert {r["item_id"] for r in read_jsonl(run / "assistant.jsonl")} == {"short", "edge"}
    assert {r["item_id"] for r in read_jsonl(run / "user_turns.jsonl")} == {"short"}
    man = json.loads((run / "manifest.json").read_text())
    assert man["skipped_rows"] == {"file": "skipped_rows.jsonl", "n": 2}
    assert man["last_run"]["new_skipped_rows"] == 2
    # Resuming neither retries nor re-records them, and the run counts as complete.
    run_probe(cfg, run, lm=tiny, progress=False, items=items)
    assert len(read_jsonl(run / "skipped_rows.jsonl")) == 2
    assert json.loads((run / "manifest.json").read_text())["last_run"]["new_user_rows"] == 0
    from mechprobe.stages import probe_complete

    assert probe_complete(run, cfg)


# ----------------------------------------------------------------------------- clear errors


def test_mismatch_names_only_the_differing_nested_key(tmp_path):
    ident = {"model": "m", "config": {"max_user_tokens": 64, "temperatures": [0.0, 1.0], "system": None}}
    check_or_write_manifest(tmp_path, ident, {})
    changed = {"model": "m", "config": {**ident["config"], "max_user_tokens": 20}}
    with pytest.raises(ManifestMismatch) as e:
        check_or_write_manifest(tmp_path, changed, {})
    msg = str(e.value)
    assert "config.max_user_tokens: run has 64, command has 20" in msg
    assert "temperatures" not in msg  # not two whole config dicts
    assert isinstance(e.value, UserError)


def _probes_args(*argv):
    import argparse

    from mechprobe.cli.linear_probe import add_args, config_from_args

    p = argparse.ArgumentParser()
    add_args(p)
    return config_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("flags, needle", [(["--n-boot", "0"], "--n-boot"), (["--folds", "1"], "--folds"),
                                           (["--transfer-datasets", "nope"], "--transfer-datasets")])
def test_invalid_probe_flags_rejected_before_any_stage(tmp_path, flags, needle):
    from mechprobe.linear.experiment import run_linear_probe

    run = tmp_path / "run"
    # An unknown dataset too: if the flags were not checked first, building the run would fail on that.
    with pytest.raises(UserError, match=needle):
        run_linear_probe(_probes_args("--run", str(run), "--dataset", "no-such-dataset", *flags))
    assert not run.exists()


def _steer_module():
    """The steering experiment's names (cli and experiment modules) in one namespace, as the old script had them."""
    import types

    import mechprobe.cli.steer as cli_steer
    import mechprobe.steering.experiment as exp
    return types.SimpleNamespace(**{**vars(exp), **vars(cli_steer)})


@pytest.mark.parametrize("flags, needle", [(["--alpha", "nan"], "--alpha nan"),
                                           (["--max-user-tokens", "0"], "--max-user-tokens"),
                                           (["--kinds", "diff_means,bogus"], "bogus"),
                                           (["--layer", "-2"], "layer -2")])
def test_invalid_steer_flags_rejected_before_any_stage(tmp_path, flags, needle):
    run = tmp_path / "run"
    with pytest.raises(UserError, match=needle):
        m = _steer_module()
        m.run(m.build_parser().parse_args(["--run", str(run), "--dataset", "no-such-dataset", *flags]))
    assert not run.exists()


@pytest.mark.parametrize("kw, needle", [(dict(limit=-1), "limit"), (dict(concurrency=0), "concurrency"),
                                        (dict(max_retries=-1), "max_retries"), (dict(timeout=0.0), "timeout")])
def test_item2_negative_judge_counts_are_rejected(tmp_path, kw, needle):
    run = make_run(tmp_path)
    with pytest.raises(UserError, match=needle):
        judge_run(run, "openai:m", progress=False, base_url="http://127.0.0.1:9", api_key="k", cache_dir=False,
                  **{"max_retries": 0, **kw})  # no retries: on code without the check this fails fast
    assert not (run / "labels.jsonl").exists()


def test_all_judge_errors_exit_nonzero_with_a_message(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path)
    monkeypatch.setenv("MECHPROBE_TEST_KEY", "sk-test")
    ok = '{"rationale": "fine", "label": "genuine_followup", "genuine": true}'
    with ChatServer(ScriptedResponder(ok, always=Fault.server_error(500))) as srv:
        code = main_judge([str(run), "--judge", "openai:m", "--base-url", srv.base_url, "--api-key-env",
                           "MECHPROBE_TEST_KEY", "--no-cache", "--max-retries", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and "every judged turn (8) is a judge error" in err and "http_500" in err


def test_item2_decoding_plan_refuses_nan():
    from mechprobe.turns.pipeline import decoding_plan

    with pytest.raises(UserError, match="finite"):
        decoding_plan([0.0, float("nan")], 2)
    assert decoding_plan([0.0, 0.5], 2) == [("greedy", 0.0, 0), ("sample", 0.5, 0), ("sample", 0.5, 1)]
