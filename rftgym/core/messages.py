"""Chat messages and contexts: the observation every rftgym environment returns.

A :class:`Context` is the whole chat the model must condition on. It is immutable: an
environment makes a new context for every observation (appending, or, in the memory
environment, deleting and replacing messages). Every message has an ``id`` that is unique
within its episode and deterministic under the env's seed; the policy's token cache is keyed
by it, so assistant messages keep the exact tokens that were sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from .errors import DataFormatError

ROLES = ("system", "user", "assistant", "tool")
# What the dict forms are (to_dict, to_list), as a refusal of another says.
MESSAGE_SHAPE = 'a message is a {"role", "content", "id"} object'
CONTEXT_SHAPE = 'a JSON context is a list of {"role", "content", "id"} objects, one per message'


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message. ``id`` is unique within an episode."""

    role: str
    content: str
    id: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"Message content must be str, got {type(self.content).__name__}")
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("Message id must be a non-empty string")

    def to_dict(self) -> dict:
        return {"role": self.role, "content": self.content, "id": self.id}

    @classmethod
    def from_dict(cls, data: dict) -> "Message":
        """The message :meth:`to_dict` made; another value is refused with a DataFormatError naming
        the field and what it is."""
        return checked_message(data, "message", MESSAGE_SHAPE)


@dataclass(frozen=True, slots=True)
class Context:
    """An immutable sequence of messages with unique ids."""

    messages: tuple[Message, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        seen: set[str] = set()
        for message in self.messages:
            if not isinstance(message, Message):
                raise TypeError(f"Context holds Message objects, got {type(message).__name__}")
            if message.id in seen:
                raise ValueError(f"Duplicate message id {message.id!r} in context")
            seen.add(message.id)

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Context(self.messages[index])
        return self.messages[index]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.messages)

    def appended(self, *messages: Message) -> "Context":
        return Context(self.messages + tuple(messages))

    def without(self, ids: Iterable[str]) -> "Context":
        drop = set(ids)
        return Context(tuple(m for m in self.messages if m.id not in drop))

    def is_prefix_of(self, other: "Context") -> bool:
        n = len(self.messages)
        return other.messages[:n] == self.messages

    def to_chat(self) -> list[dict[str, str]]:
        """The OpenAI/Hugging Face chat format (role and content only)."""
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def to_list(self) -> list[dict]:
        return [m.to_dict() for m in self.messages]

    @classmethod
    def from_list(cls, items: Sequence[dict]) -> "Context":
        """The context :meth:`to_list` made; another value is refused with a DataFormatError naming
        the message (``context[i]``) and the field."""
        if not isinstance(items, (list, tuple)):
            raise DataFormatError(f"the context is {shown(items)}; {CONTEXT_SHAPE}")
        messages = tuple(checked_message(item, f"context[{i}]", CONTEXT_SHAPE) for i, item in enumerate(items))
        seen: set[str] = set()
        for i, message in enumerate(messages):
            if message.id in seen:
                raise DataFormatError(f"context[{i}].id {message.id!r} is the id of an earlier message too; message "
                                      "ids are unique in a context")
            seen.add(message.id)
        return cls(messages)


def shown(value: Any) -> str:
    """A value as an error message shows it: the start of its text, and its type."""
    text = repr(value)
    return f"{text[:60] + '...' if len(text) > 60 else text} ({type(value).__name__})"


def checked_message(data: Any, where: str, shape: str) -> Message:
    """The message of ``data``, a {role, content, id} dict, or a DataFormatError saying which
    field of ``where`` is wrong and what it must be (``shape``: what the whole is)."""
    if not isinstance(data, dict):
        raise DataFormatError(f"{where} is {shown(data)}; {shape}")
    missing = [key for key in ("role", "content", "id") if key not in data]
    if missing:
        raise DataFormatError(f"{where} has no {missing[0]!r}; {shape}")
    role, content, message_id = data["role"], data["content"], data["id"]
    if role not in ROLES:  # (a role of another type is in none of them either)
        raise DataFormatError(f"{where}.role is {shown(role)}; it is one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise DataFormatError(f"{where}.content is {shown(content)}; it is a string")
    if not isinstance(message_id, str) or not message_id:
        raise DataFormatError(f"{where}.id is {shown(message_id)}; it is a non-empty string")
    return Message(role, content, message_id)


class MessageIds:
    """Makes message ids for one episode: ``<episode tag>-<counter>``.

    The tag is drawn from the env's ``np_random`` at reset, so ids are deterministic under the
    seed, unique within the episode (the counter never goes back, even after deletions), and
    distinct across episodes with different seeds.
    """

    def __init__(self, tag: str):
        self.tag = tag
        self._next = 0

    @classmethod
    def from_rng(cls, np_random) -> "MessageIds":
        return cls(f"{int(np_random.integers(0, 2**32)):08x}")

    def new(self) -> str:
        message_id = f"{self.tag}-{self._next}"
        self._next += 1
        return message_id

    def message(self, role: str, content: str) -> Message:
        return Message(role=role, content=content, id=self.new())
