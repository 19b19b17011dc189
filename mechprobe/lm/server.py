"""A small OpenAI-compatible chat server on loopback, with pluggable responders.

Two uses:

* chat with a local (possibly steered) model through any OpenAI client:
  ``mechprobe serve --model smollm2-135m-instruct --port 8000`` then point the client at
  ``http://127.0.0.1:8000/v1``. The model runs greedy through the tokenizer's chat template; hooks
  registered on the model (steering) apply to every request. A request whose ``response_format``
  json_schema has a ``label`` enum (the ``openai:`` judge's) is answered by constrained choice, the
  same scoring as ``--judge local:``, so the served and in-process judges give the same labels;
* test the LLM judge over real HTTP: :class:`ScriptedResponder` answers from a function and injects
  faults on demand (429 with ``Retry-After``, 500, a reply slower than the client's timeout, a
  malformed body, a reply that is valid JSON but the wrong schema, a 400 for ``response_format``).

It binds only to 127.0.0.1 (port 0 picks a free port): it has no authentication and is not meant to
be reachable from other machines. A request body over ``max_body_bytes`` is refused (413) unread; the
server remembers only the last ``keep_requests`` requests (tests read them), and of those only the bodies
up to :data:`KEPT_BODY_BYTES`, so a long-running ``mechprobe serve`` (which keeps none) does not grow with
its traffic. The Authorization header is never stored or logged (only whether one was sent).
"""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mechprobe.errors import UsageError
from mechprobe.lm import chat
from mechprobe.lm.choice import ChoiceScorer, normalise, prompt_ids
from mechprobe.lm.generation import decode, generate

LOOPBACK = ("127.0.0.1", "localhost")
MAX_BODY_BYTES = 8 * 1024 * 1024  # a chat request for a local model; far above any judge or chat prompt
KEPT_BODY_BYTES = 64 * 1024  # a remembered request keeps its parsed body only up to this raw size
READ_TIMEOUT_S = 30.0  # a client that announced more body than it sends is dropped after this
MAX_PROMPT_TOKENS = 4096  # default prompt cap of the model responder (the model's context caps it further)
MAX_TEMPERATURE = 2.0  # the API's range is 0..2


@dataclass
class Reply:
    """A raw HTTP reply a responder may return instead of the assistant's text.

    ``body`` is a dict (sent as JSON), str/bytes (sent as is, e.g. a malformed body) or None (the
    server builds a chat completion from ``content``, with ``finish_reason`` and the token counts in
    ``usage`` as ``(prompt_tokens, completion_tokens)``). ``delay`` seconds pass before replying.
    """

    status: int = 200
    body: dict[str, Any] | str | bytes | None = None
    content: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    finish_reason: str = "stop"
    usage: tuple[int, int] = (0, 0)


