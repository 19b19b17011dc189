"""Keep secrets out of everything mechprobe shows or stores: API keys and credentials inside URLs.

Why a module of its own: an OpenAI-compatible endpoint is untrusted text. A careless (or proxying)
server may echo the ``Authorization`` header into an error message *or into the verdict itself*, and
a base URL may carry ``user:password@``. Every string that came from an endpoint or names its URL goes
through :func:`redact_url` / :class:`Scrubber` before it reaches a record, a cache entry, a manifest,
a log line or an exception.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit, urlunsplit

REDACTED = "<redacted>"
# Shorter strings could be common words or digits; replacing them would mangle honest text.
_MIN_SECRET = 4
# scheme://anything-without-slash-space-or-at@ : the userinfo part of any URL inside free text.
_URL_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")


def redact_url(url: str | None) -> str | None:
    """``url`` with any ``user:password@`` replaced by ``<redacted>@`` (scheme, host, port, path kept).

    >>> redact_url("https://bob:hunter2@api.example.com:8443/v1")
    'https://<redacted>@api.example.com:8443/v1'
    """
    if not url:
        return url
    try:
        s = urlsplit(url)
    except ValueError:
        return REDACTED  # unparseable: showing it could show its credentials
    if s.username is None and s.password is None and "@" not in s.netloc:
        return url
    host = s.netloc.rsplit("@", 1)[-1]
    return urlunsplit((s.scheme, f"{REDACTED}@{host}", s.path, s.query, s.fragment))


def url_secrets(url: str | None) -> list[str]:
    """The credentials a URL carries, in every form a server might echo them.

    httpx turns ``user:password@`` into ``Authorization: Basic base64(user:password)``, so the
    base64 form is a secret too, and so are the raw and percent-decoded password.
    """
    if not url:
        return []
    try:
        s = urlsplit(url)
    except ValueError:
        return []
    out: list[str] = []
    if s.password:
        user, pw = unquote(s.username or ""), unquote(s.password)
        out += [s.password, pw, f"{user}:{pw}", base64.b64encode(f"{user}:{pw}".encode()).decode()]
    elif s.username:
        out += [s.username, unquote(s.username)]
    return out


class Scrubber:
    """Replaces every known secret (and credentials inside any URL) in a string with ``<redacted>``."""

    def __init__(self, secrets: Iterable[str | None] = ()):
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted({s for s in secrets if s and len(s) >= _MIN_SECRET}, key=len, reverse=True)

    def __call__(self, text: str, limit: int | None = None) -> str:
        for s in self.secrets:
            text = text.replace(s, REDACTED)
        text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
        return text if limit is None else text[:limit]

