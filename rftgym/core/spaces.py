"""Gymnasium spaces for chat contexts (observations) and assistant turns (actions)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from gymnasium import spaces

from .errors import DataFormatError
from .messages import ROLES, Context, Message

# Fragments that random samples mix in, so that `sample()` exercises the tag parser and the
# format-error paths of every env, not only plain prose.
_TAG_FRAGMENTS = (
    "<answer>", "</answer>", "<search>", "</search>", "<evaluate>", "</evaluate>",
    "<think>", "</think>", '<prune ids="', '">', "</prune>", "```python\n", "```", "< ANSWER >",
    "</ Answer>", "<answer/>", "<>", "<<", ">>", "\n", " ", "42", "-3.5", "(B)", "\u00e9", "\u4e2d",
)
_PRINTABLE = np.array(list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?-+*/=()'\"\n"))


def random_text(rng: np.random.Generator, max_chars: int) -> str:
    """Random text mixing plain characters and protocol tag fragments, at most ``max_chars`` long."""
    pieces: list[str] = []
    length = 0
    target = int(rng.integers(0, max(1, max_chars) + 1))
    while length < target:
        if rng.random() < 0.3:
            piece = _TAG_FRAGMENTS[int(rng.integers(len(_TAG_FRAGMENTS)))]
        else:
            piece = "".join(rng.choice(_PRINTABLE, size=int(rng.integers(1, 12))))
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)[:max_chars]


class AssistantText(spaces.Space[str]):
    """Action space: the text of one assistant turn (any unicode string up to ``max_chars``)."""

    def __init__(self, max_chars: int = 32_000, seed: int | np.random.Generator | None = None):
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_chars

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is not None or probability is not None:
            raise NotImplementedError("AssistantText.sample does not support masks")
        return random_text(self.np_random, min(self.max_chars, 200))

    def __repr__(self) -> str:
        return f"AssistantText(max_chars={self.max_chars})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, AssistantText) and other.max_chars == self.max_chars


class ContextSpace(spaces.Space[Context]):
    """Observation space: an immutable chat context.

    ``contains`` checks the structure (a :class:`Context` of valid messages, unique ids, allowed
    roles, size limits). ``sample`` draws random valid contexts with the space's own RNG.
    """

    def __init__(
        self,
        max_messages: int = 512,
        max_message_chars: int = 200_000,
        roles: Sequence[str] = ROLES,
        seed: int | np.random.Generator | None = None,
    ):
        unknown = set(roles) - set(ROLES)
        if not roles:
            raise ValueError(f"ContextSpace needs at least one role; allowed roles are {ROLES}")
        if unknown:
            raise ValueError(f"Unknown roles {sorted(unknown)}; allowed roles are {ROLES}")
        if max_messages <= 0 or max_message_chars <= 0:
            raise ValueError("max_messages and max_message_chars must be positive")
        self.max_messages = max_messages
        self.max_message_chars = max_message_chars
        self.roles = tuple(roles)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if not isinstance(x, Context) or len(x) > self.max_messages:
            return False
        # Context's own constructor already enforces Message types and unique ids.
        return all(
            m.role in self.roles and len(m.content) <= self.max_message_chars for m in x.messages
        )

    def sample(self, mask: Any = None, probability: Any = None) -> Context:
        if mask is not None or probability is not None:
            raise NotImplementedError("ContextSpace.sample does not support masks")
        rng = self.np_random
        n = int(rng.integers(1, min(self.max_messages, 8) + 1))
        messages = []
        for i in range(n):
            if i == 0 and "system" in self.roles and rng.random() < 0.5:
                role = "system"
            else:
                role = self.roles[int(rng.integers(len(self.roles)))]
            text = random_text(rng, min(self.max_message_chars, 120))
            messages.append(Message(role=role, content=text, id=f"sample-{i}"))
        return Context(tuple(messages))

    def to_jsonable(self, sample_n: Sequence[Context]) -> list[list[dict[str, str]]]:
        """Each context as a list of ``{"role", "content", "id"}`` dicts (what ``json.dumps`` takes)."""
        if isinstance(sample_n, Context):  # iterating it would give its messages
            raise TypeError("to_jsonable takes a sequence of contexts (Gymnasium's sample_n); wrap one in a list: "
                            "to_jsonable([context])")
        return [context.to_list() for context in sample_n]

    def from_jsonable(self, sample_n: Sequence[Sequence[dict[str, str]]]) -> list[Context]:
        """The contexts that :meth:`to_jsonable` wrote, equal to the originals."""
        contexts = []
        try:
            for items in sample_n:
                context = Context.from_list(items)
                self._check_read(context)
                contexts.append(context)
        except DataFormatError as exc:  # it names the message and field; say which context too
            raise DataFormatError(f"sample_n[{len(contexts)}]: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise ValueError("a JSON context is a list of {\"role\", \"content\", \"id\"} objects, one per "
                             f"message, as to_jsonable writes it; got {str(sample_n)[:200]}") from exc
        return contexts

    def _check_read(self, context: Context) -> None:
        """A context read from JSON that this space does not contain says why (what contains() checks)."""
        if len(context) > self.max_messages:
            raise DataFormatError(f"the context has {len(context)} messages; this space holds at most "
                                  f"{self.max_messages}")
        for index, message in enumerate(context.messages):
            if message.role not in self.roles:  # a role of rftgym's that this space does not hold
                raise DataFormatError(f"context[{index}].role is {message.role!r}; this space's roles are "
                                      f"{', '.join(self.roles)}")
            if len(message.content) > self.max_message_chars:
                raise DataFormatError(f"context[{index}].content has {len(message.content):,} characters; this space "
                                      f"holds at most {self.max_message_chars:,} per message")

    def __repr__(self) -> str:
        return f"ContextSpace(max_messages={self.max_messages}, roles={self.roles})"

    def __eq__(self, other: Any) -> bool:
        return (
            isinstance(other, ContextSpace)
            and other.max_messages == self.max_messages
            and other.max_message_chars == self.max_message_chars
            and other.roles == self.roles
        )
