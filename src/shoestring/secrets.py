"""Secrets kept out of everything a run writes: one redaction rule for URLs.

A storage URL may carry credentials (``s3://…?X-Amz-Signature=…``, presigned
``https://…?sig=…``, ``sftp://user:password@host/…``) and a webhook URL is itself a
secret (Slack's, Discord's, Teams' path is the token). The live value is used to
connect; every copy written down — ``config.yaml``, checkpoint metadata, the event
log, log lines, trackers, reports — goes through :func:`redact` first.

The rule, for every ``scheme://…`` found in a string:

- userinfo with a password: ``user:***@``; a bare user name that looks like a token
  (``https://ghp_…@github.com``: 16 or more characters mixing letters and digits) is
  masked whole, ``***@``; an ordinary user name (``git@``, ``bob@``) is kept;
- query (and fragment) parameters whose name says signature, token, credential,
  key, secret or password: ``name=***`` (others are kept byte for byte);
- a webhook URL (a known webhook host, or ``hook`` in its path): only the scheme and
  host are kept, ``https://hooks.slack.com/***``.

``known`` names values that are secret whatever their shape (the configured webhook):
each occurrence is replaced by its webhook form before the generic rule runs.
Redaction is idempotent, so comparing redacted forms (a resume checking the stored
config) is comparing like with like.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from collections.abc import Iterable
from typing import Any, TypeVar
from urllib.parse import unquote

MASK = "***"

#: Query/fragment parameter names (lower case) whose value is a secret.
SECRET_PARAMS = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "googleaccessid",
        "signature",
        "sig",
        "token",
        "access_token",
        "id_token",
        "refresh_token",
        "auth",
        "key",
        "apikey",
        "api_key",
        "client_secret",
        "secret",
        "password",
        "passwd",
        "pw",
        "se_token",
        "code",
    }
)
_SECRET_WORDS = ("signature", "token", "secret", "password", "credential", "apikey", "api_key")

#: Hosts whose URL paths are webhook secrets (suffix match).
WEBHOOK_HOSTS = (
    "hooks.slack.com",
    "discord.com",
    "discordapp.com",
    "webhook.office.com",
    "outlook.office.com",
    "chat.googleapis.com",
    "api.telegram.org",
)

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]{0,30}://[^\s'\"<>`\\]+")

T = TypeVar("T")


def looks_like_token(user: str) -> bool:
    """A URL user name that is a credential: 16+ characters with letters and digits
    (``ghp_…``, ``hf_…``, ``glpat-…``, an access key); ``git``, ``bob.smith`` are not."""
    u = unquote(user)
    return (
        len(u) >= 16 and any(c.isdigit() for c in u) and any(c.isalpha() for c in u) and u != MASK
    )


def _secret_param(name: str) -> bool:
    n = unquote(name).strip().lower()
    return n in SECRET_PARAMS or any(w in n for w in _SECRET_WORDS)


def _redact_params(part: str) -> str:
    """``a=1&sig=x`` -> ``a=1&sig=***``; order, spelling and separators kept."""
    pieces = re.split(r"([&;])", part)
    out = []
    for p in pieces:
        name, eq, _value = p.partition("=")
        out.append(f"{name}={MASK}" if eq and _secret_param(name) else p)
    return "".join(out)


def _split_netloc(url: str) -> tuple[str, str, str]:
    """(scheme://, netloc, rest) of ``url`` without re-encoding anything."""
    scheme, _, after = url.partition("://")
    cut = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    return scheme + "://", after[:cut], after[cut:]


def _host(netloc: str) -> str:
    return netloc.rpartition("@")[2].lower()


def _is_webhook(netloc: str, rest: str) -> bool:
    host = _host(netloc).split(":")[0]
    known = any(host == h or host.endswith("." + h) for h in WEBHOOK_HOSTS)
    path = rest.split("?", 1)[0].split("#", 1)[0]
    return known or "hook" in path.lower()


def redact_webhook(url: str) -> str:
    """Scheme and host only: ``https://hooks.slack.com/***``."""
    if "://" not in url:
        return MASK
    scheme, netloc, _rest = _split_netloc(url)
    return f"{scheme}{_host(netloc)}/{MASK}"


def redact_url(url: str) -> str:
    """One URL with its secrets masked (see the module text for the rule)."""
    if "://" not in url:
        return url
    scheme, netloc, rest = _split_netloc(url)
    if _is_webhook(netloc, rest):
        return redact_webhook(url)
    user, at, hostport = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.split(':', 1)[0]}:{MASK}@{hostport}"
    elif at and looks_like_token(user):
        netloc = f"{MASK}@{hostport}"
    path, q, query = rest.partition("?")
    query, h, frag = query.partition("#") if q else ("", "", "")
    if not q:
        path, h, frag = rest.partition("#")
    rest = path + (q + _redact_params(query) if q else "") + (h + _redact_params(frag) if h else "")
    return scheme + netloc + rest


def redact_text(text: str, known: Iterable[str] = ()) -> str:
    """Every URL in ``text`` redacted; each ``known`` secret first by its webhook form."""
    for k in known:
        if k and k in text:
            text = text.replace(k, redact_webhook(k))
    if "://" not in text:
        return text
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def redact(obj: T, known: Iterable[str] = ()) -> T:
    """A copy of ``obj`` (str, or dicts/lists/tuples of them, any depth) with every string
    redacted by :func:`redact_text`; other values are returned as they are."""
    known = tuple(k for k in known if k)
    return _redact(obj, known)  # type: ignore[no-any-return]


def _redact(obj: Any, known: tuple[str, ...]) -> Any:
    if isinstance(obj, str):
        return redact_text(obj, known)
    if isinstance(obj, dict):
        return {_redact(k, known): _redact(v, known) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_redact(v, known) for v in obj)
    return obj


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's final message (installed on the
    handlers of the CLI: every log line of every verb goes through it)."""

    def __init__(self, known: Iterable[str] = ()) -> None:
        super().__init__()
        self.known = tuple(k for k in known if k)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report
            return True
        clean = redact_text(msg, self.known)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


def print_thread_exception(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook`` with the traceback redacted (Python's own hook prints an
    exception raised in a thread, URL and all, straight to stderr). Installed by the CLI."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    print(redact_text(f"Exception in thread {name}:\n{text}"), end="", file=sys.stderr, flush=True)
