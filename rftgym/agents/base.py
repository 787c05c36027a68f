"""The agent interface: ``contexts -> assistant texts``.

Because an rftgym observation is the whole chat context, any chat model is an agent. Agents act
on a batch of contexts at once (a local policy batches them on the accelerator; an API agent
sends them concurrently). Token-level agents also return the exact tokens fed and sampled.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..core.errors import ConfigError
from ..core.messages import Context, Message
from ..core.records import CONTEXT_FULL  # noqa: F401 (agents answer it; re-exported for them)
from ..core.values import is_finite_real, is_int


def check_decoding_bounds(config, min_temperature: float = 0.0) -> None:
    """``config``'s ``max_new_tokens``, ``temperature``, ``top_k`` and ``top_p`` are in range (a
    ConfigError naming the field otherwise): the policy's settings and the fast decoder's share them."""
    if not (is_int(config.max_new_tokens) and config.max_new_tokens >= 1):
        raise ConfigError(f"max_new_tokens must be an integer of at least 1, got {config.max_new_tokens!r}",
                          field="max_new_tokens")
    temperature = config.temperature
    if not (is_finite_real(temperature) and (temperature == 0 or temperature >= min_temperature) and temperature >= 0):
        floor = f"a finite number >= {min_temperature:g}" if min_temperature > 0 else "a positive finite number"
        raise ConfigError(f"temperature must be 0 (greedy) or {floor}, got {temperature!r}", field="temperature")
    if not (is_finite_real(config.top_p) and 0 < config.top_p <= 1):
        raise ConfigError(f"top_p must be a number in (0, 1], got {config.top_p!r}", field="top_p")
    if not (is_int(config.top_k) and config.top_k >= 0):
        raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {config.top_k!r}", field="top_k")


def refuse_empty_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """A ValueError naming the first empty prompt: the model needs a token to condition the first
    sampled one on (a context's prompt ends with the chat template's generation prompt)."""
    empty = [i for i, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} of {len(prompts)} is empty (no token ids); the model needs at least one "
                         "token to condition on: give chat.prompt_ids(context), which ends with the chat template's "
                         "generation prompt, or start the prompt with the tokenizer's bos token")


@dataclass
class AgentReply:
    """One assistant turn. Token fields are None for agents that only see text (APIs, scripts)."""

    text: str
    prompt_ids: list[int] | None = None
    sampled_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop" (end of turn), "length" (token budget), CONTEXT_FULL, ...


def replies_with_room(replies: Sequence[AgentReply], what: str) -> Sequence[AgentReply]:
    """``replies``, for callers outside an episode (a scorer, a test proposer): there a reply the
    agent had no room for is not an episode's end but a prompt too long for the model, an error."""
    for reply in replies:
        if reply.finish_reason == CONTEXT_FULL:
            raise ConfigError(f"{what}: the prompt does not fit the agent's context (it answered {CONTEXT_FULL}); "
                              "use a model with a longer context or ask for fewer new tokens")
    return replies


class Agent(ABC):
    """Base class for agents. Subclasses implement :meth:`act`.

    Token-level agents (``token_level = True``, e.g. :class:`~rftgym.agents.hf_policy.HFPolicy`)
    also take ``sampled_spans``: for each context, the exact token spans of that episode's earlier
    sampled assistant messages, by message id, which the rollout engine keeps per episode from
    :meth:`assistant_span`.

    Agents that sample with a seed may set ``keyed_sampling = True``: the rollout engine then
    also passes ``sample_keys=`` to :meth:`act` / :meth:`act_tokens`, one key per context naming
    its episode and turn (:mod:`rftgym.agents.sampling_keys`), so that each reply can draw from a
    stream of its own and an episode samples the same whatever else shares its batch. A subclass
    of such an agent that overrides ``act`` without a ``sample_keys`` parameter is not keyed.
    """

    name: str = "agent"
    token_level: bool = False
    keyed_sampling: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        method = _keyed_method(cls)
        if cls.keyed_sampling is not True or getattr(method, "__isabstractmethod__", False) or _takes_sample_keys(cls):
            return  # (an abstract act is its subclasses' to write, and checked in them)
        if "keyed_sampling" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} sets keyed_sampling = True, but its {method.__name__}() "
                            "has no sample_keys parameter; add `sample_keys=None` to it or leave keyed_sampling False")
        # A subclass of a keyed agent that overrides act() without keys (e.g. to script some turns)
        # samples in its own way: the engine must not pass it keys it cannot take.
        cls.keyed_sampling = False

    @abstractmethod
    def act(self, contexts: Sequence[Context]) -> list[AgentReply]:
        """Return one reply per context, in order."""

    def act_tokens(self, contexts: Sequence[Context], sampled_spans: Sequence[Mapping[str, Sequence[int]]],
                   **keyed) -> list[AgentReply]:
        """:meth:`act` with each episode's exact assistant spans; text agents ignore them (``keyed``:
        ``sample_keys=`` for an agent with keyed sampling, passed on to :meth:`act`)."""
        return self.act(contexts, **keyed)

    def assistant_span(self, message: Message, reply: AgentReply) -> tuple[int, ...] | None:
        """The exact token span of ``message`` (made from ``reply``) in later prompts, or None."""
        return None

    def act_one(self, context: Context) -> AgentReply:
        return self.act([context])[0]

    def on_assistant_message(self, message: Message, reply: AgentReply) -> None:
        """Called by the rollout engine once the env has put ``reply`` into the context as
        ``message``. The env may have changed the text (e.g. cut it to a length limit): sampled
        tokens stand for the message only when ``message.content == reply.text`` (the engine binds
        exact spans under that rule, through :meth:`assistant_span`)."""

    def close(self) -> None:
        """Free resources (threads, connections, models)."""


def _keyed_method(cls: type) -> object:
    """The method the rollout engine calls with ``sample_keys=``: ``act_tokens`` for a token-level
    agent that overrides it (the base one passes the keys on to ``act``), else ``act``."""
    if cls.token_level and cls.act_tokens is not Agent.act_tokens:
        return cls.act_tokens
    return cls.act


def why_not_keyed(cls: type) -> str:
    """Why ``cls`` is not keyed although a base of it is (": it subclasses ..."), as
    ``__init_subclass__`` decided it; "" for an agent that never was keyed."""
    keyed_base = next((base for base in cls.__mro__[1:] if getattr(base, "keyed_sampling", False) is True), None)
    if keyed_base is None or _takes_sample_keys(cls):
        return ""
    return (f": it subclasses the keyed {keyed_base.__name__}, and its {_keyed_method(cls).__name__}() has no "
            "sample_keys parameter")


def _takes_sample_keys(cls: type) -> bool:
    parameters = inspect.signature(_keyed_method(cls)).parameters.values()
    return any(p.name == "sample_keys" or p.kind is p.VAR_KEYWORD for p in parameters)
