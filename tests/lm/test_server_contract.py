"""What ``mechprobe serve`` tells a client must be true: streaming, prompt caps, finish_reason, usage, n, temperature.

Why: ``"stream": true`` was ignored (the OpenAI client received 0 chunks and no error); a 54 KB prompt ran for
minutes and starved other clients; ``finish_reason`` was always "stop", usage 0/0/0, and ``n`` / ``temperature``
were silently ignored. Real HTTP on 127.0.0.1 through the real ``openai`` client.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from mechprobe.lm.forward import tiny_model
from mechprobe.lm.generation import generate
from mechprobe.lm.server import ChatServer, HFResponder, ScriptedResponder
from tests.conftest import requires_smollm2
from tests.lm.test_server import tiny_chat_tokenizer

MSGS = [{"role": "user", "content": "what is two plus three"}]


def client(srv: ChatServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0, **kw)


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_chat_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    model.generation_config.eos_token_id = None
    return model, tok


def _prompt_ids(tok) -> list[int]:
    return list(tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_stream_true_reaches_the_openai_client_as_chunks(tiny):
    model, tok = tiny
    with ChatServer(HFResponder(model, tok, max_new_tokens=6)) as srv:
        c = client(srv, timeout=60)
        whole = c.chat.completions.create(model="m", messages=MSGS, max_tokens=5)
        chunks = list(c.chat.completions.create(model="m", messages=MSGS, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))
    assert len(chunks) >= 2
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_stream_through_a_scripted_responder_and_a_bad_stream_flag():
    with ChatServer(ScriptedResponder("hello there")) as srv:
        chunks = list(client(srv).chat.completions.create(model="m", messages=MSGS, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "hello there"
        status, body = post(srv.base_url + "/chat/completions", {"messages": MSGS, "stream": "yes"})
        assert status == 400 and "stream" in body["error"]["message"]


def test_finish_reason_length_and_real_usage(tiny):
    model, tok = tiny
    with ChatServer(HFResponder(model, tok, max_new_tokens=8)) as srv:
        r = client(srv, timeout=60).chat.completions.create(model="m", messages=MSGS, max_tokens=3)
    assert r.choices[0].finish_reason == "length"  # no stop token in 3 steps: cut at max_tokens
    assert r.usage.prompt_tokens == len(_prompt_ids(tok))
    assert r.usage.completion_tokens == 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3


def test_finish_reason_stop_when_the_model_ends_its_turn():
    tok = tiny_chat_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    def end_turn(_module, _inputs, logits):  # make <|im_end|> the argmax everywhere: the reply ends at once
        out = torch.zeros_like(logits)
        out[..., eot] = 1.0
        return out

    model.lm_head.register_forward_hook(end_turn)
    with ChatServer(HFResponder(model, tok, max_new_tokens=8)) as srv:
        r = client(srv).chat.completions.create(model="m", messages=MSGS)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


@pytest.mark.parametrize("field, value", [("n", 2), ("n", 0), ("n", "1"), ("temperature", -0.5),
                                          ("temperature", "hot"), ("temperature", 9.0), ("top_p", 0),
                                          ("top_p", 1.5), ("seed", "x")])
def test_unsupported_or_bad_sampling_fields_are_400(tiny, field, value):
    model, tok = tiny
    with ChatServer(HFResponder(model, tok, max_new_tokens=2)) as srv:
        status, body = post(srv.base_url + "/chat/completions", {"messages": MSGS, field: value})
    msg = body["error"]["message"]
    assert status == 400 and f"'{field}'" in msg and "\n" not in msg


def test_temperature_is_honoured_with_the_seed(tiny):
    model, tok = tiny
    ids = _prompt_ids(tok)
    want = generate(model, [ids], stop_ids={}, max_new_tokens=6, temperatures=1.0, seeds=[11], pad_id=0)[0]
    greedy = generate(model, [ids], stop_ids={}, max_new_tokens=6, pad_id=0)[0]
    assert want.token_ids != greedy.token_ids  # the check below can tell sampling from greedy
    with ChatServer(HFResponder(model, tok, max_new_tokens=6)) as srv:
        c = client(srv, timeout=60)
        a = c.chat.completions.create(model="m", messages=MSGS, temperature=1.0, seed=11, n=1)
        b = c.chat.completions.create(model="m", messages=MSGS, temperature=1.0, seed=11)
        g = c.chat.completions.create(model="m", messages=MSGS, temperature=0)
    expect = tok.decode(want.token_ids, skip_special_tokens=True).strip()
    assert a.choices[0].message.content == b.choices[0].message.content == expect
    assert g.choices[0].message.content == tok.decode(greedy.token_ids, skip_special_tokens=True).strip()


def test_over_long_prompt_is_400_at_once_and_others_are_still_served(tiny):
    model, tok = tiny
    long_msgs = [{"role": "user", "content": "hello " * 5000}]
    with ChatServer(HFResponder(model, tok, max_new_tokens=4, max_prompt_tokens=64)) as srv:
        out: list = []
        t = threading.Thread(target=lambda: out.append(post(srv.base_url + "/chat/completions", {"messages": MSGS})))
        t0 = time.monotonic()
        status, body = post(srv.base_url + "/chat/completions", {"messages": long_msgs})
        took = time.monotonic() - t0
        t.start()
        t.join(30)
    msg = body["error"]["message"]
    assert status == 400 and "max_prompt_tokens=64" in msg and "tokens" in msg and took < 10
    assert body["error"]["code"] == "context_length_exceeded"
    assert out and out[0][0] == 200


def test_prompt_cap_is_the_models_context_at_most(tiny):
    model, tok = tiny  # tiny_model's context is 512 positions
    with ChatServer(HFResponder(model, tok, max_new_tokens=4, max_prompt_tokens=100_000)) as srv:
        status, body = post(srv.base_url + "/chat/completions",
                            {"messages": [{"role": "user", "content": "hello " * 600}]})
    assert status == 400 and "512" in body["error"]["message"]


def test_bad_prompt_cap_is_refused():
    from mechprobe.errors import UsageError

    with pytest.raises(UsageError, match="max_prompt_tokens=0"):
        HFResponder(None, None, max_prompt_tokens=0)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_serve_refuses_a_bad_prompt_cap_before_loading(value, capsys, monkeypatch):
    import mechprobe.cli.serve as serve
    from mechprobe.cli.main import main

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(serve, "load_model", no_load)
    assert main(["serve", "--port", "0", "--max-prompt-tokens", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-prompt-tokens" in err and len(err.splitlines()) == 1


@pytest.mark.slow
@requires_smollm2
def test_openai_client_streams_from_mechprobe_serve(tmp_path):
    """The command itself, on 127.0.0.1, with the embedded model: stream=True, a capped prompt, then Ctrl-C."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.Popen([sys.executable, "-m", "mechprobe", "serve", "--port", "0", "--max-new-tokens", "12",
                             "--max-prompt-tokens", "200"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 300
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
        assert url, line
        c = openai.OpenAI(base_url=url.group(1), api_key="k", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(c.chat.completions.create(model="m", messages=msgs, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        whole = c.chat.completions.create(model="m", messages=msgs)
        assert len(chunks) >= 2 and text == whole.choices[0].message.content and text
        assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError, match="200"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 400}])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
