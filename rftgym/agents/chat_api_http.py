"""The HTTP side of a chat-API agent: the opener it sends with, and how what comes back is read
(error bodies and their reasons, compressed replies, replies cut short)."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
import zlib

from ..core.errors import ChatAPIError
from ..core.web import build_opener, is_loopback

MAX_REPLY_BYTES = 64 << 20
MAX_ERROR_BYTES = 64 << 10  # of an error reply's body, read for its reason
SNIPPET_CHARS = 300


class RetryableError(Exception):
    """A failure worth retrying (connection error, timeout, a reply cut short, 408, 409, 429, 5xx)."""

    def __init__(self, what: str, status: int | None = None, retry_after: float | None = None,
                 broke_off: bool = False, timed_out: bool = False):
        super().__init__(what)
        self.what = what
        self.status = status
        self.retry_after = retry_after
        self.broke_off = broke_off  # the server answered, and its reply broke off: it is reachable
        self.timed_out = timed_out  # no answer within timeout_s (a busy server's queue counts)


class ContextFull(Exception):
    """The server refused the request because the context does not fit the model's window."""


# How OpenAI-compatible servers word "the prompt (plus max_tokens) does not fit the context":
# OpenAI's error code, OpenAI's and vLLM's "maximum context length", SGLang's "context length",
# llama.cpp's "context size", TGI's "`max_new_tokens` must be <=" and "`inputs` must have less than
# N tokens" (HTTP 422s, with or without the backticks), vLLM's "The decoder prompt (length N) is
# longer than the maximum model length".
_CONTEXT_FULL_ERROR = re.compile(r"context_length_exceeded|context[ _-]length|maximum context|context size|"
                                 r"context window|max_new_tokens`? must be <=|inputs`? must have less than|"
                                 r"longer than the maximum model length", re.IGNORECASE)


def error_texts(body: bytes) -> list[str]:
    """The text fields of an error body's error object (OpenAI's ``{"error": {...}}``, or vLLM's
    and TGI's top-level fields), never the rest of the body (which may echo the prompt)."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    if not isinstance(payload, dict):
        return []
    fields = [payload.get(k) for k in ("message", "detail", "code", "type", "error_type")]
    error = payload.get("error")
    fields += [error.get(k) for k in ("message", "code", "type")] if isinstance(error, dict) else [error]
    return [f for f in fields if isinstance(f, str)]


def context_full_reason(body: bytes) -> str | None:
    """The server's words when an error body says the context does not fit, else None."""
    texts = error_texts(body)
    if not any(_CONTEXT_FULL_ERROR.search(text) for text in texts):
        return None
    return max(texts, key=len)[:300]


def snippet(body: bytes | str | None) -> str:
    if body is None:
        return ""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    if len(text) > SNIPPET_CHARS:
        text = text[: SNIPPET_CHARS - 3] + "..."
    return text


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would resend the POST as a GET (301-303: then an HTTP 405
    that blames the request) or give up on it (307, 308). The agent names the new address instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def chat_opener(url: str) -> urllib.request.OpenerDirector:
    handlers: list = [_NoRedirects()]
    # Requests to a server on this machine never go through an HTTP(S)_PROXY from the
    # environment; remote servers use the standard urllib handlers (env proxies honoured).
    if is_loopback(urllib.parse.urlsplit(url).hostname):
        handlers.append(urllib.request.ProxyHandler({}))
    return build_opener(*handlers)  # connections that a request's deadline can shut


def decoded(raw: bytes, encoding: str | None, url: str) -> bytes:
    """The body without the content coding a server applied though the request asked for none
    (urllib sends ``Accept-Encoding: identity``): gzip and deflate are undone, within the reply
    size limit; another coding is an error that names it."""
    coding = (encoding or "identity").strip().lower()
    if coding in ("identity", ""):
        return raw
    if coding not in ("gzip", "x-gzip", "deflate"):
        raise ChatAPIError(f"POST {url} sent its reply in the {coding!r} content coding, which the agent does not "
                           "read (it asks for none); turn the server's or proxy's compression off")
    # gzip's header (wbits 16+), or deflate's zlib one (wbits 15); some servers send raw deflate (-15)
    for wbits in ((31,) if coding != "deflate" else (15, -15)):
        inflater = zlib.decompressobj(wbits)
        try:
            body = inflater.decompress(raw, MAX_REPLY_BYTES + 1)
        except zlib.error:
            continue
        if len(body) > MAX_REPLY_BYTES:
            raise ChatAPIError(f"POST {url} sent a {coding} reply of over {MAX_REPLY_BYTES >> 20} MiB once "
                               "inflated; a chat completion is far smaller")
        if not inflater.eof:  # the compressed stream stops early: the connection closed mid-way
            raise RetryableError(f"the {coding} reply breaks off before its end", broke_off=True)
        return body
    raise ChatAPIError(f"POST {url} said its reply is {coding}-compressed, but it does not inflate; turn the "
                       "server's or proxy's compression off")


def cut_short(raw: bytes, error: ValueError) -> bool:
    """Whether a body that does not decode is the start of a JSON object: a reply whose connection
    closed early where no length was announced to tell (HTTP/1.0, Connection: close)."""
    if not raw.lstrip().startswith(b"{"):
        return False
    if isinstance(error, UnicodeDecodeError):  # cut inside a character
        return error.reason == "unexpected end of data"
    if isinstance(error, json.JSONDecodeError):
        rest = error.doc[error.pos:].rstrip()
        # Cut at the end, inside a string, or inside a literal (`{"content": nul`).
        return error.pos >= len(error.doc.rstrip()) or error.msg.startswith("Unterminated string") or \
            any(literal.startswith(rest) for literal in ("true", "false", "null"))
    return False
