"""An agent backed by any OpenAI-compatible ``/v1/chat/completions`` server.

Works with vLLM (``vllm serve``), the llama.cpp server, OpenAI, and anything else that speaks
the chat-completions protocol. Only the standard library is used for HTTP.

``base_url`` is the part of the URL *before* ``/chat/completions``; for a local vLLM or llama.cpp
server that is usually ``http://127.0.0.1:8000/v1``. The agent POSTs to
``f"{base_url}/chat/completions"`` exactly (a trailing slash is stripped; nothing is appended).

The agent only sees text, so the token fields of each :class:`AgentReply` are ``None``.
A batch of contexts is sent concurrently (one request per context, at most
``max_concurrency`` in flight). Connection errors, timeouts, HTTP 429 and HTTP 5xx are retried
with exponential backoff; a refusal because the context does not fit the model's window becomes
an empty reply with finish reason ``CONTEXT_FULL`` (the episode ends there, truncated); other
HTTP errors and malformed responses raise
:class:`~rftgym.core.errors.ChatAPIError` at once.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import queue
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..core.errors import ChatAPIError, ConfigError
from ..core.messages import Context
from ..core.web import BodyTooLarge, BodyTooSlow, is_loopback, read_body
from .base import CONTEXT_FULL, Agent, AgentReply

__all__ = ["ChatAPIConfig", "ChatAPIAgent"]


class _RequestPool:
    """Worker threads for concurrent requests. They are daemon threads, unlike a
    ThreadPoolExecutor's, which the interpreter joins at exit: after Ctrl-C or a failed batch a
    request still in flight would hold the process until its timeout. An abandoned request ends
    with the process."""

    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel what has not started; workers stop after their current request (not waited for)."""
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)

API_KEY_ENV = "OPENAI_API_KEY"
SNIPPET_CHARS = 300
MAX_RETRY_AFTER_S = 60.0
# extra_body may add or override sampling fields, but not these: they define the protocol.
_RESERVED_BODY_KEYS = ("model", "messages", "stream")
_EXPECTED_SHAPE = (
    'a JSON object like {"choices": [{"message": {"role": "assistant", "content": "..."}, '
    '"finish_reason": "stop"}]}'
)


