"""The LLM judge over real HTTP against the package's own loopback server, with injected faults."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mechprobe.judges.base import JudgeInput
from mechprobe.judges.llm import JSON_SCHEMA, JudgeFatal, LLMJudge, ParseError, cache_key, parse_verdict
from mechprobe.lm.server import ChatServer, Fault, Reply, ScriptedResponder, chat_completion, error_body
from mechprobe.taxonomy import JUDGE_ERROR, LABELS

KEY = "sk-test-SECRET-0123456789abcdef"


def turn_of(body: dict) -> str:
    """The raw generated user turn inside a judge request."""
    user = body["messages"][-1]["content"]
    m = re.search(r"<generated_user_turn[^>]*>\n(.*)\n</generated_user_turn>", user, re.S)
    assert m, "judge request lacks the generated turn block"
    return m.group(1)


def answer(body: dict) -> str:
    """A fake judge model: the label is whichever taxonomy name the turn mentions (default genuine)."""
    turn = turn_of(body)
    label = next((lab for lab in LABELS if lab in turn), "genuine_followup")
    return json.dumps({"rationale": f"saw {turn[:20]}", "label": label, "genuine": label == "genuine_followup"})


def inp(i: int = 0, text: str = "why 72?") -> JudgeInput:
    return JudgeInput(record_id=f"r{i}", prompt="What is 48+24?", response="48 + 24 = 72.", raw_text=f"{text} #{i}")


class Sleeps(list):
    def __call__(self, s: float) -> None:
        self.append(s)


def judge(srv: ChatServer, tmp_path=None, **kw) -> LLMJudge:
    kw.setdefault("cache_dir", (tmp_path / "cache") if tmp_path is not None else False)
    kw.setdefault("timeout", 2.0)
    kw.setdefault("backoff", 0.001)
    kw.setdefault("sleep", Sleeps())
    return LLMJudge("judge-model", base_url=srv.base_url, api_key=KEY, **kw)


def test_happy_path_uses_structured_output_and_sends_conversation():
    with ChatServer(ScriptedResponder(answer)) as srv:
        rec = judge(srv).label(inp(0, "new_query please"))
        assert rec.label == "new_query" and rec.genuine is False and rec.error is None
        assert rec.judge == "openai:judge-model@prompt-v2-codebook"
        body = srv.requests[-1].body
        assert body["response_format"] == JSON_SCHEMA and body["model"] == "judge-model"
        assert "What is 48+24?" in body["messages"][-1]["content"] and "48 + 24 = 72." in body["messages"][-1]["content"]
        assert "genuine_followup" in body["messages"][0]["content"]  # taxonomy definitions in the prompt
        assert srv.requests[-1].had_authorization


@pytest.mark.parametrize("fault", [Fault.rate_limit(0.05), Fault.server_error(500), Fault.server_error(503),
                                   Fault.malformed(), Fault.slow(1.5)],
                         ids=["429", "500", "503", "malformed", "timeout"])
def test_each_transient_fault_is_retried_once(fault):
    with ChatServer(ScriptedResponder(answer, faults=[fault])) as srv:
        j = judge(srv, timeout=0.5)
        rec = j.label(inp())
        assert rec.label == "genuine_followup", rec.error
        assert srv.n_chat_requests == 2
        assert j.stats["retries"] == 1 and len(j._sleep) == 1


def test_retry_after_is_respected_and_backoff_grows():
    faults = [Fault.rate_limit(0.25), Fault.server_error(), Fault.server_error(), Fault.server_error()]
    with ChatServer(ScriptedResponder(answer, faults=faults)) as srv:
        j = judge(srv, backoff=1.0, max_backoff=100)
        assert j.label(inp()).label == "genuine_followup"
        sleeps = j._sleep
        assert srv.n_chat_requests == 5
        assert sleeps[0] == pytest.approx(0.25)  # the server's Retry-After, not our backoff
        # exponential with jitter in [0.5, 1): attempt k sleeps within [2^k / 2, 2^k)
        for k, s in enumerate(sleeps[1:], start=1):
            assert 2 ** k * 0.5 <= s < 2 ** k


def test_persistent_failure_becomes_judge_error_after_max_retries():
    with ChatServer(ScriptedResponder(answer, always=Fault.server_error())) as srv:
        j = judge(srv, max_retries=3)
        rec = j.label(inp())
        assert rec.label == JUDGE_ERROR and rec.genuine is None
        assert rec.error.startswith("http_500") and rec.error.endswith("(gave up after 4 attempts)")
        assert srv.n_chat_requests == 4


def test_persistent_timeouts_become_judge_error():
    with ChatServer(ScriptedResponder(answer, always=Fault.slow(3.0))) as srv:
        rec = judge(srv, timeout=0.3, max_retries=1).label(inp())
        assert rec.label == JUDGE_ERROR and "timeout" in rec.error
        assert srv.n_chat_requests == 2


def test_wrong_schema_is_an_error_without_retry():
    with ChatServer(ScriptedResponder(answer, always=Fault.wrong_schema())) as srv:
        rec = judge(srv).label(inp())
        assert rec.label == JUDGE_ERROR and rec.error.startswith("unparseable_verdict")
        assert srv.n_chat_requests == 1


def test_label_outside_taxonomy_is_an_error():
    bad = json.dumps({"rationale": "x", "label": "great_followup", "genuine": True})
    with ChatServer(ScriptedResponder(bad)) as srv:
        rec = judge(srv).label(inp())
        assert rec.label == JUDGE_ERROR and "not in the taxonomy" in rec.error


def test_fallback_to_plain_json_when_structured_output_is_rejected():
    prose = lambda body: "Sure. Here is my verdict:\n```json\n" + answer(body) + "\n```"  # noqa: E731
    with ChatServer(ScriptedResponder(prose, reject_response_format=True)) as srv:
        j = judge(srv)
        recs = [j.label(inp(i)) for i in range(3)]
        assert all(r.label == "genuine_followup" for r in recs)
        sent = [("response_format" in r.body) for r in srv.requests]
        assert sent == [True, False, False, False]  # one rejected try, then plain for the whole run
        assert "JSON object only" in srv.requests[-1].body["messages"][-1]["content"]
        assert j.stats["fallbacks"] == 1 and j.stats["retries"] == 0


def test_other_4xx_is_an_error_without_retry():
    with ChatServer(ScriptedResponder(answer, always=Reply(413, error_body("too large")))) as srv:
        rec = judge(srv).label(inp())
        assert rec.label == JUDGE_ERROR and rec.error.startswith("http_413")
        assert srv.n_chat_requests == 1


def test_bad_key_stops_the_run_and_never_echoes_it():
    # A careless server that echoes the key in its error message.
    echo = Reply(401, error_body(f"invalid api key {KEY}", "invalid_request_error"))
    with ChatServer(ScriptedResponder(answer, always=echo)) as srv:
        with pytest.raises(JudgeFatal) as ei:
            judge(srv).label(inp())
        assert KEY not in str(ei.value)
        assert srv.n_chat_requests == 1


def test_server_error_messages_are_scrubbed_of_the_key():
    echo = Reply(500, error_body(f"upstream rejected {KEY}"))
    with ChatServer(ScriptedResponder(answer, always=echo)) as srv:
        rec = judge(srv, max_retries=0).label(inp())
        assert rec.label == JUDGE_ERROR and KEY not in rec.error and "<redacted>" in rec.error


def test_cache_hit_costs_no_request_and_errors_are_not_cached(tmp_path):
    with ChatServer(ScriptedResponder(answer)) as srv:
        j = judge(srv, tmp_path)
        first = [j.label(inp(i)) for i in range(3)]
        assert srv.n_chat_requests == 3
        j2 = judge(srv, tmp_path)
        second = [j2.label(inp(i)) for i in range(3)]
        assert srv.n_chat_requests == 3 and j2.stats["cache_hits"] == 3
        assert [r.to_dict() for r in first] == [r.to_dict() for r in second]
    files = list((tmp_path / "cache").rglob("*.json"))
    assert len(files) == 3
    assert all(KEY not in f.read_text() for f in files)
    assert {f.stem for f in files} == {cache_key("judge-model", inp(i)) for i in range(3)}
    with ChatServer(ScriptedResponder(answer, always=Fault.server_error())) as srv:
        j3 = judge(srv, tmp_path, max_retries=0)
        assert j3.label(inp(9)).label == JUDGE_ERROR
        assert j3.label(inp(9)).label == JUDGE_ERROR
        assert srv.n_chat_requests == 2  # an error is never served from the cache
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 3


def test_cache_key_depends_on_model_and_turn_not_on_key():
    a = cache_key("m1", inp(0))
    assert a != cache_key("m2", inp(0)) and a != cache_key("m1", inp(1))
    assert a == cache_key("m1", inp(0))


def test_concurrency_is_bounded_and_all_rows_come_back():
    state = {"now": 0, "max": 0}
    lock = threading.Lock()

    def slow_answer(body):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return answer(body)

    with ChatServer(ScriptedResponder(slow_answer)) as srv:
        j = judge(srv, concurrency=3)
        recs = list(j.label_many([inp(i) for i in range(12)]))
    assert sorted(r.record_id for r in recs) == sorted(f"r{i}" for i in range(12))
    assert 2 <= state["max"] <= 3


def test_missing_key_without_base_url_is_a_clear_error(monkeypatch):
    for k in ("OPENAI_API_KEY", "MECHPROBE_JUDGE_API_KEY", "OPENAI_BASE_URL", "MECHPROBE_JUDGE_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(JudgeFatal, match="OPENAI_API_KEY"):
        LLMJudge("m")


def test_public_config_has_no_key_or_credentials():
    j = LLMJudge("m", base_url="http://user:pw@127.0.0.1:9/v1", api_key=KEY, cache_dir=False)
    cfg = json.dumps(j.public_config())
    assert KEY not in cfg and "pw" not in cfg and "127.0.0.1:9/v1" in cfg


@pytest.mark.parametrize("content,label", [
    ('{"rationale": "r", "label": "new_query", "genuine": false}', "new_query"),
    ('```json\n{"label": "Meta_Planning", "rationale": "r"}\n```', "meta_planning"),
    ('Verdict: {"rationale": "a {brace} inside", "label": "generic followup"} done', "generic_followup"),
    ('{"label": "genuine_followup", "genuine": false, "rationale": "x"}', "genuine_followup"),
])
def test_parse_verdict_is_defensive(content, label):
    assert parse_verdict(content)[0] == label


@pytest.mark.parametrize("content", ["", "no json here", '{"verdict": 1}', '{"label": 3}', '[1, 2]'])
def test_parse_verdict_rejects_non_verdicts(content):
    with pytest.raises(ParseError):
        parse_verdict(content)


class _EchoAuthHandler(BaseHTTPRequestHandler):
    """A careless endpoint: its verdict's rationale quotes the request's Authorization header verbatim."""

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature; keep test output quiet
        pass

    def do_POST(self):  # noqa: N802 - stdlib name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        auth = self.headers.get("Authorization", "")
        verdict = {"rationale": f"request carried Authorization: {auth}; it asks why", "label": "genuine_followup",
                   "genuine": True}
        if self.server.fail_with_echo:  # an auth failure whose message echoes the header
            body = json.dumps(error_body(f"bad credentials {auth}", "invalid_request_error")).encode()
            status = 401
        else:
            body = json.dumps(chat_completion(json.dumps(verdict), "m")).encode()
            status = 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def echo_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _EchoAuthHandler)
    srv.fail_with_echo = False
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_item8_echoed_key_never_reaches_labels_or_cache(echo_server, tmp_path):
    """Issue 11 item 8: a rationale echoing the API key (or URL credentials, sent by httpx as Basic auth)
    is scrubbed before labels.jsonl, the judge cache, the manifest and the summary are written."""
    from mechprobe.judges.base import inputs_from_run
    from mechprobe.judges.run import judge_run
    from tests.judges.test_judge_stage import make_run

    port = echo_server.server_address[1]
    run = make_run(tmp_path)
    cache = tmp_path / "jcache"
    s = judge_run(run, "openai:m", progress=False, base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                  cache_dir=cache, backoff=0.001)
    assert s.n_errors == 0 and s.n_new == 8
    rows = [json.loads(x) for x in (run / "labels.jsonl").read_text().splitlines()]
    assert all("<redacted>" in r["rationale"] for r in rows)  # the echo happened and was scrubbed
    # Second run with credentials in the URL: httpx sends them as ``Basic base64(user:pw)``.
    pw = "pw-URLSECRET-42"
    (tmp_path / "second").mkdir()
    run2 = make_run(tmp_path / "second")
    judge_run(run2, "openai:m", progress=False, base_url=f"http://bob:{pw}@127.0.0.1:{port}/v1", api_key=KEY,
              cache_dir=tmp_path / "jcache2", backoff=0.001)
    b64 = base64.b64encode(f"bob:{pw}".encode()).decode()
    written = [p for p in [*run.rglob("*"), *run2.rglob("*"), *cache.rglob("*"), *(tmp_path / "jcache2").rglob("*")]
               if p.is_file()]
    assert any(p.suffix == ".json" and p.parent.parent in (cache, tmp_path / "jcache2") for p in written)
    for p in written:
        text = p.read_text(encoding="utf-8")
        assert KEY not in text and pw not in text and b64 not in text, p
    # A stale cache entry written by an older version with the key inside is scrubbed on read too.
    entry = next(p for p in cache.rglob("*.json"))
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "rationale": f"old entry saw Bearer {KEY}"}))
    j = LLMJudge("m", base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, cache_dir=cache)
    recs = [j.label(i) for i in inputs_from_run(run)]
    assert j.stats["cache_hits"] == 8 and all(KEY not in r.rationale for r in recs)


def test_item8_url_credentials_are_redacted_in_errors(echo_server):
    """Issue 11 item 8: ``user:secret@host`` in the base URL is never printed in an error message."""
    from mechprobe.redact import redact_url

    echo_server.fail_with_echo = True
    port = echo_server.server_address[1]
    pw = "pw-URLSECRET-42"
    j = LLMJudge("m", base_url=f"http://bob:{pw}@127.0.0.1:{port}/v1", api_key=KEY, cache_dir=False, timeout=2.0)
    with pytest.raises(JudgeFatal) as ei:
        j.label(inp())
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "<redacted>@" in msg  # the host is still shown, to be useful
    assert pw not in msg and base64.b64encode(f"bob:{pw}".encode()).decode() not in msg and KEY not in msg
    assert redact_url(f"https://bob:{pw}@h.example:8443/v1?x=1") == "https://<redacted>@h.example:8443/v1?x=1"
    assert redact_url("http://127.0.0.1:9/v1") == "http://127.0.0.1:9/v1"
