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
import queue
import random
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import fields
from typing import Any, Sequence

from ..core.errors import ChatAPIError, ConfigError, warn_caller
from ..core.messages import Context
from ..core.values import a_type, is_finite_real
from ..core.web import (BodyCutShort, BodyTooLarge, BodyTooSlow, Deadline, NameLookupTooSlow, error_body_time,
                        open_within, plain_http_answer, read_body, read_error_body, retry_after_s)
from .base import CONTEXT_FULL, Agent, AgentReply
from .chat_api_config import API_KEY_ENV, ChatAPIConfig
from .chat_api_http import (MAX_ERROR_BYTES, MAX_REPLY_BYTES, ContextFull, RetryableError, chat_opener,
                            context_full_reason, cut_short, decoded, error_texts, snippet)
from .request_pool import RequestPool, on_pool_thread
from .sampling_keys import UNKEYED, SampleKey, keyed_seed

__all__ = ["ChatAPIConfig", "ChatAPIAgent"]

RELAY_S = 0.25  # how often a caller waiting for a batch gives the warnings its workers met

MAX_BACKOFF_S = 8.0
# Worth another try besides 5xx, as in the OpenAI client: a request timeout, a conflict (a lock
# held elsewhere for now), a rate limit.
_RETRIED_STATUSES = (408, 409, 429)
_REDIRECTS = (301, 302, 303, 307, 308)
# The jitter comes from the OS, not the global generator: processes seeded alike (the same
# --sample-seed) would otherwise still retry in lockstep.
_JITTER = random.SystemRandom()
_EXPECTED_SHAPE = (
    'a JSON object like {"choices": [{"message": {"role": "assistant", "content": "..."}, '
    '"finish_reason": "stop"}]}'
)
# First requests refused as too long, one at a time and none fitting, that stop the run (a batch of
# two or more all refused stops it at once).
FIRST_REFUSALS_TO_STOP = 3


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
        self._pool: RequestPool | None = None
        self._lock = threading.Lock()
        self._opener = chat_opener(self.config.url)
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

    def _executor(self) -> RequestPool:
        with self._lock:
            if self._pool is None:
                self._pool = RequestPool(self.config.max_concurrency, "rftgym-chat-api")
            return self._pool

    @property
    def _sends_seed(self) -> bool:
        """A seed goes only where it means something: sampling (at the temperature the server
        sees), and no seed of extra_body's own; strict servers refuse fields they do not know."""
        extra = self.config.extra_body or {}
        temperature = extra.get("temperature", self.config.temperature)
        return self.config.seed is not None and "seed" not in extra and is_finite_real(temperature) and temperature > 0

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
        if on_pool_thread():
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
        last: RetryableError | None = None
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
                status, raw, delimited = self._post(url, data, attempt)
                return self._parse(raw, status, url, delimited)
            except RetryableError as exc:
                last = exc
            except ContextFull as refusal:
                return self._context_full(context, str(refusal))
        assert last is not None
        raise ChatAPIError(
            f"POST {url} failed after {made} attempt(s): {last.what}. "
            f"{self._hint(last.status, broke_off=last.broke_off, timed_out=last.timed_out)}",
            status=last.status,
        )

    def _backoff_s(self, retry: int, retry_after: float | None) -> float:
        """The wait before the ``retry``-th retry: uniform up to ``backoff_s * 2**(retry-1)``, capped
        (full jitter: requests that failed together do not retry together), and at least the
        server's ``Retry-After``."""
        backoff_s = self.config.backoff_s
        ceiling = min(backoff_s * 2.0 ** min(retry - 1, 32), max(MAX_BACKOFF_S, backoff_s))
        return max(_JITTER.uniform(0.0, ceiling), retry_after or 0.0)

    def _post(self, url: str, data: bytes, attempt: int) -> tuple[int, bytes, bool]:
        """One HTTP attempt: returns (status, body, whether the reply said where its body ends: a
        Content-Length or chunks, which http.client holds it to), raises RetryableError or
        ChatAPIError."""
        request = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
        deadline = Deadline(self.config.timeout_s)  # for the whole attempt: a trickle cannot hold it
        try:
            with open_within(self._opener, request, deadline) as response:
                raw = self._read_body(response, deadline, url)
                delimited = bool(getattr(response, "chunked", False)) or "Content-Length" in response.headers
                return response.status, decoded(raw, response.headers.get("Content-Encoding"), url), delimited
        except urllib.error.HTTPError as exc:
            body = b""
            try:  # read for its reason and the message, inflated as a reply's would be
                body = read_error_body(exc, error_body_time(deadline), MAX_ERROR_BYTES)
                body = decoded(body, exc.headers.get("Content-Encoding") if exc.headers else None, url)
            except Exception:  # noqa: BLE001 (then the raw body, or none, serves the message)
                pass
            finally:
                exc.close()
            status = exc.code
            what = f"HTTP {status}" + (f": {snippet(body)}" if body else "")
            if status in _REDIRECTS:
                raise self._redirected(url, status, exc.headers) from None
            if status in (400, 413, 422) and (reason := context_full_reason(body)) is not None:
                raise ContextFull(reason) from None
            if status == 429 and "insufficient_quota" in error_texts(body):
                raise ChatAPIError(
                    f"POST {url} failed with {what}: the account is out of quota (insufficient_quota), which "
                    f"no retry mends. Add credit or raise the account's limit, or use another key (api_key, or "
                    f"the {API_KEY_ENV} environment variable).",
                    status=status,
                ) from None
            if status in _RETRIED_STATUSES or status >= 500:
                raise RetryableError(what, status, retry_after_s(exc.headers)) from None
            raise ChatAPIError(
                f"POST {url} failed with {what} (attempt {attempt}; HTTP {status} is not "
                f"retried). {self._hint(status)}",
                status=status,
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                raise RetryableError(f"timed out after {self.config.timeout_s:g} s (timeout_s)", timed_out=True) \
                    from None
            elif url.startswith("https:") and plain_http_answer(reason):
                # TLS spoken to a plain-HTTP server: no retry mends that
                raise ChatAPIError(f"POST {url}: the server does not speak TLS ({reason}); if it serves plain "
                                   f"HTTP, use http:// in --api-base (base_url)") from None
            elif isinstance(reason, ssl.SSLCertVerificationError):  # no retry mends a certificate
                raise ChatAPIError(f"POST {url}: the server's TLS certificate is not trusted ({reason.verify_message}"
                                   "); if it is your own server's (self-signed, or from a private CA), name the CA's "
                                   "certificate file in the SSL_CERT_FILE environment variable") from None
            else:
                what = f"could not connect ({reason})"
            raise RetryableError(what) from None
        except NameLookupTooSlow as exc:  # the resolver, not the server: the message says what to check
            raise RetryableError(str(exc)) from None
        except TimeoutError:
            raise RetryableError(f"timed out after {self.config.timeout_s:g} s (timeout_s)", timed_out=True) from None
        except http.client.IncompleteRead:  # a chunked reply whose connection closed mid-way
            raise RetryableError("the connection closed before the end of the reply", broke_off=True) from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise RetryableError(
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
            raise RetryableError(str(exc), broke_off=True) from None
        except BodyTooLarge:
            raise ChatAPIError(f"POST {url} sent a reply of over {MAX_REPLY_BYTES >> 20} MiB; a chat completion "
                               "is far smaller. Check that --api-base points at a chat completions server") from None
        except BodyTooSlow:
            raise RetryableError(f"the reply took over {self.config.timeout_s:g} s (timeout_s) to arrive",
                                 timed_out=True) from None

    def _parse(self, raw: bytes, status: int, url: str, delimited: bool = False) -> AgentReply:
        """The reply in ``raw``. ``delimited``: its whole body arrived as the reply announced it
        (a Content-Length, or chunks), so a body that breaks off is the server's, not a connection
        that closed early, and is not retried."""
        def fail(problem: str) -> ChatAPIError:
            return ChatAPIError(
                f"POST {url} returned HTTP {status} but {problem}; expected {_EXPECTED_SHAPE}. "
                f"Body: {snippet(raw)!r}. Is base_url an OpenAI-compatible endpoint "
                f"(the part before /chat/completions, e.g. http://127.0.0.1:8000/v1)?",
                status=status,
            )

        if not raw.strip():  # headers and then nothing: a connection that closed before the body
            raise RetryableError("the reply's body is empty, as when a connection closes early", broke_off=True)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if not delimited and cut_short(raw, exc):
                raise RetryableError("the reply breaks off inside a character, as when a connection closes "
                                      "early", broke_off=True) from None
            # The model's text is agent text, never an error: a stray byte is read as U+FFFD.
            self._warn_once("not_utf8", f"POST {url} sent a reply that is not valid UTF-8 ({exc.reason} at byte "
                                        f"{exc.start}); such bytes are read as U+FFFD (further ones are not reported)")
            text = raw.decode("utf-8", errors="replace")
        try:
            payload = json.loads(text)
        except ValueError as exc:
            if not delimited and cut_short(raw, exc):
                raise RetryableError("the reply's JSON breaks off at its end, as when a connection closes early",
                                     broke_off=True) from None
            if text.lstrip().startswith(("data:", "event:")):
                raise ChatAPIError(f"POST {url} answered with an event stream (server-sent 'data:' lines), not one "
                                   "JSON reply: the server streams although the request did not ask it to. Turn "
                                   "streaming off on the server (or in a proxy before it)", status=status) from None
            raise fail("the body is not valid JSON") from None
        except RecursionError:
            raise fail("the body's JSON is nested too deeply to read") from None
        if not isinstance(payload, dict):
            raise fail(f"the body is a JSON {type(payload).__name__}, not an object")
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            if "error" in payload:  # a failure the server reports with HTTP 200 (e.g. out of GPU memory)
                if (reason := context_full_reason(raw)) is not None:
                    raise ContextFull(reason)
                said = "; ".join(error_texts(raw)) or snippet(raw)
                raise RetryableError(f"HTTP {status} with an error instead of a completion: {said[:300]}",
                                     status=status)
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
            raise fail(f"choices[0].message.content is {a_type(content)}")
        finish_reason = choice.get("finish_reason")
        if not isinstance(finish_reason, str):
            finish_reason = None
        elif finish_reason == CONTEXT_FULL:  # rftgym's own marker (no room left): a server's is another thing
            finish_reason = f"server:{finish_reason}"
        # A stop string is left out of the reply; put back the one the server says it matched
        # (vLLM's stop_reason, SGLang's matched_stop), so that a tag it closes stays closed.
        # (Not where the server kept it, as vLLM's include_stop_str_in_output does, nor on no text.)
        matched = choice.get("stop_reason") or choice.get("matched_stop")
        if finish_reason == "stop" and isinstance(matched, str) and matched in self._stop_strings() \
                and text and not text.endswith(matched):
            text += matched
        if not text:
            self._explain_empty(message, finish_reason)
        return AgentReply(text=text, finish_reason=finish_reason)

    def _stop_strings(self) -> tuple[str, ...]:
        """The stop strings the requests name (``stop``, or ``extra_body``'s)."""
        extra = (self.config.extra_body or {}).get("stop")
        if isinstance(extra, str):
            return (*self.config.stop, extra)
        if isinstance(extra, list):
            return (*self.config.stop, *extra)
        return self.config.stop

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

    def _hint(self, status: int | None, broke_off: bool = False, timed_out: bool = False) -> str:
        cfg = self.config
        retry_more = "raise --api-max-retries (max_retries) or --api-backoff (backoff_s)"
        if status is None and timed_out:
            return (
                f"The time a request waits in the server's queue counts too: a server that answers few requests "
                f"at once (llama.cpp with one slot, a CPU server) is sent up to {cfg.max_concurrency} at a time; lower "
                f"--num-envs (max_concurrency), or raise --api-timeout (timeout_s). If nothing answers at all, "
                f"check that the server runs at {cfg.base_url} (--api-base)."
            )
        if status is None and broke_off:
            return (
                f"The server at {cfg.base_url} answers, but its replies broke off before their end; check its "
                f"logs, and any proxy before it, for a limit on a reply's size or time; for a server that does "
                f"so now and then, {retry_more}."
            )
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
        if status >= 500 or status == 200:  # (200: a failure the server sent as a reply)
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