def _default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ChatAPIConfig:
    """Settings of a :class:`ChatAPIAgent`; every field is validated on construction.

    ``base_url`` is the part before ``/chat/completions`` (e.g. ``http://127.0.0.1:8000/v1``).
    ``api_key`` defaults to the ``OPENAI_API_KEY`` environment variable when that is set; it is
    sent as ``Authorization: Bearer <key>``. ``max_retries`` counts retries after the first
    attempt, so a request is tried at most ``1 + max_retries`` times; the k-th retry waits
    ``backoff_s * 2**(k-1)`` seconds (or the server's numeric ``Retry-After``, if longer, capped
    at 60 s). ``extra_body`` is merged into every request body (e.g. ``{"top_k": 20}`` for vLLM);
    it may not set ``model``, ``messages`` or ``stream``.
    """

    base_url: str
    model: str
    api_key: str | None = field(default_factory=_default_api_key, repr=False)
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_concurrency: int = 8
    extra_body: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)

        # base_url
        if not isinstance(self.base_url, str) or not self.base_url.strip():
            raise ConfigError(
                f"ChatAPIConfig.base_url must be a non-empty string such as "
                f"'http://127.0.0.1:8000/v1', got {self.base_url!r}",
                field="base_url",
            )
        base_url = self.base_url.strip().rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"ChatAPIConfig.base_url must start with http:// or https:// "
                f"(e.g. 'http://127.0.0.1:8000/v1'), got {self.base_url!r}",
                field="base_url",
            )
        if base_url.endswith("/chat/completions"):
            raise ConfigError(
                f"ChatAPIConfig.base_url is the part before /chat/completions "
                f"(e.g. 'http://127.0.0.1:8000/v1'), got {self.base_url!r}; drop the "
                f"'/chat/completions' suffix",
                field="base_url",
            )
        parsed = urllib.parse.urlsplit(base_url)
        if not parsed.hostname:
            raise ConfigError(
                f"ChatAPIConfig.base_url has no host name (expected e.g. "
                f"'http://127.0.0.1:8000/v1'), got {self.base_url!r}",
                field="base_url",
            )
        try:
            parsed.port  # noqa: B018 (validates the port)
        except ValueError as exc:
            raise ConfigError(
                f"ChatAPIConfig.base_url has an invalid port ({exc}), got {self.base_url!r}",
                field="base_url",
            ) from None
        if parsed.query or parsed.fragment:
            raise ConfigError(
                f"ChatAPIConfig.base_url must not contain a query string or fragment, "
                f"got {self.base_url!r}",
                field="base_url",
            )
        set_("base_url", base_url)

        # model
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(
                f"ChatAPIConfig.model must be a non-empty string (the model name the server "
                f"serves, e.g. the one passed to 'vllm serve'), got {self.model!r}",
                field="model",
            )

        # api_key
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ConfigError(
                f"ChatAPIConfig.api_key must be a string or None, got {type(self.api_key).__name__}",
                field="api_key",
            )
        if self.api_key is not None:
            key = self.api_key.strip()
            if not key.isascii() or not key.isprintable():
                raise ConfigError(
                    "ChatAPIConfig.api_key must contain only printable ASCII characters "
                    "(no line breaks)",
                    field="api_key",
                )
            set_("api_key", key or None)

        # sampling
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ConfigError(
                f"ChatAPIConfig.temperature must be a finite number >= 0 (0 is greedy), "
                f"got {self.temperature!r}",
                field="temperature",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"ChatAPIConfig.top_p must be a number in (0, 1], got {self.top_p!r}",
                field="top_p",
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(
                f"ChatAPIConfig.max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                field="max_tokens",
            )

        # stop: accept a single string or any sequence of strings; store a tuple
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(
            isinstance(s, str) and s for s in stop
        ):
            raise ConfigError(
                f"ChatAPIConfig.stop must be a tuple of non-empty strings, got {self.stop!r}",
                field="stop",
            )
        set_("stop", tuple(stop))

        # transport
        if not _is_number(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(
                f"ChatAPIConfig.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}",
                field="timeout_s",
            )
        if not _is_int(self.max_retries) or self.max_retries < 0:
            raise ConfigError(
                f"ChatAPIConfig.max_retries must be an integer >= 0 (0 disables retries), "
                f"got {self.max_retries!r}",
                field="max_retries",
            )
        if not _is_number(self.backoff_s) or self.backoff_s < 0:
            raise ConfigError(
                f"ChatAPIConfig.backoff_s must be a number of seconds >= 0, got {self.backoff_s!r}",
                field="backoff_s",
            )
        if not _is_int(self.max_concurrency) or self.max_concurrency < 1:
            raise ConfigError(
                f"ChatAPIConfig.max_concurrency must be an integer >= 1, "
                f"got {self.max_concurrency!r}",
                field="max_concurrency",
            )

        # extra_body: a JSON-serialisable dict, copied so later mutation cannot leak in
        if self.extra_body is not None:
            if not isinstance(self.extra_body, dict) or not all(
                isinstance(k, str) for k in self.extra_body
            ):
                raise ConfigError(
                    f"ChatAPIConfig.extra_body must be a dict with string keys or None, "
                    f"got {self.extra_body!r}",
                    field="extra_body",
                )
            reserved = sorted(k for k in self.extra_body if k in _RESERVED_BODY_KEYS)
            if reserved:
                raise ConfigError(
                    f"ChatAPIConfig.extra_body must not set {reserved}: the agent sets "
                    f"'model' and 'messages' itself and does not support streaming",
                    field="extra_body",
                )
            try:
                copied = json.loads(json.dumps(self.extra_body, allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"ChatAPIConfig.extra_body must be JSON-serialisable ({exc})",
                    field="extra_body",
                ) from None
            set_("extra_body", copied)

    @property
    def url(self) -> str:
        """The endpoint every request is POSTed to."""
        return f"{self.base_url}/chat/completions"


class _RetryableError(Exception):
    """A failure worth retrying (connection error, timeout, 429, 5xx)."""

    def __init__(self, what: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(what)
        self.what = what
        self.status = status
        self.retry_after = retry_after


MAX_REPLY_BYTES = 64 << 20


class _ContextFull(Exception):
    """The server refused the request because the context does not fit the model's window."""


# How OpenAI-compatible servers word "the prompt (plus max_tokens) does not fit the context":
# OpenAI's error code, OpenAI's and vLLM's "maximum context length", SGLang's "context length",
# llama.cpp's "context size", TGI's "`max_new_tokens` must be <=" (an HTTP 422).
_CONTEXT_FULL_ERROR = re.compile(r"context_length_exceeded|context[ _-]length|maximum context|context size|"
                                 r"context window|max_new_tokens` must be <=", re.IGNORECASE)


def _context_full_reason(body: bytes) -> str | None:
    """The server's words when an error body says the context does not fit, else None. Only the
    error object's own fields are read, never the rest of the body (which may echo the prompt)."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    fields = [payload.get(k) for k in ("message", "detail", "code", "type", "error_type")]
    error = payload.get("error")
    fields += [error.get(k) for k in ("message", "code", "type")] if isinstance(error, dict) else [error]
    texts = [f for f in fields if isinstance(f, str)]
    if not any(_CONTEXT_FULL_ERROR.search(text) for text in texts):
        return None
    return max(texts, key=len)[:300]


def _snippet(body: bytes | str | None) -> str:
    if body is None:
        return ""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    if len(text) > SNIPPET_CHARS:
        text = text[: SNIPPET_CHARS - 3] + "..."
    return text


def _retry_after_s(headers) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else None


class ChatAPIAgent(Agent):
    """An agent that asks an OpenAI-compatible chat-completions server for each reply.

    >>> agent = ChatAPIAgent.from_url("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-0.5B-Instruct")
    >>> replies = agent.act([context_a, context_b])   # doctest: +SKIP
    >>> agent.close()
    """

    def __init__(self, config: ChatAPIConfig):
        if not isinstance(config, ChatAPIConfig):
            raise ConfigError(
                f"ChatAPIAgent takes a ChatAPIConfig (or use ChatAPIAgent.from_url(base_url, "
                f"model, ...)), got {type(config).__name__}"
            )
        self.config = config
        self.name = f"api:{config.model}"
        self._pool: _RequestPool | None = None
        self._lock = threading.Lock()
        self._warned_context_full = False
        # Requests to a server on this machine never go through an HTTP(S)_PROXY from the
        # environment; remote servers use the standard urllib handlers (env proxies honoured).
        if is_loopback(urllib.parse.urlsplit(config.url).hostname):
            self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        else:
            self._opener = urllib.request.build_opener()

    @classmethod
    def from_url(cls, base_url: str, model: str, **kwargs: Any) -> "ChatAPIAgent":
        """``ChatAPIAgent(ChatAPIConfig(base_url=base_url, model=model, **kwargs))``."""
        allowed = [f.name for f in fields(ChatAPIConfig) if f.name not in ("base_url", "model")]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ConfigError(
                f"Unknown ChatAPIConfig field(s) {unknown}; allowed: {allowed}"
            )
        return cls(ChatAPIConfig(base_url=base_url, model=model, **kwargs))

    # -- Agent API ---------------------------------------------------------------------------

    def act(self, contexts: Sequence[Context]) -> list[AgentReply]:
        contexts = list(contexts)
        for i, context in enumerate(contexts):
            if not isinstance(context, Context):
                raise TypeError(
                    f"ChatAPIAgent.act takes a sequence of Context, item {i} is "
                    f"{type(context).__name__}"
                )
        if not contexts:
            return []
        if len(contexts) == 1:
            return [self._request(contexts[0])]
        pool = self._executor()
        abort = threading.Event()
        futures: list[Future] = [pool.submit(self._request, c, abort) for c in contexts]
        try:
            # The first request to fail is the one to report, at once: waiting in order could hide
            # a refused key behind the retries of requests that time out. The others stop retrying.
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f in done and f.exception() is not None]
            if failed:
                raise failed[0].exception()
            return [future.result() for future in futures]
        finally:
            abort.set()
            for future in futures:
                future.cancel()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    def __enter__(self) -> "ChatAPIAgent":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ChatAPIAgent(url={self.config.url!r}, model={self.config.model!r})"

    # -- internals ---------------------------------------------------------------------------

    def _executor(self) -> _RequestPool:
        with self._lock:
            if self._pool is None:
                self._pool = _RequestPool(self.config.max_concurrency, "rftgym-chat-api")
            return self._pool

    def _body(self, context: Context) -> dict:
        cfg = self.config
        body: dict[str, Any] = {
            "model": cfg.model,
            "messages": context.to_chat(),
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_tokens": cfg.max_tokens,
        }
        if cfg.stop:
            body["stop"] = list(cfg.stop)
        if cfg.extra_body:
            body.update(cfg.extra_body)
        return body

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _request(self, context: Context, abort: threading.Event | None = None) -> AgentReply:
        """One completion, retried as configured; ``abort`` (set when another request of the batch
        has failed) stops the retries, so that a failed batch does not linger."""
        cfg = self.config
        url = cfg.url
        data = json.dumps(self._body(context)).encode("utf-8")
        attempts_allowed = 1 + cfg.max_retries
        last: _RetryableError | None = None
        made = 0
        for attempt in range(1, attempts_allowed + 1):
            if attempt > 1:
                delay = cfg.backoff_s * 2 ** (attempt - 2)
                if last is not None and last.retry_after is not None:
                    delay = max(delay, last.retry_after)
                if abort is None:
                    time.sleep(delay)
                elif abort.wait(delay):
                    break  # the batch failed elsewhere: that error is the one reported
            made = attempt
            try:
                status, raw = self._post(url, data, attempt)
            except _RetryableError as exc:
                last = exc
                continue
            except _ContextFull as refusal:
                return self._context_full(context, url, str(refusal))
            return self._parse(raw, status, url)
        assert last is not None
        raise ChatAPIError(
            f"POST {url} failed after {made} attempt(s): {last.what}. "
            f"{self._hint(last.status)}",
            status=last.status,
        )

    def _post(self, url: str, data: bytes, attempt: int) -> tuple[int, bytes]:
        """One HTTP attempt: returns (status, body), raises _RetryableError or ChatAPIError."""
        request = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
        try:
            with self._opener.open(request, timeout=self.config.timeout_s) as response:
                return response.status, self._read_body(response, url)
        except urllib.error.HTTPError as exc:
            try:
                body = exc.read()
            except Exception:  # noqa: BLE001 (the body is only used in the message)
                body = b""
            finally:
                exc.close()
            status = exc.code
            what = f"HTTP {status}" + (f": {_snippet(body)}" if body else "")
            if status in (400, 413, 422) and (reason := _context_full_reason(body)) is not None:
                raise _ContextFull(reason) from None
            if status == 429 or status >= 500:
                raise _RetryableError(what, status, _retry_after_s(exc.headers)) from None
            raise ChatAPIError(
                f"POST {url} failed with {what} (attempt {attempt}; HTTP {status} is not "
                f"retried). {self._hint(status)}",
                status=status,
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                what = f"timed out after {self.config.timeout_s:g} s (timeout_s)"
            else:
                what = f"could not connect ({reason})"
            raise _RetryableError(what) from None
        except TimeoutError:
            raise _RetryableError(
                f"timed out after {self.config.timeout_s:g} s (timeout_s)"
            ) from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise _RetryableError(
                f"connection failed ({type(exc).__name__}: {exc or 'no details'})"
            ) from None

    def _context_full(self, context: Context, url: str, reason: str) -> AgentReply:
        """The server refused ``context`` for want of room: the episode ends there, unless it is
        the episode's first request, where every episode would end at once (a setting, not the
        episode's fate)."""
        if not any(m.role == "assistant" for m in context):
            raise ChatAPIError(
                f"POST {url}: the server refused an episode's first request because it does not fit the model's "
                f"context ({reason}). Lower --max-new-tokens (max_tokens={self.config.max_tokens}) or serve a model "
                "with a longer context")
        if not self._warned_context_full:
            self._warned_context_full = True
            warnings.warn(f"the server refused a context that has outgrown the model's window ({reason}); such "
                          "episodes end there as truncated, with info context_full", stacklevel=4)
        return AgentReply(text="", finish_reason=CONTEXT_FULL)

    def _read_body(self, response, url: str) -> bytes:
        """The reply's body, read within ``timeout_s`` of its headers (the socket timeout alone
        bounds each read, so a server trickling bytes could hold a request for ever) and at most
        ``MAX_REPLY_BYTES`` long (a completion is text; more is a misbehaving server)."""
        try:
            body = read_body(response, self.config.timeout_s, MAX_REPLY_BYTES)
        except BodyTooLarge:
            raise ChatAPIError(f"POST {url} sent a reply of over {MAX_REPLY_BYTES >> 20} MiB; a chat completion "
                               "is far smaller. Check that --api-base points at a chat completions server") from None
        except BodyTooSlow:
            raise _RetryableError(f"the reply's body took over {self.config.timeout_s:g} s (timeout_s) to arrive") \
                from None
        if getattr(response, "length", None):  # bytes the Content-Length promised that never came
            raise _RetryableError(f"the connection closed {response.length} bytes before the end of the reply")
        return body

    def _parse(self, raw: bytes, status: int, url: str) -> AgentReply:
        def fail(problem: str) -> ChatAPIError:
            return ChatAPIError(
                f"POST {url} returned HTTP {status} but {problem}; expected {_EXPECTED_SHAPE}. "
                f"Body: {_snippet(raw)!r}. Is base_url an OpenAI-compatible endpoint "
                f"(the part before /chat/completions, e.g. http://127.0.0.1:8000/v1)?",
                status=status,
            )

        try:
            payload = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise fail("the body is not valid JSON") from None
        except RecursionError:
            raise fail("the body's JSON is nested too deeply to read") from None
        if not isinstance(payload, dict):
            raise fail(f"the body is a JSON {type(payload).__name__}, not an object")
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            if "error" in payload:
                raise fail("the body is an error object, not a completion")
            raise fail("it has no non-empty 'choices' list")
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            raise fail("choices[0] has no 'message' object")
        content, refusal = message.get("content"), message.get("refusal")
        if content is None:
            # A refusal (OpenAI's structured field) is what the model said on this turn.
            text = refusal if isinstance(refusal, str) else ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            if not all(isinstance(part, dict) for part in content):
                raise fail("a part of choices[0].message.content is not an object")
            texts = [part.get("text") for part in content]
            if not all(t is None or isinstance(t, str) for t in texts):
                raise fail("a part of choices[0].message.content has a 'text' that is not a string")
            text = "".join(t for t in texts if t is not None)
        else:
            raise fail(f"choices[0].message.content is a {type(content).__name__}")
        finish_reason = choice.get("finish_reason")
        if not isinstance(finish_reason, str):
            finish_reason = None
        elif finish_reason == CONTEXT_FULL:  # rftgym's own marker (no room left): a server's is another thing
            finish_reason = f"server:{finish_reason}"
        return AgentReply(text=text, finish_reason=finish_reason)

    def _hint(self, status: int | None) -> str:
        cfg = self.config
        if status is None:
            return (
                f"Is the server running and reachable at {cfg.base_url}? Check --api-base "
                f"(base_url, the part before /chat/completions) and --api-timeout (timeout_s)."
            )
        if status in (401, 403):
            return f"Check the API key (api_key, or the {API_KEY_ENV} environment variable)."
        if status == 404:
            return (
                f"Check --api-base (base_url must be the part before /chat/completions, "
                f"e.g. http://127.0.0.1:8000/v1) and that the server serves model {cfg.model!r}."
            )
        if status == 429:
            return "The server is rate limiting; lower max_concurrency or raise max_retries/backoff_s."
        if status >= 500:
            return (
                f"The server at {cfg.base_url} is failing; check its logs (is model "
                f"{cfg.model!r} loaded?)."
            )
        return (
            f"The server rejected the request; check the model name ({cfg.model!r}), "
            f"max_tokens (context length) and extra_body."
        )