Responder = Callable[[dict[str, Any]], "str | Reply"]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(content: str, model: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                    finish_reason: str = "stop") -> dict[str, Any]:
    """An OpenAI ``chat.completion`` object holding one assistant message.

    ``finish_reason`` is ``"stop"`` (the model ended its turn) or ``"length"`` (cut at the token cap).
    """
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": finish_reason, "logprobs": None}],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def chat_completion_chunks(content: str, model: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                           finish_reason: str = "stop", include_usage: bool = False) -> list[dict[str, Any]]:
    """The same reply as OpenAI ``chat.completion.chunk`` objects, for ``"stream": true``.

    The role, then the content, then an empty delta carrying ``finish_reason``; with ``include_usage``
    (``stream_options``) a last chunk with no choices carries the usage, as the API sends it.
    """
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""}, None)]
    if content:
        out.append(chunk({"content": content}, None))
    out.append(chunk({}, finish_reason))
    if include_usage:
        out.append({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
    return out


def error_body(message: str, type_: str = "server_error", code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


# --------------------------------------------------------------------------- faults


class Fault:
    """Replies that break a client in one specific way (each a :class:`Reply`)."""

    @staticmethod
    def rate_limit(retry_after: float = 0.05) -> Reply:
        return Reply(429, error_body("rate limited", "rate_limit_error"), headers={"Retry-After": f"{retry_after:g}"})

    @staticmethod
    def server_error(status: int = 500) -> Reply:
        return Reply(status, error_body("internal error"))

    @staticmethod
    def slow(seconds: float, content: str | None = None) -> Reply:
        """Reply only after ``seconds``: past a client's timeout this is a timeout. ``content=None``
        lets a :class:`ScriptedResponder` fill in its normal answer."""
        return Reply(200, content=content, delay=seconds)

    @staticmethod
    def malformed() -> Reply:
        """A 200 whose JSON body is cut off mid-object."""
        return Reply(200, body=b'{"id": "chatcmpl-x", "object": "chat.completion", "choices": [{"mess',
                     headers={"Content-Type": "application/json"})

    @staticmethod
    def wrong_schema(content: str = '{"verdict": "yes", "confidence": 0.9}') -> Reply:
        """A well-formed completion whose *content* is not the requested verdict schema."""
        return Reply(200, content=content)

    @staticmethod
    def bad_request(message: str = "response_format is not supported") -> Reply:
        return Reply(400, error_body(message, "invalid_request_error"))


class ScriptedResponder:
    """Answers with ``answer(body)``, after playing a script of faults, for tests.

    * ``faults``: replies used for the first requests, in order (one per request);
    * ``always``: a reply used for every request (a persistent failure);
    * ``reject_response_format``: answer 400 to any request that sets ``response_format``
      (an endpoint without structured output).
    """

    def __init__(self, answer: Callable[[dict[str, Any]], str] | str, *, faults: Iterable[Reply] = (),
                 always: Reply | None = None, reject_response_format: bool = False):
        self.answer = answer if callable(answer) else (lambda _body, _a=answer: _a)
        self._faults = list(faults)
        self.always = always
        self.reject_response_format = reject_response_format
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> str | Reply:
        if self.reject_response_format and "response_format" in body:
            return Fault.bad_request()
        if self.always is not None:
            return self.always
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        if fault is not None:
            if fault.status == 200 and fault.body is None and fault.content is None:  # e.g. slow(): answer late
                return Reply(200, content=self.answer(body), headers=fault.headers, delay=fault.delay)
            return fault
        return self.answer(body)


class HFResponder:
    """Greedy replies from a local Hugging Face model through its own chat template.

    One request at a time: the model is shared and hooks on it (steering) must see one forward pass
    at a time. ``max_tokens``/``max_completion_tokens`` in a request lower the limit. ``temperature`` > 0
    samples (with the request's ``seed``, else a fresh one) and ``top_p`` applies to it; ``n`` other than 1 is
    refused by :func:`request_problem`.

    A prompt over ``max_prompt_tokens`` or the model's context (``max_position_embeddings``) is refused with a
    400 (code ``context_length_exceeded``) before it reaches the model thread: one huge prompt would hold the
    model for minutes, every other client queued behind it, and Ctrl-C would wait for it.

    Why a worker thread: the HTTP handler threads are daemons, and a daemon thread still inside
    torch when the interpreter finalizes is killed by a forced unwind through C++ frames, which
    aborts the process ("terminate called without an active exception", exit 134). All model work
    therefore runs on one executor thread that :meth:`close` (called by ``ChatServer.stop``) joins,
    and that ``concurrent.futures`` also joins at interpreter exit, before finalization.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int = 256,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS):
        check_max_new_tokens(max_new_tokens)
        check_max_prompt_tokens(max_prompt_tokens)
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.context = _context_length(model)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mechprobe-model")
            return self._pool

    def close(self) -> None:
        """Finish the request in flight (if any) and join the model thread."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __call__(self, body: dict[str, Any]) -> str | Reply:
        problem = request_problem(body)
        msgs = body.get("messages")
        if problem is None and not msgs:
            problem = "'messages' must be a non-empty list"
        if problem is not None:
            return Reply(400, error_body(problem, "invalid_request_error"))
        messages = [{"role": str(m.get("role", "user")), "content": _text_content(m.get("content"))} for m in msgs]
        choices = _label_enum(body.get("response_format"))
        if choices:
            return self._choose(messages, choices)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_new_tokens
        limit = max(1, min(int(limit), self.max_new_tokens))
        try:
            text = chat.render(self.tokenizer, messages, add_generation_prompt=True)
        except chat.ChatTemplateError as e:
            return Reply(400, error_body(str(e), "invalid_request_error"))
        ids, _ = chat.tokenize_rendered(self.tokenizer, text)
        too_long = self._too_long(len(ids))
        if too_long is not None:
            return too_long
        if self.context is not None:
            limit = min(limit, self.context - len(ids))  # prompt and reply together fit the context
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        temperature = float(body.get("temperature") or 0.0)
        seed = body.get("seed")
        seed = int(seed) if seed is not None else random.randrange(2**31)
        top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)

        def run() -> Any:
            stops = chat.assistant_stop_token_ids(self.tokenizer, self.model)
            return generate(self.model, [ids], stop_ids=stops, max_new_tokens=limit, pad_id=pad,
                            temperatures=temperature, seeds=[seed if temperature > 0 else None], top_p=top_p)[0]

        gen = self._executor().submit(run).result()
        _, content = decode(self.tokenizer, gen)
        return Reply(200, body=None, content=content,
                     headers={"X-Mechprobe-Tokens": f"{len(ids)},{len(gen.token_ids)}"},
                     finish_reason="length" if gen.stop_reason == "max_tokens" else "stop",
                     usage=(len(ids), len(gen.token_ids)))

    def _too_long(self, n: int) -> Reply | None:
        """A 400 for a prompt of ``n`` tokens over the cap or the model's context (None when it fits)."""
        cap = self.max_prompt_tokens if self.context is None else min(self.max_prompt_tokens, self.context - 1)
        if n <= cap:
            return None
        why = (f"the model's context of {self.context} tokens" if self.context is not None
               and cap == self.context - 1 else f"this server's cap max_prompt_tokens={self.max_prompt_tokens}")
        return Reply(400, error_body(f"prompt is {n} tokens, over {why}: shorten the messages",
                                     "invalid_request_error", "context_length_exceeded"))

    def _choose(self, messages: list[dict[str, str]], choices: list[str]) -> Reply:
        """A json_schema with a ``label`` enum: constrained choice, exactly as ``--judge local:``.

        The enum values are scored as continuations of the local judge's answer prefix and the most
        probable one is returned as ``{"label": ..., "rationale": ""}`` (the per-choice probabilities
        ride along in ``choice_probs``). No free text is generated, so the reply always validates.
        """

        try:
            _, ids = prompt_ids(self.tokenizer, messages)
        except chat.ChatTemplateError as e:
            return Reply(400, error_body(str(e), "invalid_request_error"))
        too_long = self._too_long(len(ids))
        if too_long is not None:
            return too_long
        scores = self._executor().submit(
            lambda: ChoiceScorer(self.model, self.tokenizer, choices).score(ids)).result()
        probs = normalise(scores)
        best = choices[max(range(len(choices)), key=lambda i: probs[i])]
        content = json.dumps({"rationale": "", "label": best,
                              "choice_probs": {c: round(p, 6) for c, p in zip(choices, probs)}})
        # Nothing is generated (the choices are scored), so the completion counts no tokens.
        return Reply(200, body=None, content=content, headers={"X-Mechprobe-Tokens": f"{len(ids)},0"},
                     usage=(len(ids), 0))


def check_max_new_tokens(n: Any) -> int:
    """Refuse a reply-length cap that is not a positive integer (``--max-new-tokens``), before the model loads."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"max_new_tokens={n!r}: must be a positive integer, e.g. max_new_tokens=256")
    return n


def check_max_prompt_tokens(n: Any) -> int:
    """Refuse a prompt cap that is not a positive integer (``--max-prompt-tokens``), before the model loads."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"max_prompt_tokens={n!r}: must be a positive integer, e.g. "
                         f"max_prompt_tokens={MAX_PROMPT_TOKENS}")
    return n


def _context_length(model: Any) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its text config), None when it has none."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def request_problem(body: dict[str, Any]) -> str | None:
    """What is wrong with a chat request's fields, in a short line for a 400 (None when nothing is).

    Why here and not in each responder: a malformed field (``max_tokens: "ten"``, ``NaN``, a message that is a
    string) would otherwise raise inside the responder and reach the client as a 500 carrying exception text.
    """
    msgs = body.get("messages")
    if msgs is not None and not isinstance(msgs, list):
        return "'messages' must be a list of message objects"
    if msgs and not all(isinstance(m, dict) for m in msgs):
        return "each entry of 'messages' must be an object with 'role' and 'content'"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None:
            continue
        ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 1
              and float(v).is_integer())
        if not ok:
            return f"'{key}' must be a positive integer"
    # Fields the API defines that change the reply: honoured or refused, never silently ignored.
    if body.get("n") is not None and (not _number(body["n"]) or body["n"] != 1):
        return "'n' must be 1: this server returns one choice per request (send n requests with seeds)"
    t = body.get("temperature")
    if t is not None and not (_number(t) and 0 <= t <= MAX_TEMPERATURE):
        return f"'temperature' must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}"
    p = body.get("top_p")
    if p is not None and not (_number(p) and 0 < p <= 1):
        return "'top_p' must be a number in (0, 1]"
    seed = body.get("seed")
    if seed is not None and not (_number(seed) and float(seed).is_integer()):
        return "'seed' must be an integer"
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        return "'stream_options' must be an object"
    return None


