"""The LLM judge: any OpenAI-compatible endpoint (OpenAI, vLLM, ollama, llama.cpp server).

Robustness is the point of this module, because a judge run is thousands of requests:

* structured output (``response_format={"type": "json_schema", ...}``) where the endpoint accepts
  it; on a 400/422 the judge switches, for the rest of the run, to a plain "reply with JSON"
  instruction and parses defensively (the first balanced ``{...}`` block in the reply);
* bounded concurrency (a thread pool) and retries with exponential backoff and jitter on 429, 5xx,
  timeouts, connection errors and unreadable response bodies, honouring ``Retry-After``;
* a disk cache keyed by sha256 of (judge model, prompt version, taxonomy version, conversation, raw
  user turn), so re-running a judged run costs no requests. Failures are never cached;
* a reply that still fails or does not parse becomes ``LabelRecord(label="judge_error",
  genuine=None, error=reason)``: an endpoint problem is never counted as any label;
* the API key is only handed to the client. It is never part of a cache entry, a record, an error
  string or :meth:`LLMJudge.public_config`: everything the endpoint sends back (error messages *and*
  verdict rationales) is scrubbed of the key and of URL credentials before it is stored or shown,
  and a base URL is only ever shown with its ``user:password@`` redacted (:mod:`mechprobe.redact`).

Auth failures (401/403) and unknown models (404) stop the run instead of writing one error row per
turn: they are configuration errors with a fix, not per-turn events.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mechprobe.audit.codebook import codebook_core, codebook_text
from mechprobe.errors import UsageError, UserError
from mechprobe.judges.base import JudgeInput
from mechprobe.records import LabelRecord
from mechprobe.redact import Scrubber, redact_url, url_secrets
from mechprobe.taxonomy import (
    GENUINE,
    JUDGE_ERROR,
    LABELS,
    TAXONOMY_VERSION,
    is_genuine,
)

PROMPT_VERSION = "prompt-v2-codebook"  # v2: the codebook (mechprobe/audit/labeling_guide.md), see below
LOCAL_PROMPT_VERSION = "prompt-v2-codebook-core"

_INTRO = """You are an expert annotator for research on chat language models.
A chat model was shown a conversation (a user query and its own assistant answer) followed by the
header of a new *user* turn, and it wrote that next user turn itself. You label what it wrote."""

_RULES = """Rules:
- Judge only the generated user turn, given the conversation; do not judge the assistant answer.
- "genuine" is true exactly when the label is genuine_followup.
Reply with one JSON object: {"rationale": "<one sentence>", "label": "<label>", "genuine": <true|false>}."""


def system_prompt(core_only: bool = False) -> str:
    """The LLM judge's system prompt: the labelling codebook plus the reply format.

    Why from the codebook: the audit sheet shows labellers the same file, so a judge and the people (or
    models) who audit it follow one text (:mod:`mechprobe.audit.codebook`).

    Args:
        core_only: only the codebook's rules (:func:`~mechprobe.audit.codebook.codebook_core`), no worked
            examples; what the local judge uses, because on a CPU every prompt token costs time.
    Returns:
        the system message.
    Example:
        >>> "## Decision order" in system_prompt(core_only=True)
        True
    """
    book = codebook_core() if core_only else codebook_text()
    return f"{_INTRO}\n\nThe codebook (choose exactly one label):\n\n{book}\n\n{_RULES}"


SYSTEM_PROMPT = system_prompt()
LOCAL_SYSTEM_PROMPT = system_prompt(core_only=True)

JSON_SCHEMA: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "user_turn_label",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "rationale": {"type": "string"},
                "label": {"type": "string", "enum": list(LABELS)},
                "genuine": {"type": "boolean"},
            },
            "required": ["rationale", "label", "genuine"],
            "additionalProperties": False,
        },
    },
}
PLAIN_SUFFIX = "\n\nReply with the JSON object only, no other text."


def render_user_message_parts(inp: JudgeInput) -> tuple[str, str]:
    """(conversation part, generated-turn part) of the user message; joined they are the message.

    Split so that the local judge can compute the conversation once for all its user turns.
    """
    parts = ["<conversation>"]
    for m in inp.conversation():
        parts.append(f"[{m['role']}]\n{m['content']}")
    parts.append("</conversation>")
    stop = f" (generation stopped by: {inp.stop_reason})" if inp.stop_reason else ""
    turn = [f"<generated_user_turn{stop}>", inp.raw_text, "</generated_user_turn>",
            "Label the generated user turn."]
    return "\n".join(parts) + "\n", "\n".join(turn)


def render_user_message(inp: JudgeInput) -> str:
    """The judge's user message: the conversation and the raw generated turn, clearly delimited."""
    conv, turn = render_user_message_parts(inp)
    return conv + turn


