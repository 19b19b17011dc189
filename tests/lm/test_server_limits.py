"""The loopback server under bad or oversized requests: bounded memory, 400/413 instead of hung or dead
threads, and ``mechprobe serve`` refusing bad flags before the model loads. Real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from mechprobe.lm.server import KEPT_BODY_BYTES, ChatServer, HFResponder, ScriptedResponder


def post(url: str, data: bytes, timeout: float = 10) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw_exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 5) -> tuple[int, bytes, float]:
    """Send raw request bytes, read until the server closes; returns (status, whole reply, seconds taken)."""
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        got = b""
        while chunk := s.recv(65536):  # socket.timeout here means the server left the connection hanging
            got += chunk
    return int(got.split(b" ", 2)[1]), got, time.monotonic() - t


def head(content_length: str) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


def test_request_bodies_are_not_kept_without_bound():
    """Every parsed body used to be appended to ``requests`` forever (a serve process grew with its traffic)."""
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (KEPT_BODY_BYTES * 2)}]}).encode()
    with ChatServer(ScriptedResponder("ok")) as srv:
        for _ in range(80):
            assert post(srv.base_url + "/chat/completions", big)[0] == 200
        assert srv.n_chat_requests == 80
        assert 0 < len(srv.requests) <= 64
        assert all(r.body is None and r.body_bytes == len(big) for r in srv.requests)
    with ChatServer(ScriptedResponder("ok"), keep_requests=0) as srv:  # what `mechprobe serve` uses
        post(srv.base_url + "/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
        assert srv.n_chat_requests == 1 and len(srv.requests) == 0


def test_small_bodies_are_still_remembered_for_tests():
    with ChatServer(ScriptedResponder("ok")) as srv:
        post(srv.base_url + "/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
        assert srv.requests[-1].body["messages"][0]["content"] == "hi"


def test_oversized_body_is_refused_unread_with_413():
    with ChatServer(ScriptedResponder("ok"), max_body_bytes=1_000_000) as srv:
        status, reply, took = raw_exchange(srv.port, head(str(20_000_000)))  # announces 20 MB, sends none
        assert status == 413 and b"limit" in reply and took < 4
        assert post(srv.base_url + "/chat/completions", b'{"messages": []}')[0] == 200  # server still serves


@pytest.mark.parametrize("length", ["abc", "-5", "1e3", " "])
def test_bad_content_length_is_400_and_closed(length):
    """``int('abc')`` raised in the handler thread; ``-5`` read until the client closed (a hung thread)."""
    with ChatServer(ScriptedResponder("ok")) as srv:
        status, reply, took = raw_exchange(srv.port, head(length), b"{}")
        assert status == 400 and b"Content-Length" in reply and took < 4


def test_body_shorter_than_its_length_does_not_hold_a_thread():
    with ChatServer(ScriptedResponder("ok"), read_timeout=0.5) as srv:
        status, reply, took = raw_exchange(srv.port, head("1000"), b'{"messages": [')
        assert status == 400 and b"shorter" in reply and took < 4


def _tiny_hf_server(**kw) -> ChatServer:
    from mechprobe.lm.forward import tiny_model
    from tests.lm.test_server import tiny_chat_tokenizer

    tok = tiny_chat_tokenizer()
    return ChatServer(HFResponder(tiny_model("llama", vocab_size=len(tok)), tok, max_new_tokens=4), **kw)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": "ten"},
    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": float("nan")},
    {"messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": [3]},
    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2.5},
    {"messages": ["hello"]},
    {"messages": "hello"},
])
def test_malformed_fields_are_400_with_a_short_message(body):
    """They used to raise inside the model responder: a 500 carrying the exception's text."""
    with _tiny_hf_server() as srv:
        status, reply = post(srv.base_url + "/chat/completions", json.dumps(body).encode())
        msg = reply["error"]["message"]
        assert status == 400 and "Error" not in msg and len(msg) < 100 and "\n" not in msg
        ok = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        assert post(srv.base_url + "/chat/completions", json.dumps(ok).encode())[0] == 200


@pytest.mark.parametrize("argv, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-5"], "--max-new-tokens"),
    (["--device", "nope"], "--device 'nope'"),
])
def test_serve_refuses_bad_flags_before_loading(argv, needle, capsys, monkeypatch):
    import mechprobe.cli.serve as serve
    from mechprobe.cli.main import main

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(serve, "load_model", no_load)
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_hf_responder_refuses_a_zero_cap():
    from mechprobe.errors import UsageError

    with pytest.raises(UsageError, match="max_new_tokens=0"):
        HFResponder(None, None, max_new_tokens=0)