def _label_enum(rf: Any) -> list[str] | None:
    """The ``label`` property's enum of a ``json_schema`` response_format (the LLM judge's schema)."""
    try:
        enum = rf["json_schema"]["schema"]["properties"]["label"]["enum"]
    except (KeyError, TypeError):
        return None
    if isinstance(enum, list) and enum and all(isinstance(e, str) and e for e in enum):
        return list(enum)
    return None


def _text_content(c: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are used."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    return "" if c is None else str(c)


# --------------------------------------------------------------------------- server


@dataclass
class SeenRequest:
    """What the server remembers of one request: ``body`` is the parsed JSON only when its raw size was at
    most :data:`KEPT_BODY_BYTES` (else None; ``body_bytes`` still says how large it was)."""

    method: str
    path: str
    body: dict[str, Any] | None
    had_authorization: bool
    body_bytes: int = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: request lines would end up in test output and logs

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            hdrs = {"Content-Type": "application/json", **headers}  # a later Content-Type (a stream) wins
            for k, v in hdrs.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout): nothing to tell it

    def _json(self, status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode("utf-8"), headers or {})

    def _stream(self, chunks: list[dict[str, Any]], headers: dict[str, str]) -> None:
        """Server-sent events, as the API streams: one ``data:`` line per chunk, then ``data: [DONE]``.

        The reply is complete before the first event (the model runs on its own thread), so the events carry
        the whole reply in order; a client reading a stream gets the same text and finish reason.
        """
        events = b"".join(b"data: " + json.dumps(c).encode("utf-8") + b"\n\n" for c in chunks)
        self._send(200, events + b"data: [DONE]\n\n",
                   {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        srv = self.server.owner
        srv._record(SeenRequest("GET", self.path, None, "Authorization" in self.headers))
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": srv.model_name, "object": "model",
                                                         "created": 0, "owned_by": "mechprobe"}]})
        else:
            self._json(404, error_body(f"no route {self.path}", "not_found"))

    def _refuse(self, status: int, message: str) -> None:
        """Answer and close: the rest of the body (if any) was never read, so the connection cannot be reused."""
        self.close_connection = True
        self._json(status, error_body(message, "invalid_request_error"), {"Connection": "close"})

    def _read_body(self) -> bytes | None:
        """The request body, or None after refusing it (bad or too-large ``Content-Length``, a short body).

        Why: ``int()`` of a bad header raised in the handler thread; a negative length read until the client
        closed; a huge one was read whole into memory. The length is checked before anything is read, and a
        body that stops short of its length ends at the socket timeout instead of holding the thread.
        """
        srv = self.server.owner
        given = self.headers.get("Content-Length")
        if given is None:
            return b""
        if not given.strip().isdigit():
            self._refuse(400, "Content-Length must be a non-negative integer")
            return None
        n = int(given)
        if n > srv.max_body_bytes:
            self._refuse(413, f"request body of {n} bytes is over this server's limit of {srv.max_body_bytes}")
            return None
        try:
            raw = self.rfile.read(n) if n else b""
        except (TimeoutError, OSError):
            raw = b""
        if len(raw) != n:
            self._refuse(400, "request body is shorter than its Content-Length")
            return None
        return raw

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        srv = self.server.owner
        raw = self._read_body()
        if raw is None:
            srv._record(SeenRequest("POST", self.path, None, "Authorization" in self.headers))
            return
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        kept = body if len(raw) <= KEPT_BODY_BYTES else None
        srv._record(SeenRequest("POST", self.path, kept, "Authorization" in self.headers, len(raw)))
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._json(404, error_body(f"no route {self.path}", "not_found"))
            return
        if not isinstance(body, dict):
            self._json(400, error_body("request body is not a JSON object", "invalid_request_error"))
            return
        problem = request_problem(body)
        if problem is not None:
            self._json(400, error_body(problem, "invalid_request_error"))
            return
        try:
            out = srv.responder(body)
        except Exception as e:  # noqa: BLE001 - a responder bug is a 500 for the client, not a dead thread
            self._json(500, error_body(f"responder failed: {type(e).__name__}: {e}"))
            return
        reply = out if isinstance(out, Reply) else Reply(200, content=out)
        if reply.delay > 0 and srv._stop.wait(reply.delay):
            self.close_connection = True  # shutting down: drop the connection instead of answering
            return
        model = str(body.get("model") or srv.model_name)
        if reply.body is None and reply.status == 200 and body.get("stream") is True:
            opts = body.get("stream_options") or {}
            chunks = chat_completion_chunks(reply.content or "", model, *reply.usage, reply.finish_reason,
                                            include_usage=bool(opts.get("include_usage")))
            self._stream(chunks, reply.headers)
        elif reply.body is None:
            self._json(reply.status, chat_completion(reply.content or "", model, *reply.usage, reply.finish_reason),
                       reply.headers)
        elif isinstance(reply.body, dict):
            self._json(reply.status, reply.body, reply.headers)
        else:
            data = reply.body.encode("utf-8") if isinstance(reply.body, str) else reply.body
            self._send(reply.status, data, reply.headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    owner: ChatServer

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.owner.read_timeout)  # a stalled client cannot hold a handler thread forever
        super().finish_request(request, client_address)


