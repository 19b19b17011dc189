"""The loopback OpenAI-compatible server: routes, faults, and the local-model responder."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from mechprobe.lm.server import ChatServer, Fault, HFResponder, ScriptedResponder
from tests.conftest import requires_smollm2


def client(srv: ChatServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0, **kw)


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_completion_and_models_through_the_openai_client():
    seen = []
    with ChatServer(ScriptedResponder(lambda b: seen.append(b) or "hello " + b["messages"][-1]["content"]),
                    model_name="tiny") as srv:
        assert srv.base_url.startswith("http://127.0.0.1:") and srv.port > 0
        c = client(srv)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "there"}])
        assert r.choices[0].message.content == "hello there" and r.choices[0].message.role == "assistant"
        assert [m.id for m in c.models.list()] == ["tiny"]
        assert seen[0]["messages"] == [{"role": "user", "content": "there"}]
        assert srv.n_chat_requests == 1 and srv.requests[0].had_authorization


def test_faults_reach_the_client_as_the_right_errors():
    faults = [Fault.rate_limit(0.5), Fault.server_error(502), Fault.malformed(), Fault.slow(2.0), Fault.bad_request()]
    with ChatServer(ScriptedResponder("ok", faults=faults)) as srv:
        c = client(srv, timeout=0.3)
        kw = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        with pytest.raises(openai.RateLimitError) as ei:
            c.chat.completions.create(**kw)
        assert ei.value.response.headers["retry-after"] == "0.5"
        with pytest.raises(openai.InternalServerError):
            c.chat.completions.create(**kw)
        with pytest.raises(ValueError):  # json.JSONDecodeError from the cut-off body
            c.chat.completions.create(**kw)
        with pytest.raises(openai.APITimeoutError):
            c.chat.completions.create(**kw)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(**kw)
        assert c.chat.completions.create(**kw).choices[0].message.content == "ok"


def test_bad_requests_and_unknown_routes():
    def boom(body):
        raise RuntimeError("responder bug")

    with ChatServer(ScriptedResponder(boom)) as srv:
        base = srv.base_url
        assert post(base + "/chat/completions", b"not json")[0] == 400
        assert post(base + "/nope", b"{}")[0] == 404
        status, body = post(base + "/chat/completions", b'{"messages": []}')
        assert status == 500 and "responder bug" in body["error"]["message"]


def test_only_loopback():
    with pytest.raises(ValueError, match="loopback"):
        ChatServer(ScriptedResponder("x"), host="0.0.0.0")


def test_stop_returns_promptly_with_a_request_still_sleeping():
    import threading
    import time

    srv = ChatServer(ScriptedResponder("x", always=Fault.slow(30))).start()
    outcome = []

    def call():
        try:
            outcome.append(post(srv.base_url + "/chat/completions", b'{"messages": []}'))
        except Exception as e:  # noqa: BLE001 - the dropped connection is the expected outcome
            outcome.append(type(e).__name__)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    time.sleep(0.2)
    srv.stop()  # must not wait 30 s for the sleeping handler
    t.join(timeout=10)
    assert outcome == ["RemoteDisconnected"]


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # id 2 is <|im_end|>: a Llama config's default eos_token_id (2) then means end of turn, as it should.
    words = ["<pad>", "<unk>", "<|im_end|>", "<|im_start|>", "user", "assistant", "system"]
    words += "hello what is two plus three the answer five thanks why ok a b c d e f g h".split()
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def test_hf_responder_equals_hf_greedy_generate():
    from mechprobe.lm.forward import tiny_model

    tok = tiny_chat_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    msgs = [{"role": "user", "content": "what is two plus three"}]
    with ChatServer(HFResponder(model, tok, max_new_tokens=8)) as srv:
        r = client(srv).chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([list(ids)])
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eot, pad_token_id=0)[0, ids.shape[1]:]
    expected = tok.decode([t for t in out.tolist() if t != eot], skip_special_tokens=True).strip()
    assert r.choices[0].message.content == expected


@pytest.mark.slow
@requires_smollm2
def test_real_model_answers_over_http(smol):
    with ChatServer(HFResponder(smol.model, smol.tokenizer, max_new_tokens=24), model_name=smol.name) as srv:
        r = client(srv, timeout=120).chat.completions.create(
            model=smol.name, messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


EXIT_MID_GENERATION = r"""
import json, sys, threading, time, urllib.request
sys.path.insert(0, sys.argv[1])
from tests.lm.test_server import tiny_chat_tokenizer
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.server import ChatServer, HFResponder

tok = tiny_chat_tokenizer()
model = tiny_model("llama", vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4)
model.generation_config.eos_token_id = None  # never stop early: generation is in flight at exit
srv = ChatServer(HFResponder(model, tok, max_new_tokens=300)).start()

def call():
    body = json.dumps({"messages": [{"role": "user", "content": "what is two plus three"}]}).encode()
    req = urllib.request.Request(srv.base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=300).read()
    except Exception:
        pass

threading.Thread(target=call, daemon=True).start()
while srv.n_chat_requests == 0:
    time.sleep(0.01)
time.sleep(0.3)
print("main thread exits with a generation in flight", flush=True)
"""


def test_interpreter_exit_with_generation_in_flight_does_not_abort(tmp_path):
    """Exit 134 ("terminate called without an active exception") seen at the end of this file's run.

    Cause: a daemon handler thread inside torch when the interpreter finalizes is killed by a forced
    unwind through C++ frames. The model now runs on an executor thread that is joined at exit.
    """
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_mid_generation.py"
    script.write_text(EXIT_MID_GENERATION)
    repo = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, str(script), repo], capture_output=True, text=True, timeout=600)
    assert "exits with a generation in flight" in r.stdout, r.stderr[-2000:]
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