def build_messages(inp: JudgeInput, structured: bool = True, system: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    user = render_user_message(inp) + ("" if structured else PLAIN_SUFFIX)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def cache_key(model: str, inp: JudgeInput, prompt_version: str = PROMPT_VERSION) -> str:
    """sha256 over what determines the verdict; never the key, the URL or timing options."""
    payload = {"model": model, "prompt_version": prompt_version, "taxonomy": TAXONOMY_VERSION,
               "conversation": inp.conversation(), "user_turn": inp.raw_text, "stop_reason": inp.stop_reason}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def default_cache_dir() -> Path:
    """``$MECHPROBE_CACHE/judge``, else ``$XDG_CACHE_HOME/mechprobe/judge`` (as mechprobe.lm.registry.cache_dir)."""
    if os.environ.get("MECHPROBE_CACHE"):
        return Path(os.environ["MECHPROBE_CACHE"]).expanduser() / "judge"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mechprobe" / "judge"


class JudgeCache:
    """One small JSON file per verdict (``ab/abcdef....json``), written atomically.

    Files rather than one database: concurrent writers never conflict, a killed run leaves no
    half-written shared file, and entries are easy to inspect or delete.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached verdict, or None (a miss) when there is none or the entry is unusable.

        Why an entry with ``NaN``/``Infinity`` (or that is not an object) is a miss: a cached NaN score flowed
        into the labels and stopped the run only when ``labels.jsonl`` refused it, after the turns before it
        were judged; recomputing the one turn is cheap and the entry is then overwritten.
        """
        p = self._path(key)
        try:
            hit = json.loads(p.read_text(encoding="utf-8"), parse_constant=_reject_constant)
        except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
            return None
        return hit if isinstance(hit, dict) else None

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Store ``value`` atomically; a value holding a non-finite number is not stored (see :meth:`get`)."""
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except ValueError:
            return
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)


def _reject_constant(name: str) -> Any:
    """``json.loads`` hook for ``NaN``/``Infinity``/``-Infinity``: refuse them (they are not JSON)."""
    raise ValueError(f"non-finite number {name} in a judge cache entry")


class ParseError(ValueError):
    """A reply arrived but is not a valid verdict."""


def _first_json_object(s: str) -> str | None:
    """The first balanced ``{...}`` block (braces inside JSON strings respected)."""
    start = s.find("{")
    while start != -1:
        depth, in_str, esc = 0, False, False
        for i in range(start, len(s)):
            ch = s[i]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return s[start:i + 1]
        start = s.find("{", start + 1)
    return None


def parse_verdict(content: str | None) -> tuple[str, str]:
    """(label, rationale) from a reply, tolerating code fences, prose around the JSON and label case."""
    if not content or not content.strip():
        raise ParseError("empty reply")
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", content.strip())
    obj: Any = None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        block = _first_json_object(text)
        if block is not None:
            try:
                obj = json.loads(block)
            except json.JSONDecodeError:
                obj = None
    if not isinstance(obj, dict):
        raise ParseError(f"no JSON object in reply: {content[:120]!r}")
    label = obj.get("label")
    if not isinstance(label, str):
        raise ParseError(f"reply has no string 'label' (keys: {sorted(obj)[:6]})")
    norm = re.sub(r"[\s-]+", "_", label.strip().strip("`'\"").lower())
    if norm not in LABELS:
        raise ParseError(f"label {label[:60]!r} is not in the taxonomy")
    rationale = obj.get("rationale", "")
    rationale = rationale if isinstance(rationale, str) else json.dumps(rationale)[:500]
    g = obj.get("genuine")
    if isinstance(g, bool) and g != (norm == GENUINE):
        rationale += f" [judge said genuine={g}; label {norm} decides]"
    return norm, rationale.strip()


class JudgeFatal(UserError, RuntimeError):
    """A configuration error (bad key, unknown model): stop instead of writing error rows."""


@dataclass
class _Outcome:
    label: str
    rationale: str
    error: str | None = None


class LLMJudge:
    """Label user turns with an LLM behind an OpenAI-compatible endpoint.

    ``base_url`` / ``api_key`` default to ``$OPENAI_BASE_URL`` / ``$OPENAI_API_KEY`` (then
    ``$MECHPROBE_JUDGE_BASE_URL`` / ``$MECHPROBE_JUDGE_API_KEY``). ``cache_dir=False`` disables the
    cache; ``structured`` is ``"auto"`` (try json_schema, fall back on 400), True or False.
    ``stats`` counts requests, retries, cache hits, fallbacks and errors (thread-safe). Backoff is
    ``backoff * 2**attempt`` seconds (capped at ``max_backoff``) times a jitter in [0.5, 1), or the
    server's ``Retry-After`` when it sends one.

    A turn the endpoint fails on becomes a ``judge_error`` record (retried by the next
    :func:`~mechprobe.judges.run.judge_run`); a refused key or an unknown model raises :class:`JudgeFatal`.

    Args:
        model: the endpoint's model name (``gpt-4o-mini``, or a local server's model).
        base_url: OpenAI-compatible endpoint; None (default) = environment (see above), else api.openai.com.
        api_key: API key; None (default) = environment. Without any key a ``base_url`` is required (local
            servers get a placeholder key).
        concurrency: requests in flight in :meth:`label_many` (default 4, >= 1).
        timeout: seconds per request (default 60).
        max_retries: retries per turn on rate limits, timeouts and server errors (default 5).
        backoff: base of the exponential backoff in seconds (default 1.0).
        max_backoff: cap of one backoff wait in seconds (default 60).
        cache_dir: verdict cache directory; None or True (default) = ``$MECHPROBE_CACHE/judge`` (else
            ``~/.cache/mechprobe/judge``), False = no cache.
        structured: ``"auto"`` (default), True (always json_schema) or False (plain JSON in the text).
        max_tokens: completion token cap per verdict (default 300).
        client: a ready OpenAI-compatible client; None (default) builds ``openai.OpenAI`` (tests inject a fake).
        sleep: the function used to wait between retries (default ``time.sleep``; injectable for tests).

    Attributes:
        name: ``"openai:<model>@<prompt version>"``, stored in every label.
        stats: counters ``requests``, ``retries``, ``cache_hits``, ``errors``, ``fallbacks``.

    Example:
        >>> from mechprobe import JudgeInput, LLMJudge
        >>> judge = LLMJudge("gpt-4o-mini")                   # needs $OPENAI_API_KEY  # doctest: +SKIP
        >>> local = LLMJudge("qwen2.5-7b-instruct", base_url="http://localhost:8000/v1")  # doctest: +SKIP
        >>> inp = JudgeInput(record_id="r1", prompt="What is 12 * 7?", response="84.", raw_text="Why 84?")
        >>> judge.label(inp).label                                                      # doctest: +SKIP
        'genuine_followup'
    """

    def __init__(self, model: str, *, base_url: str | None = None, api_key: str | None = None,
                 concurrency: int = 4, timeout: float = 60.0, max_retries: int = 5, backoff: float = 1.0,
                 max_backoff: float = 60.0, cache_dir: str | Path | bool | None = None,
                 structured: bool | str = "auto", max_tokens: int = 300, client: Any = None,
                 sleep: Any = time.sleep, core_codebook: bool = False):
        if concurrency < 1:
            raise UsageError(f"concurrency must be >= 1, got {concurrency}")
        self.model = model
        # core_codebook: the codebook's rules only (the local judge's prompt), e.g. to check that a served model
        # and the in-process local judge give the same verdicts on the same prompt.
        self.system = LOCAL_SYSTEM_PROMPT if core_codebook else SYSTEM_PROMPT
        self.prompt_version = LOCAL_PROMPT_VERSION if core_codebook else PROMPT_VERSION
        self.name = f"openai:{model}@{self.prompt_version}"
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or os.environ.get("MECHPROBE_JUDGE_BASE_URL")
        key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("MECHPROBE_JUDGE_API_KEY")
        if not key:
            if not self.base_url:
                raise JudgeFatal("the LLM judge needs an API key: set OPENAI_API_KEY (or pass base_url= for a "
                                 "local endpoint that needs none), or use judge=offline")
            key = "no-key"  # local servers (vLLM, ollama, llama.cpp) ignore it; the client insists on one
        # Every string from the endpoint (errors *and* verdict rationales) passes through this before it
        # is stored or shown: a server may echo the Authorization header (key, or Basic user:password).
        self._scrub_secrets = Scrubber([key if key != "no-key" else None, *url_secrets(self.base_url)])
        self._shown_url = redact_url(self.base_url) or "api.openai.com"
        self.concurrency = concurrency
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.max_tokens = max_tokens
        self._structured: bool = structured is True or structured == "auto"
        self._auto = structured == "auto"
        if cache_dir is False:
            self.cache: JudgeCache | None = None
        else:
            self.cache = JudgeCache(default_cache_dir() if cache_dir in (None, True) else Path(str(cache_dir)))
        if client is None:
            import openai  # lazy: only API judges use the client

            client = openai.OpenAI(api_key=key, base_url=self.base_url, timeout=self.timeout, max_retries=0)
        self.client = client
        self._sleep = sleep  # injectable so tests can observe backoff delays without waiting them out
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0, "errors": 0, "fallbacks": 0}

    # ------------------------------------------------------------------ helpers

    def public_config(self) -> dict[str, Any]:
        """What manifests may record (no key; the base URL without credentials)."""

        return {"model": self.model, "prompt_version": self.prompt_version, "taxonomy": TAXONOMY_VERSION,
                "base_url": _safe_base_url(self.base_url), "concurrency": self.concurrency,
                "timeout": self.timeout, "max_retries": self.max_retries,
                "structured_output": self._structured, "cache": str(self.cache.root) if self.cache else None}

    def _count(self, k: str) -> None:
        with self._lock:
            self.stats[k] += 1

    def _scrub(self, s: str, limit: int | None = 300) -> str:
        """``s`` without the API key or URL credentials (in any form a server echoes), cut to ``limit``."""
        return self._scrub_secrets(s, limit)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None and retry_after >= 0:
            return min(retry_after, self.max_backoff)
        base = min(self.max_backoff, self.backoff * (2 ** attempt))
        return base * (0.5 + random.random() / 2)  # jitter: concurrent workers do not retry in lockstep

    @staticmethod
    def _retry_after(exc: Any) -> float | None:
        headers = getattr(getattr(exc, "response", None), "headers", None) or {}
        for name, div in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
            v = headers.get(name)
            if v is not None:
                try:
                    return float(v) / div
                except ValueError:
                    continue
        return None

    # ------------------------------------------------------------------ one request

    def _request(self, inp: JudgeInput) -> _Outcome:
        import openai  # lazy: only API judges use the client

        last = "no attempt made"
        attempt = 0
        while attempt <= self.max_retries:
            structured = self._structured
            kw: dict[str, Any] = {"model": self.model, "messages": build_messages(inp, structured, self.system),
                                  "temperature": 0.0, "max_tokens": self.max_tokens}
            if structured:
                kw["response_format"] = JSON_SCHEMA
            self._count("requests")
            retry_after: float | None = None
            try:
                resp = self.client.chat.completions.create(**kw)
            except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
                if structured and self._auto:
                    # The endpoint may not support json_schema: switch to plain JSON for the whole run.
                    with self._lock:
                        if self._structured:
                            self._structured = False
                            self.stats["fallbacks"] += 1
                    continue  # not a retry of a transient failure: no attempt consumed, no sleep
                return _Outcome(JUDGE_ERROR, "", self._scrub(f"http_{e.status_code}: {e.message}"))
            except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
                raise JudgeFatal(self._scrub(f"the endpoint refused the API key ({e.status_code}): check "
                                             f"OPENAI_API_KEY / api_key_env= for {self._shown_url}")) from None
            except openai.NotFoundError as e:
                raise JudgeFatal(self._scrub(f"model {self.model!r} or the chat endpoint was not found at "
                                             f"{self._shown_url} (404: {e.message}); "
                                             "check judge=openai:MODEL and base_url=")) from None
            except openai.APIStatusError as e:
                last = self._scrub(f"http_{e.status_code}: {e.message}")
                if not (e.status_code in (408, 409, 429) or e.status_code >= 500):
                    return _Outcome(JUDGE_ERROR, "", last)
                retry_after = self._retry_after(e)
            except openai.APITimeoutError:
                last = f"timeout: no reply within {self.timeout:g}s"
            except openai.APIConnectionError as e:
                last = self._scrub(f"connection: {e.message}")
            except (ValueError, openai.APIResponseValidationError) as e:  # JSONDecodeError is a ValueError
                last = self._scrub(f"malformed_response: {type(e).__name__}: {e}")
            else:
                content = self._content(resp)
                if content is None:
                    last = f"malformed_response: not a chat completion ({type(resp).__name__})"
                else:
                    try:
                        label, why = parse_verdict(content)
                    except ParseError as e:
                        # A deterministic (temperature 0) judge would answer the same again: no retry.
                        return _Outcome(JUDGE_ERROR, "", self._scrub(f"unparseable_verdict: {e}"))
                    return _Outcome(label, self._scrub(why, None))
            if attempt < self.max_retries:
                self._count("retries")
                self._sleep(self._delay(attempt, retry_after))
            attempt += 1
        return _Outcome(JUDGE_ERROR, "", f"{last} (gave up after {self.max_retries + 1} attempts)")

    @staticmethod
    def _content(resp: Any) -> str | None:
        try:
            return resp.choices[0].message.content or ""
        except (AttributeError, IndexError, TypeError):
            return None

    # ------------------------------------------------------------------ public

    def label(self, inp: JudgeInput) -> LabelRecord:
        """Cache, then endpoint; never raises for per-turn failures (see :class:`JudgeFatal`)."""
        key = cache_key(self.model, inp, self.prompt_version)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None and hit.get("label") in LABELS:
                self._count("cache_hits")
                return LabelRecord(record_id=inp.record_id, label=hit["label"], genuine=is_genuine(hit["label"]),
                                   rationale=self._scrub(hit.get("rationale", ""), None), judge=self.name)
        out = self._request(inp)
        if out.label == JUDGE_ERROR:
            self._count("errors")
            return LabelRecord(record_id=inp.record_id, label=JUDGE_ERROR, genuine=None,
                               rationale="the judge failed on this turn; re-run to retry", judge=self.name,
                               error=out.error)
        if self.cache is not None:
            self.cache.put(key, {"label": out.label, "rationale": out.rationale, "judge": self.name,
                                 "model": self.model, "prompt_version": self.prompt_version})
        return LabelRecord(record_id=inp.record_id, label=out.label, genuine=is_genuine(out.label),
                           rationale=out.rationale, judge=self.name)

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        """At most ``concurrency`` requests in flight; records are yielded as they complete."""
        if not inputs:
            return
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="judge") as pool:
            futures = [pool.submit(self.label, inp) for inp in inputs]
            try:
                for fut in as_completed(futures):
                    yield fut.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise


def _safe_base_url(url: str | None) -> str | None:
    """Scheme, host and path only: a URL may carry credentials (``https://user:pass@host``)."""
    if not url:
        return None
    s = urlsplit(url)
    host = s.hostname or ""
    port = f":{s.port}" if s.port else ""
    return f"{s.scheme}://{host}{port}{s.path}"
