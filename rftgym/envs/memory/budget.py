"""Counting a context's tokens for the context budget.

The env measures every context with ``count_tokens(context) -> int``. Give it the policy's own
count (:func:`policy_token_counter`; ``rftgym eval`` and ``rftgym train`` do so for a local model)
to budget (nearly exactly) what the model is fed, less the env's own status messages, which the
budget leaves out; without one the env uses :func:`estimate_tokens`, a tokenizer-free estimate documented here so budgets are
reproducible: each message costs ``MESSAGE_OVERHEAD`` tokens of chat template plus one token per
``CHARS_PER_TOKEN`` characters of content, rounded up.
"""

from __future__ import annotations

import math
from typing import Callable

from ...core.messages import Context

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD = 4

TokenCounter = Callable[[Context], int]


def estimate_tokens(context: Context) -> int:
    """``sum(MESSAGE_OVERHEAD + ceil(len(content) / CHARS_PER_TOKEN))`` over the messages."""
    return sum(MESSAGE_OVERHEAD + math.ceil(len(m.content) / CHARS_PER_TOKEN) for m in context)


def policy_token_counter(policy) -> TokenCounter:
    """The prompt length a token-level policy (anything with ``chat.prompt_ids``, e.g.
    :class:`~rftgym.agents.hf_policy.HFPolicy`) feeds for a context, generation prompt included.

    Every message is counted with the policy's own template and tokenizer. Sampled assistant
    turns are counted by their text: their exact sampled spans live with the rollout engine's
    episode, which the env does not see, so a turn the model spelled with a non-canonical
    tokenization (or cut at the token budget) may count a few tokens off.
    """
    chat = getattr(policy, "chat", None)
    if chat is None or not hasattr(chat, "prompt_ids"):
        raise TypeError(f"{type(policy).__name__} has no chat tokenizer (.chat.prompt_ids); "
                        "pass a function context -> int instead")
    return PromptLength(chat)


class PromptLength:
    """A token counter over a chat tokenizer: a class, not a closure, so that an env holding one
    can still be pickled (to another process of a vector env)."""

    def __init__(self, chat):
        self.chat = chat

    def __call__(self, context) -> int:
        return len(self.chat.prompt_ids(context))