class ChatServer:
    """An OpenAI-compatible server in a background thread; use as a context manager.

    Args:
        responder: answers each chat request's parsed body.
        host, port: loopback only; port 0 picks a free one.
        model_name: the id ``/v1/models`` lists.
        keep_requests: how many of the latest requests :attr:`requests` remembers (0 = none; the counts in
            :attr:`n_chat_requests` are kept regardless).
        max_body_bytes: a larger request body is refused with 413 before it is read.
        read_timeout: seconds a connection may sit without sending what it announced before it is dropped.

    >>> with ChatServer(ScriptedResponder("hi")) as srv:  # doctest: +SKIP
    ...     client = openai.OpenAI(base_url=srv.base_url, api_key="x")
    """

    def __init__(self, responder: Responder, *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "mechprobe-local", keep_requests: int = 64,
                 max_body_bytes: int = MAX_BODY_BYTES, read_timeout: float = READ_TIMEOUT_S):
        if host not in LOOPBACK:
            raise UsageError(f"host {host!r}: this server has no authentication and binds to loopback only "
                             "(127.0.0.1); put a real reverse proxy in front if you need remote access")
        self.responder = responder
        self.model_name = model_name
        self.host, self.port = "127.0.0.1", port
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.requests: deque[SeenRequest] = deque(maxlen=max(0, keep_requests))
        self._n_chat = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    def _record(self, r: SeenRequest) -> None:
        with self._lock:
            self._n_chat += r.method == "POST" and r.path.endswith("/chat/completions")
            self.requests.append(r)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def n_chat_requests(self) -> int:
        with self._lock:
            return self._n_chat

    def start(self) -> ChatServer:
        self._stop.clear()
        try:
            self._httpd = _Server((self.host, self.port), _Handler)
        except OSError as e:
            raise UsageError(_port_message(self.port, e)) from None
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"mechprobe-server-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wakes handlers sleeping in a slow() fault
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        close = getattr(self.responder, "close", None)
        if callable(close):
            close()  # join the responder's model thread (see HFResponder)

    def wait(self) -> None:
        """Block until Ctrl-C (for the command line), then stop."""
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _port_message(port: int, e: OSError) -> str:
    return (f"cannot listen on 127.0.0.1:{port} ({e.strerror or e}): another server probably uses that port; stop it "
            f"or pass another port=")


def check_port_free(port: int) -> None:
    """Refuse a port that cannot be bound, before the model loads (:class:`UsageError`, one line)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"port={port}: must be in 0..65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise UsageError(_port_message(port, e)) from None
