"""The settings of a :class:`~rftgym.agents.chat_api.ChatAPIAgent`, each checked on construction."""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import ConfigError
from ..core.values import is_finite_real, is_int
from .stop_strings import checked_stop_strings

__all__ = ["ChatAPIConfig", "API_KEY_ENV"]

API_KEY_ENV = "OPENAI_API_KEY"
MAX_BACKOFF_SETTING_S = 3600.0  # a longer first wait is a typo (and past time.sleep's range at 1e308)
# extra_body may add or override sampling fields, but not these: they define the protocol.
_RESERVED_BODY_KEYS = ("model", "messages", "stream")


def _default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


# The longest timeout_s: far past any generation, and within what timers and sockets take (a
# far larger one overflows them).
MAX_TIMEOUT_S = 86_400.0


# The fields a request body or a timer reads: once checked, made Python numbers (json.dumps takes
# no numpy integer or float32).
_NUMERIC_FIELDS = ("temperature", "top_p", "max_tokens", "timeout_s", "max_retries", "backoff_s", "max_concurrency")


def _plain_number(value: Any) -> int | float:
    return int(value) if is_int(value) else float(value)


@dataclass(frozen=True)
class ChatAPIConfig:
    """Settings of a :class:`~rftgym.agents.chat_api.ChatAPIAgent`; every field is validated on construction.

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
        # numpy's numbers pass as Python's do (core.values), and a huge int is refused, not an OverflowError.
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
                    f"ChatAPIConfig.api_key (on the command line, the {API_KEY_ENV} environment variable) must "
                    "contain only printable ASCII characters (no tab or line break: check how it was pasted)",
                    field="api_key",
                )
            set_("api_key", key or None)

        # sampling
        self._check_numbers(
            ("temperature", lambda v: is_finite_real(v) and v >= 0, "a finite number >= 0 (0 is greedy)"),
            ("top_p", lambda v: is_finite_real(v) and 0 < v <= 1, "a number in (0, 1]"),
            ("max_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
        )

        set_("stop", checked_stop_strings(self.stop))  # one string, or None, accepted

        if self.seed is not None:
            if not is_int(self.seed) or not 0 <= self.seed < 2**63:
                raise ConfigError(f"ChatAPIConfig.seed must be None or an integer in [0, 2**63), got {self.seed!r}",
                                  field="seed")
            set_("seed", int(self.seed))  # a numpy integer would not go into the JSON body

        # transport
        self._check_numbers(
            ("timeout_s", lambda v: is_finite_real(v) and 0 < v <= MAX_TIMEOUT_S,
             f"a number of seconds in (0, {MAX_TIMEOUT_S:g}] (a day at most)"),
            ("max_retries", lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 disables retries)"),
            ("backoff_s", lambda v: is_finite_real(v) and 0 <= v <= MAX_BACKOFF_SETTING_S,
             f"a number of seconds in [0, {MAX_BACKOFF_SETTING_S:g}]"),
            ("max_concurrency", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
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

    def _check_numbers(self, *checks) -> None:
        """``(field, valid, what it must be)`` each: the first field whose value is not valid is refused."""
        for name, valid, allowed in checks:
            value = getattr(self, name)
            if not valid(value):
                raise ConfigError(f"ChatAPIConfig.{name} must be {allowed}, got {value!r}", field=name)

    @property
    def url(self) -> str:
        """The endpoint every request is POSTed to."""
        return f"{self.base_url}/chat/completions"
