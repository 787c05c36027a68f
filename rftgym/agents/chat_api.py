"""An agent backed by any OpenAI-compatible ``/v1/chat/completions`` server.

Works with vLLM (``vllm serve``), the llama.cpp server, OpenAI, and anything else that speaks
the chat-completions protocol. Only the standard library is used for HTTP.

``base_url`` is the part of the URL *before* ``/chat/completions``; for a local vLLM or llama.cpp
server that is usually ``http://127.0.0.1:8000/v1``. The agent POSTs to
``f"{base_url}/chat/completions"`` exactly (a trailing slash is stripped; nothing is appended).

The agent only sees text, so the token fields of each :class:`AgentReply` are ``None``.
A batch of contexts is sent concurrently (one request per context, at most
``max_concurrency`` in flight). Connection errors, timeouts, replies cut short, HTTP 408, 409,
429 and 5xx are retried with exponential backoff and full jitter (the first retry warns once); a
refusal because the context does not fit the model's window becomes an empty reply with finish
reason ``CONTEXT_FULL`` (the episode ends there, truncated); redirects, an exhausted quota, other
HTTP errors and malformed responses raise :class:`~rftgym.core.errors.ChatAPIError` at once.

With a ``seed`` and a temperature above 0, every request carries a per-request ``seed``: the
rollout engine's sample keys make it the same for an episode's turn whatever else shares its batch
(:mod:`rftgym.agents.sampling_keys`), for servers that honour ``seed`` (vLLM, llama.cpp; OpenAI
on a best-effort basis).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import queue
import zlib
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..core.errors import ChatAPIError, ConfigError, warn_caller
from ..core.messages import Context
from ..core.values import is_finite_real, is_int
from ..core.web import (BodyCutShort, BodyTooLarge, BodyTooSlow, Deadline, NameLookupTooSlow, build_opener,
                        error_body_time, is_loopback, open_within, read_body, read_error_body, retry_after_s)
from .base import CONTEXT_FULL, Agent, AgentReply
from .sampling_keys import UNKEYED, SampleKey, keyed_seed

__all__ = ["ChatAPIConfig", "ChatAPIAgent"]

_on_pool_thread = threading.local()  # .active is True on a _RequestPool's worker threads
RELAY_S = 0.25  # how often a caller waiting for a batch gives the warnings its workers met


class _RequestPool:
    """Worker threads for concurrent requests. They are daemon threads, unlike a
    ThreadPoolExecutor's, which the interpreter joins at exit: after Ctrl-C or a failed batch a
    request still in flight would hold the process until its timeout. An abandoned request ends
    with the process."""

    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._most, self._name = workers, name
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._queued = self._idle = 0  # jobs no worker has taken yet; workers waiting for one

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        # Workers start as they are needed, up to the cap: a high --num-envs with a few episodes
        # starts a few threads (all at once, it took seconds per thousand).
        with self._lock:
            self._jobs.put((future, fn, args))
            self._queued += 1
            if self._queued > self._idle and len(self._threads) < self._most:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                self._idle += 1  # counted now: it takes a job as soon as it runs
                thread.start()
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
        _on_pool_thread.active = True
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._idle += 1
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                result, error = None, exc
            with self._lock:  # idle again before the caller hears, so its next request finds this worker
                self._idle += 1
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

API_KEY_ENV = "OPENAI_API_KEY"
SNIPPET_CHARS = 300
MAX_BACKOFF_S = 8.0
MAX_BACKOFF_SETTING_S = 3600.0  # a longer first wait is a typo (and past time.sleep's range at 1e308)
# Worth another try besides 5xx, as in the OpenAI client: a request timeout, a conflict (a lock
# held elsewhere for now), a rate limit.
_RETRIED_STATUSES = (408, 409, 429)
_REDIRECTS = (301, 302, 303, 307, 308)
# The jitter comes from the OS, not the global generator: processes seeded alike (the same
# --sample-seed) would otherwise still retry in lockstep.
_JITTER = random.SystemRandom()
# extra_body may add or override sampling fields, but not these: they define the protocol.
_RESERVED_BODY_KEYS = ("model", "messages", "stream")
_EXPECTED_SHAPE = (
    'a JSON object like {"choices": [{"message": {"role": "assistant", "content": "..."}, '
    '"finish_reason": "stop"}]}'
)


def _default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


# The longest timeout_s: far past any generation, and within what timers and sockets take (a
# far larger one overflows them).
MAX_TIMEOUT_S = 86_400.0


# numpy's numbers pass as Python's do (core.values), and a huge int is refused, not an OverflowError.
_is_number = is_finite_real
_is_int = is_int
# The fields a request body or a timer reads: once checked, made Python numbers (json.dumps takes
# no numpy integer or float32).
_NUMERIC_FIELDS = ("temperature", "top_p", "max_tokens", "timeout_s", "max_retries", "backoff_s", "max_concurrency")


def _plain_number(value: Any) -> int | float:
    return int(value) if is_int(value) else float(value)


@dataclass(frozen=True)
class ChatAPIConfig:
    """Settings of a :class:`ChatAPIAgent`; every field is validated on construction.

    ``base_url`` is the part before ``/chat/completions`` (e.g. ``http://127.0.0.1:8000/v1``).
    ``api_key`` defaults to the ``OPENAI_API_KEY`` environment variable when that is set; it is
    sent as ``Authorization: Bearer <key>``. ``timeout_s`` bounds each attempt as a whole:
    connecting, sending the request, and the reply's headers and body, which a server trickling
    bytes cannot stretch (replies are not streamed, so the model's whole generation counts); an
    attempt that runs past it is retried. ``max_retries`` counts retries after the first
    attempt, so a request is tried at most ``1 + max_retries`` times; the k-th retry waits a
    random time up to ``backoff_s * 2**(k-1)`` seconds, at most 8 s (or ``backoff_s`` if that is
    more), and at least the server's ``Retry-After`` (seconds or an HTTP date, capped at 60 s).
    ``extra_body`` is merged into every request body (e.g. ``{"top_k": 20}`` for vLLM); it may not
    set ``model``, ``messages`` or ``stream``, and what it sets wins. ``seed``: with a temperature
    above 0, each request carries a ``seed`` derived from it (from the reply's sample key when the
    rollout engine gives one); greedy requests and ``seed=None`` carry none.
    """

    base_url: str
    model: str
    api_key: str | None = field(default_factory=_default_api_key, repr=False)
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    timeout_s: float = 60.0
    max_retries: int = 5
    backoff_s: float = 0.5
    max_concurrency: int = 8
    extra_body: dict | None = field(default=None, hash=False)
    seed: int | None = None

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
        try:
            parsed = urllib.parse.urlsplit(base_url)
        except ValueError as exc:  # e.g. an unclosed IPv6 bracket: 'http://[::1/v1'
            raise ConfigError(
                f"ChatAPIConfig.base_url is not a valid URL ({exc}), got {self.base_url!r}; "
                f"expected e.g. 'http://127.0.0.1:8000/v1' or 'http://[::1]:8000/v1'",
                field="base_url",
            ) from None
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

        if self.seed is not None:
            if not is_int(self.seed) or not 0 <= self.seed < 2**63:
                raise ConfigError(f"ChatAPIConfig.seed must be None or an integer in [0, 2**63), got {self.seed!r}",
                                  field="seed")
            set_("seed", int(self.seed))  # a numpy integer would not go into the JSON body

        # transport
        if not _is_number(self.timeout_s) or not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ConfigError(
                f"ChatAPIConfig.timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}] (a day at most), "
                f"got {self.timeout_s!r}",
                field="timeout_s",
            )
        if not _is_int(self.max_retries) or self.max_retries < 0:
            raise ConfigError(
                f"ChatAPIConfig.max_retries must be an integer >= 0 (0 disables retries), "
                f"got {self.max_retries!r}",
                field="max_retries",
            )
        if not _is_number(self.backoff_s) or not 0 <= self.backoff_s <= MAX_BACKOFF_SETTING_S:
            raise ConfigError(
                f"ChatAPIConfig.backoff_s must be a number of seconds in [0, {MAX_BACKOFF_SETTING_S:g}], "
                f"got {self.backoff_s!r}",
                field="backoff_s",
            )
        if not _is_int(self.max_concurrency) or self.max_concurrency < 1:
            raise ConfigError(
                f"ChatAPIConfig.max_concurrency must be an integer >= 1, "
                f"got {self.max_concurrency!r}",
                field="max_concurrency",
            )
        for name in _NUMERIC_FIELDS:
            set_(name, _plain_number(getattr(self, name)))

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
    """A failure worth retrying (connection error, timeout, a reply cut short, 408, 409, 429, 5xx)."""

    def __init__(self, what: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(what)
        self.what = what
        self.status = status
        self.retry_after = retry_after


MAX_REPLY_BYTES = 64 << 20
MAX_ERROR_BYTES = 64 << 10  # of an error reply's body, read for its reason
# First requests refused as too long, one at a time and none fitting, that stop the run (a batch of
# two or more all refused stops it at once).
FIRST_REFUSALS_TO_STOP = 3


class _ContextFull(Exception):
    """The server refused the request because the context does not fit the model's window."""


# How OpenAI-compatible servers word "the prompt (plus max_tokens) does not fit the context":
# OpenAI's error code, OpenAI's and vLLM's "maximum context length", SGLang's "context length",
# llama.cpp's "context size", TGI's "`max_new_tokens` must be <=" (an HTTP 422).
_CONTEXT_FULL_ERROR = re.compile(r"context_length_exceeded|context[ _-]length|maximum context|context size|"
                                 r"context window|max_new_tokens` must be <=", re.IGNORECASE)


def _error_texts(body: bytes) -> list[str]:
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


def _context_full_reason(body: bytes) -> str | None:
    """The server's words when an error body says the context does not fit, else None."""
    texts = _error_texts(body)
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would resend the POST as a GET (301-303: then an HTTP 405
    that blames the request) or give up on it (307, 308). The agent names the new address instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# How OpenSSL versions word a TLS hello answered in plain HTTP (1.1 and 3.0: wrong version
# number; 3.2 on: record layer failure; others: packet length, unknown protocol, http request).
_NOT_TLS = ("wrong_version_number", "wrong version number", "record layer failure", "packet length too long",
            "packet_length_too_long", "unknown protocol", "unknown_protocol", "http request", "http_request")


def _plain_http_answer(reason: object) -> bool:
    """Whether a TLS failure says the server answered in plain HTTP (not a certificate problem,
    which another scheme would not mend)."""
    if not isinstance(reason, ssl.SSLError) or isinstance(reason, ssl.SSLCertVerificationError):
        return False
    return any(marker in str(reason).lower() for marker in _NOT_TLS)


def _build_opener(url: str) -> urllib.request.OpenerDirector:
    handlers: list = [_NoRedirects()]
    # Requests to a server on this machine never go through an HTTP(S)_PROXY from the
    # environment; remote servers use the standard urllib handlers (env proxies honoured).
    if is_loopback(urllib.parse.urlsplit(url).hostname):
        handlers.append(urllib.request.ProxyHandler({}))
    return build_opener(*handlers)  # connections that a request's deadline can shut


class ChatAPIAgent(Agent):
    """An agent that asks an OpenAI-compatible chat-completions server for each reply.

    >>> agent = ChatAPIAgent.from_url("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-0.5B-Instruct")
    >>> replies = agent.act([context_a, context_b])   # doctest: +SKIP
    >>> agent.close()

    Copies (``copy.deepcopy``, ``pickle``) get threads and connections of their own.
    """

    keyed_sampling = True

    def __init__(self, config: ChatAPIConfig):
        if not isinstance(config, ChatAPIConfig):
            raise ConfigError(
                f"ChatAPIAgent takes a ChatAPIConfig (or use ChatAPIAgent.from_url(base_url, "
                f"model, ...)), got {type(config).__name__}"
            )
        self.config = config
        self.name = f"api:{config.model}"
        self._warned: set[str] = set()  # the kinds of warning this agent has given (each is given once)
        self._unkeyed_requests = 0  # seeded requests without a sample key so far: the next one's stream
        self._first_requests_refused = 0  # episodes' first requests refused as too long, and those that fit
        self._first_requests_fitted = 0
        self._connect()

    def _connect(self) -> None:
        """What a copy makes afresh: threads, a lock and an opener cannot be copied or pickled."""
        self._pool: _RequestPool | None = None
        self._lock = threading.Lock()
        self._opener = _build_opener(self.config.url)
        self._relayed: queue.SimpleQueue = queue.SimpleQueue()  # warnings the pool's threads met, for the caller

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_pool", "_lock", "_opener", "_relayed"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._connect()

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

    def act(self, contexts: Sequence[Context], *, sample_keys: Sequence[SampleKey] | None = None) -> list[AgentReply]:
        """One reply per context, in order. ``sample_keys`` (one per context; the rollout engine
        gives them) choose each request's ``seed`` when the config has a seed and samples."""
        if isinstance(contexts, Context):  # iterating it would give its messages
            raise TypeError("act takes a list of contexts; wrap one in a list: act([context])")
        contexts = list(contexts)
        for i, context in enumerate(contexts):
            if not isinstance(context, Context):
                raise TypeError(
                    f"ChatAPIAgent.act takes a sequence of Context, item {i} is "
                    f"{type(context).__name__}"
                )
        seeds = self._request_seeds(len(contexts), sample_keys)
        if not contexts:
            return []
        if len(contexts) == 1:
            replies = [self._request(contexts[0], seeds[0])]
        else:
            replies = self._request_all(contexts, seeds)
        self._check_first_requests(contexts, replies)
        return replies

    def _check_first_requests(self, contexts: list[Context], replies: list[AgentReply]) -> None:
        """One task too long for the served context ends its episode. Every first request refused
        (a whole batch of them, or the first few one at a time) is a setting instead, max_tokens
        past the context, which would end every episode at once: that stops the run."""
        firsts = [r for c, r in zip(contexts, replies) if not any(m.role == "assistant" for m in c)]
        refused = sum(r.finish_reason == CONTEXT_FULL for r in firsts)
        self._first_requests_refused += refused
        self._first_requests_fitted += len(firsts) - refused
        whole_batch = len(contexts) >= 2 and refused == len(contexts)
        if self._first_requests_fitted == 0 and (whole_batch or self._first_requests_refused >= FIRST_REFUSALS_TO_STOP):
            raise ChatAPIError(f"POST {self.config.url}: the server refused every one of "
                               f"{self._first_requests_refused} episodes' first requests as too long for the model's "
                               f"context; lower --max-new-tokens (max_tokens={self.config.max_tokens}) or serve a "
                               "model with a longer context")

    def _request_all(self, contexts: list[Context], seeds: list[int | None]) -> list[AgentReply]:
        """Every context's request, concurrently (at most ``max_concurrency`` in flight)."""
        pool = self._executor()
        abort = threading.Event()
        futures: list[Future] = [pool.submit(self._request, c, seed, abort) for c, seed in zip(contexts, seeds)]
        try:
            while True:
                # The first request to fail is the one to report, at once: waiting in order could hide
                # a refused key behind the retries of requests that time out. The others stop retrying.
                # The wait wakes every RELAY_S to give the warnings the workers met, as they come: a
                # retry's explains a batch that stalls while it stalls, not once it is over.
                done, running = wait(futures, timeout=RELAY_S, return_when=FIRST_EXCEPTION)
                self._relay_warnings()
                failed = [f for f in futures if f in done and f.exception() is not None]
                if failed:
                    raise failed[0].exception()
                if not running:
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

    @property
    def _sends_seed(self) -> bool:
        """A seed goes only where it means something: sampling (at the temperature the server
        sees), and no seed of extra_body's own; strict servers refuse fields they do not know."""
        extra = self.config.extra_body or {}
        temperature = extra.get("temperature", self.config.temperature)
        return self.config.seed is not None and "seed" not in extra and _is_number(temperature) and temperature > 0

    def _request_seeds(self, count: int, sample_keys: Sequence[SampleKey] | None) -> list[int | None]:
        """Each request's ``seed`` (None: none sent). A keyed request's comes from its key alone;
        unkeyed ones take the agent's next streams in order, so that repeated calls (or one
        context asked several times in a batch) sample afresh, yet the same calls replay."""
        keys = None if sample_keys is None else list(sample_keys)  # each checked where its seed is made
        if keys is not None and len(keys) != count:
            raise ValueError(f"{len(keys)} sample keys for {count} contexts; give one per context")
        if not self._sends_seed:
            return [None] * count
        if keys is not None:
            return [keyed_seed(self.config.seed, key) for key in keys]
        with self._lock:
            first, self._unkeyed_requests = self._unkeyed_requests, self._unkeyed_requests + count
        # In a domain of their own: no reply's key gives one of these seeds.
        return [keyed_seed(self.config.seed, (first + i,), UNKEYED) for i in range(count)]

    def _body(self, context: Context, seed: int | None) -> dict:
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
        if seed is not None:
            body["seed"] = seed
        if cfg.extra_body:
            body.update(cfg.extra_body)
        return body

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _warn_once(self, kind: str, message: str) -> None:
        """Warn the first time this agent meets ``kind`` (requests run on several threads), at the
        user's line that called ``act``. A worker thread's stack holds no line of the user's: what
        one meets is handed to the thread waiting for its batch, to give (``_relay_warnings``)."""
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        if getattr(_on_pool_thread, "active", False):
            self._relayed.put(message)
        else:
            warn_caller(message)

    def _relay_warnings(self) -> None:
        """Give, from the calling thread, the warnings the pool's threads have met so far (one that
        a request abandoned by a failed batch meets later comes with the next batch)."""
        while True:
            try:
                message = self._relayed.get_nowait()
            except queue.Empty:
                return
            warn_caller(message)

    def _request(self, context: Context, seed: int | None, abort: threading.Event | None = None) -> AgentReply:
        """One completion, retried as configured; ``abort`` (set when another request of the batch
        has failed) stops the retries, so that a failed batch does not linger."""
        cfg = self.config
        url = cfg.url
        data = json.dumps(self._body(context, seed)).encode("utf-8")
        attempts_allowed = 1 + cfg.max_retries
        last: _RetryableError | None = None
        made = 0
        for attempt in range(1, attempts_allowed + 1):
            if attempt > 1:
                if abort is not None and abort.is_set():
                    break  # the batch failed elsewhere: that error is the one reported
                # Retries are otherwise silent: a stalled progress bar gets its reason.
                self._warn_once("retry", f"POST {url}: attempt {made} of {attempts_allowed} failed: {last.what}; "
                                         "retrying with backoff (further retries of this agent are not reported)")
                delay = self._backoff_s(attempt - 1, last.retry_after)
                if abort is None:
                    time.sleep(delay)
                elif abort.wait(delay):
                    break
            made = attempt
            try:
                status, raw = self._post(url, data, attempt)
                return self._parse(raw, status, url)
            except _RetryableError as exc:
                last = exc
            except _ContextFull as refusal:
                return self._context_full(context, str(refusal))
        assert last is not None
        raise ChatAPIError(
            f"POST {url} failed after {made} attempt(s): {last.what}. "
            f"{self._hint(last.status)}",
            status=last.status,
        )

    def _backoff_s(self, retry: int, retry_after: float | None) -> float:
        """The wait before the ``retry``-th retry: uniform up to ``backoff_s * 2**(retry-1)``, capped
        (full jitter: requests that failed together do not retry together), and at least the
        server's ``Retry-After``."""
        backoff_s = self.config.backoff_s
        ceiling = min(backoff_s * 2.0 ** min(retry - 1, 32), max(MAX_BACKOFF_S, backoff_s))
        return max(_JITTER.uniform(0.0, ceiling), retry_after or 0.0)

    def _post(self, url: str, data: bytes, attempt: int) -> tuple[int, bytes]:
        """One HTTP attempt: returns (status, body), raises _RetryableError or ChatAPIError."""
        request = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
        deadline = Deadline(self.config.timeout_s)  # for the whole attempt: a trickle cannot hold it
        try:
            with open_within(self._opener, request, deadline) as response:
                raw = self._read_body(response, deadline, url)
                return response.status, _decoded(raw, response.headers.get("Content-Encoding"), url)
        except urllib.error.HTTPError as exc:
            body = b""
            try:  # read for its reason and the message, inflated as a reply's would be
                body = read_error_body(exc, error_body_time(deadline), MAX_ERROR_BYTES)
                body = _decoded(body, exc.headers.get("Content-Encoding") if exc.headers else None, url)
            except Exception:  # noqa: BLE001 (then the raw body, or none, serves the message)
                pass
            finally:
                exc.close()
            status = exc.code
            what = f"HTTP {status}" + (f": {_snippet(body)}" if body else "")
            if status in _REDIRECTS:
                raise self._redirected(url, status, exc.headers) from None
            if status in (400, 413, 422) and (reason := _context_full_reason(body)) is not None:
                raise _ContextFull(reason) from None
            if status == 429 and "insufficient_quota" in _error_texts(body):
                raise ChatAPIError(
                    f"POST {url} failed with {what}: the account is out of quota (insufficient_quota), which "
                    f"no retry mends. Add credit or raise the account's limit, or use another key (api_key, or "
                    f"the {API_KEY_ENV} environment variable).",
                    status=status,
                ) from None
            if status in _RETRIED_STATUSES or status >= 500:
                raise _RetryableError(what, status, retry_after_s(exc.headers)) from None
            raise ChatAPIError(
                f"POST {url} failed with {what} (attempt {attempt}; HTTP {status} is not "
                f"retried). {self._hint(status)}",
                status=status,
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                what = f"timed out after {self.config.timeout_s:g} s (timeout_s)"
            elif url.startswith("https:") and _plain_http_answer(reason):
                # TLS spoken to a plain-HTTP server: no retry mends that
                raise ChatAPIError(f"POST {url}: the server does not speak TLS ({reason}); if it serves plain "
                                   f"HTTP, use http:// in --api-base (base_url)") from None
            else:
                what = f"could not connect ({reason})"
            raise _RetryableError(what) from None
        except NameLookupTooSlow as exc:  # the resolver, not the server: the message says what to check
            raise _RetryableError(str(exc)) from None
        except TimeoutError:
            raise _RetryableError(
                f"timed out after {self.config.timeout_s:g} s (timeout_s)"
            ) from None
        except http.client.IncompleteRead:  # a chunked reply whose connection closed mid-way
            raise _RetryableError("the connection closed before the end of the reply") from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise _RetryableError(
                f"connection failed ({type(exc).__name__}: {exc or 'no details'})"
            ) from None

    def _redirected(self, url: str, status: int, headers) -> ChatAPIError:
        location = headers.get("Location") if headers is not None else None
        if not location:
            return ChatAPIError(f"POST {url} was redirected (HTTP {status}) to no address (no Location header); "
                                "check --api-base (base_url, the part before /chat/completions)", status=status)
        target = urllib.parse.urljoin(url, location)
        path = urllib.parse.urlsplit(target)._replace(query="", fragment="").geturl().rstrip("/")
        base = f" ({path.removesuffix('/chat/completions')})" if path.endswith("/chat/completions") else ""
        return ChatAPIError(
            f"POST {url} was redirected (HTTP {status}) to {target}; the agent does not follow redirects (a POST "
            f"would be resent as a GET, or to an address base_url does not name). Use that URL's base, the part "
            f"before /chat/completions{base}, as --api-base (base_url)",
            status=status,
        )

    def _context_full(self, context: Context, reason: str) -> AgentReply:
        """The server refused ``context`` for want of room: the episode ends there as truncated, as
        with a local policy. On an episode's first request it is the task with max_tokens that does
        not fit, and the warning says what to change."""
        if any(m.role == "assistant" for m in context):
            self._warn_once("context_full", f"the server refused a context that has outgrown the model's window "
                                            f"({reason}); such episodes end there as truncated, with info context_full")
        else:
            self._warn_once("first_request_too_long",
                            f"the server refused an episode's first request because it does not fit the model's "
                            f"context ({reason}); such episodes end at once as truncated, with info context_full. "
                            f"Lower --max-new-tokens (max_tokens={self.config.max_tokens}), give shorter tasks, or "
                            "serve a model with a longer context")
        return AgentReply(text="", finish_reason=CONTEXT_FULL)

    def _read_body(self, response, deadline: Deadline, url: str) -> bytes:
        """The reply's body, read by the attempt's ``deadline`` (the socket timeout alone bounds
        each read, so a server trickling bytes could hold a request for ever) and at most
        ``MAX_REPLY_BYTES`` long (a completion is text; more is a misbehaving server)."""
        try:
            return read_body(response, deadline.left(), MAX_REPLY_BYTES)
        except BodyCutShort as exc:
            raise _RetryableError(str(exc)) from None
        except BodyTooLarge:
            raise ChatAPIError(f"POST {url} sent a reply of over {MAX_REPLY_BYTES >> 20} MiB; a chat completion "
                               "is far smaller. Check that --api-base points at a chat completions server") from None
        except BodyTooSlow:
            raise _RetryableError(f"the reply took over {self.config.timeout_s:g} s (timeout_s) to arrive") from None

    def _parse(self, raw: bytes, status: int, url: str) -> AgentReply:
        def fail(problem: str) -> ChatAPIError:
            return ChatAPIError(
                f"POST {url} returned HTTP {status} but {problem}; expected {_EXPECTED_SHAPE}. "
                f"Body: {_snippet(raw)!r}. Is base_url an OpenAI-compatible endpoint "
                f"(the part before /chat/completions, e.g. http://127.0.0.1:8000/v1)?",
                status=status,
            )

        if not raw.strip():  # headers and then nothing: a connection that closed before the body
            raise _RetryableError("the reply's body is empty, as when a connection closes early")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if _cut_short(raw, exc):
                raise _RetryableError("the reply breaks off inside a character, as when a connection closes "
                                      "early") from None
            # The model's text is agent text, never an error: a stray byte is read as U+FFFD.
            self._warn_once("not_utf8", f"POST {url} sent a reply that is not valid UTF-8 ({exc.reason} at byte "
                                        f"{exc.start}); such bytes are read as U+FFFD (further ones are not reported)")
            text = raw.decode("utf-8", errors="replace")
        try:
            payload = json.loads(text)
        except ValueError as exc:
            if _cut_short(raw, exc):
                raise _RetryableError("the reply's JSON breaks off at its end, as when a connection closes early") \
                    from None
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
        if not text:
            self._explain_empty(message, finish_reason)
        return AgentReply(text=text, finish_reason=finish_reason)

    def _explain_empty(self, message: dict, finish_reason: str | None) -> None:
        """An empty reply the server sent for a reason the user can act on is recorded as it is
        (empty, with its finish reason), and said once per kind."""
        if message.get("tool_calls") or message.get("function_call"):
            self._warn_once("tool_calls", f"the server answered with tool calls and no text (finish_reason "
                                          f"{finish_reason}); rftgym envs offer no tools and read the reply's text, so "
                                          "such replies are recorded as empty. Have the model answer in text (its "
                                          "prompt, or turn off the server's tool-call parsing)")
        elif finish_reason == "content_filter":
            self._warn_once("content_filter", "the server's content filter withheld a reply (finish_reason "
                                              "content_filter); such replies are recorded as empty. Check the "
                                              "provider's content filtering, or use another model")
        elif any(isinstance(message.get(k), str) and message[k] for k in ("reasoning_content", "reasoning")):
            self._warn_once("reasoning", f"the server sent reasoning but no answer (finish_reason {finish_reason}); "
                                         "such replies are recorded as empty. A reasoning model may use up max_tokens "
                                         f"before it answers: raise --max-new-tokens (max_tokens="
                                         f"{self.config.max_tokens}), or turn off the server's reasoning parser")

    def _hint(self, status: int | None) -> str:
        cfg = self.config
        retry_more = "raise --api-max-retries (max_retries) or --api-backoff (backoff_s)"
        if status is None:
            return (
                f"Is the server running and reachable at {cfg.base_url}? Check --api-base "
                f"(base_url, the part before /chat/completions) and --api-timeout (timeout_s); for a "
                f"server that drops requests now and then, {retry_more}."
            )
        if status in (401, 403):
            return f"Check the API key (api_key, or the {API_KEY_ENV} environment variable)."
        if status == 404:
            return (
                f"Check --api-base (base_url must be the part before /chat/completions, "
                f"e.g. http://127.0.0.1:8000/v1) and that the server serves model {cfg.model!r} (--api-model)."
            )
        if status == 429:
            return f"The server is rate limiting; lower --num-envs (max_concurrency) or {retry_more}."
        if status in _RETRIED_STATUSES:
            return f"The server kept turning the request away (HTTP {status}); {retry_more}."
        if status >= 500:
            return (
                f"The server at {cfg.base_url} is failing; check its logs (is model "
                f"{cfg.model!r} loaded?), or for a server that fails now and then {retry_more}."
            )
        seed = (" and the per-request seed it does not take (--sample-seed none, seed=None)"
                if self._sends_seed else "")
        return (
            f"The server rejected the request; check --api-model (model={cfg.model!r}), "
            f"--max-new-tokens (max_tokens={cfg.max_tokens}, against the model's context), extra_body{seed}."
        )


def _decoded(raw: bytes, encoding: str | None, url: str) -> bytes:
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
            raise _RetryableError(f"the {coding} reply breaks off before its end")
        return body
    raise ChatAPIError(f"POST {url} said its reply is {coding}-compressed, but it does not inflate; turn the "
                       "server's or proxy's compression off")


def _cut_short(raw: bytes, error: ValueError) -> bool:
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
