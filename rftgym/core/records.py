"""Episode records: what the rollout engine hands to trainers and writes as JSONL.

A :class:`Turn` stores what the agent saw (the ids of its context's messages), what it said,
and, for token-level agents, the exact tokens fed to the model, the tokens it sampled, their
log-probabilities, and the env's reward and info (for the last turn of an episode that ended
truncated, with what the env said a cut there pays and reports, ``info["reward_if_cut"]`` and
``info["info_if_cut"]``, already added: see :mod:`rftgym.rollout.engine`).

A :class:`Segment` is a maximal run of turns whose token sequences extend each other by prefix
(DESIGN.md section 2). Append-only episodes have one segment; each context edit (e.g. a memory
prune) starts a new one whose prompt is the edited context. In a segment, ``loss_mask`` is 1
exactly on the tokens the policy sampled, and 0 on prompt, tool output and template tokens.
"""

from __future__ import annotations

import gzip
import json
import dataclasses
import math
from array import array
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Iterable, Iterator

from .errors import DataFormatError
from .jsonl import read_jsonl
from .messages import Context, Message, checked_message, shown
from .values import is_finite_real

# The finish reason of a reply the agent could not give because the context left no room for it
# (the prompt alone, or the prompt and a whole reply, exceed the model's window). Such a reply has
# empty text; the rollout engine ends the episode there as truncated, without stepping the env.
CONTEXT_FULL = "context_full"


@dataclass
class Turn:
    index: int
    context_ids: tuple[str, ...]
    action: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    sampled_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    message_id: str | None = None  # id of the assistant message the env made from ``action``

    @property
    def has_tokens(self) -> bool:
        return self.prompt_ids is not None and self.sampled_ids is not None


@dataclass
class Segment:
    """Tokens of a run of prefix-extending turns, ready for a policy-gradient loss."""

    turn_indices: tuple[int, ...]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


def build_segments(turns: Iterable[Turn]) -> list[Segment]:
    """Split token-carrying turns into segments at every point where the prompt stops extending.

    Turn t+1 continues the current segment when its prompt starts with every token of the segment
    so far (the previous prompt plus the sampled tokens); the extra prompt tokens (template,
    tool output, next user message) join with mask 0. Otherwise the context was edited and a new
    segment starts with the whole new prompt as mask 0.
    """
    segments: list[Segment] = []
    current: Segment | None = None
    for turn in turns:
        if not turn.has_tokens:
            continue
        prompt, sampled = list(turn.prompt_ids), list(turn.sampled_ids)
        logprobs = list(turn.logprobs) if turn.logprobs is not None else [0.0] * len(sampled)
        if len(logprobs) != len(sampled):
            raise ValueError(
                f"turn {turn.index + 1}: {len(logprobs)} log-probs for {len(sampled)} sampled tokens"
            )
        n = len(current.token_ids) if current is not None else 0
        if current is not None and len(prompt) >= n and prompt[:n] == current.token_ids:
            extra = prompt[n:]
            current.turn_indices += (turn.index,)
        else:
            current = Segment((turn.index,), [], [], [], prompt_length=len(prompt))
            segments.append(current)
            extra = prompt
        current.token_ids += extra + sampled
        current.loss_mask += [0] * len(extra) + [1] * len(sampled)
        current.logprobs += [0.0] * len(extra) + logprobs
    return segments


@dataclass
class Episode:
    env_id: str
    seed: int | None
    messages: dict[str, Message]
    turns: list[Turn]
    final_context_ids: tuple[str, ...]
    reset_info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def terminated(self) -> bool:
        return bool(self.turns and self.turns[-1].terminated)

    @property
    def truncated(self) -> bool:
        return bool(self.turns and self.turns[-1].truncated)

    @property
    def context_full(self) -> bool:
        """The episode ended because its context left no room for another reply."""
        return bool(self.turns and self.turns[-1].finish_reason == CONTEXT_FULL)

    @property
    def played_turns(self) -> list[Turn]:
        """The turns the env played: the empty turn that records an episode's end for want of
        context is no reply, so it counts neither as a turn nor as a turn without a format error."""
        return [t for t in self.turns if t.finish_reason != CONTEXT_FULL]

    @property
    def success(self) -> bool:
        return bool(self.turns and self.turns[-1].info.get("success", False))

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(t.sampled_ids or ()) for t in self.turns)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(t.prompt_ids or ()) for t in self.turns)

    @property
    def segments(self) -> list[Segment]:
        return build_segments(self.turns)

    def context(self, turn_index: int | None = None) -> Context:
        """The context seen at a turn (or the final context when ``turn_index`` is None)."""
        ids = self.final_context_ids if turn_index is None else self.turns[turn_index].context_ids
        return Context(tuple(self.messages[i] for i in ids))

    def to_json(self) -> dict[str, Any]:
        return {
            "env_id": self.env_id,
            "seed": self.seed,
            "messages": [m.to_dict() for m in self.messages.values()],
            # (shallow: an info value no copy can take, such as a lock, is written as its repr)
            "turns": [{f.name: getattr(t, f.name) for f in fields(t)} for t in self.turns],
            "final_context_ids": list(self.final_context_ids),
            "reset_info": self.reset_info,
            "summary": {
                "total_reward": self.total_reward,
                "success": self.success,
                "turns": len(self.played_turns),  # as `rftgym eval`'s table counts them
                "prompt_tokens": self.num_prompt_tokens,
                "sampled_tokens": self.num_sampled_tokens,
                "segments": len(self.segments),
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Episode":
        """The episode of a record that :meth:`to_json` made (its ``summary`` is derived, and not read).

        The record is checked first for every type and link the writer keeps (see
        :func:`_checked_turn`), so that a record edited by hand or damaged is refused here with a
        DataFormatError naming the field, not a KeyError or IndexError in whatever uses it later."""
        record = _checked(data, dict, "the record")
        messages = _checked_messages(_required(record, "messages", "the record"))
        turns = _checked(_required(record, "turns", "the record"), list, "turns")
        seed = record.get("seed")
        if seed is not None and type(seed) is not int:
            raise DataFormatError(f"seed is {shown(seed)}; it is an integer, or null")
        return cls(
            env_id=_checked(_required(record, "env_id", "the record"), str, "env_id"),
            seed=seed,
            messages=messages,
            turns=[_checked_turn(turn, position, messages) for position, turn in enumerate(turns)],
            final_context_ids=_checked_context_ids(_required(record, "final_context_ids", "the record"),
                                                   messages, "final_context_ids"),
            reset_info=_checked(record.get("reset_info", {}), dict, "reset_info"),
        )


# ---------------------------------------------------------------- reading records back
# Each check costs one pass over what it checks (token lists in C-level passes: a file may hold
# thousands of episodes, each prompt a whole context), so reading stays about as fast as json.loads.

_JSON_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}
_TURN_FIELDS = {f.name: f for f in fields(Turn)}
_REQUIRED_TURN_FIELDS = [name for name, f in _TURN_FIELDS.items()
                         if f.default is MISSING and f.default_factory is MISSING]


def _required(record: dict, key: str, where: str) -> Any:
    if key not in record:
        raise DataFormatError(f"{where} has no {key!r}")
    return record[key]


def _checked(value: Any, kind: type, where: str) -> Any:
    """``value`` when it is of exactly ``kind`` (``true`` is no number, nor ``1`` a flag)."""
    if type(value) is not kind:
        raise DataFormatError(f"{where} is {shown(value)}; it is {_JSON_TYPE_NAMES[kind]}")
    return value


def _checked_messages(items: Any) -> dict[str, Message]:
    """The episode's messages by id: each a {role, content, id} object, ids unique."""
    messages: dict[str, Message] = {}
    for position, item in enumerate(_checked(items, list, "messages")):
        where = f"messages[{position}]"
        message = checked_message(item, where, "a message is a {\"role\", \"content\", \"id\"} object")
        if message.id in messages:
            raise DataFormatError(f"{where}.id {message.id!r} is the id of an earlier message too; message ids "
                                  "are unique in an episode")
        messages[message.id] = message
    return messages


def _checked_context_ids(ids: Any, messages: dict[str, Message], where: str) -> tuple[str, ...]:
    """A context as the ids of the episode's messages, each at most once (as a Context holds them)."""
    seen: set[str] = set()
    for position, message_id in enumerate(_checked(ids, list, where)):
        if type(message_id) is not str or message_id not in messages:
            raise DataFormatError(f"{where}[{position}] is {shown(message_id)}, which is the id of none of the "
                                  "episode's messages")
        if message_id in seen:
            raise DataFormatError(f"{where}[{position}] is {message_id!r} again; a context holds each message once")
        seen.add(message_id)
    return tuple(ids)


def _checked_token_ids(ids: Any, where: str) -> list[int] | None:
    """Integers >= 0, checked in one C pass (a prompt is a whole context, every turn). JSON's
    true and false pass as 1 and 0, as Python and torch take them: finding them would cost a
    second pass over every prompt."""
    if ids is None:
        return None
    ids = _checked(ids, list, where)
    try:
        array("Q", ids)  # refuses floats, text, null, lists, negative and too large numbers
    except (TypeError, OverflowError):
        position, bad = next((n, t) for n, t in enumerate(ids) if type(t) is not int or not 0 <= t < 1 << 64)
        raise DataFormatError(f"{where}[{position}] is {shown(bad)}; token ids are integers >= 0 (that fit in "
                              "64 bits)") from None
    return ids


LOGPROB_ROUNDING = 1e-3  # how far above 0 a float32 log_softmax may round a near-certain token's log-prob


def _checked_logprobs(logprobs: Any, sampled: list[int] | None, where: str) -> list[float] | None:
    """One finite log-prob per sampled token, a number at most 0 (but for rounding): training's
    importance ratios divide by them, and a rollout records no other."""
    if logprobs is None:
        return None
    logprobs = _checked(logprobs, list, where)
    if sampled is None:
        raise DataFormatError(f"{where} is given but sampled_ids is null; log-probs belong to sampled tokens")
    if len(logprobs) != len(sampled):
        raise DataFormatError(f"{where} has {len(logprobs)} entries for the {len(sampled)} tokens of "
                              "sampled_ids; a turn has one log-prob per sampled token")
    try:  # C passes: a NaN or an infinity makes the sum one, text or null a TypeError
        sound = (math.isfinite(sum(logprobs)) and set(map(type, logprobs)) <= {float, int}
                 and max(logprobs, default=0.0) <= LOGPROB_ROUNDING)
    except (TypeError, OverflowError):
        sound = False
    if not sound:  # which entry (none, when only the sum of finite numbers overflowed)
        bad = next(((n, x) for n, x in enumerate(logprobs)
                    if type(x) is bool or not is_finite_real(x) or x > LOGPROB_ROUNDING), None)
        if bad is not None:
            raise DataFormatError(f"{where}[{bad[0]}] is {shown(bad[1])}; a log-prob is a finite number at most 0")
    return logprobs


def _checked_optional_str(value: Any, where: str) -> str | None:
    return None if value is None else _checked(value, str, where)


def _checked_turn(data: Any, position: int, messages: dict[str, Message]) -> Turn:
    """The turn at ``position`` of a record, with the links and types :meth:`Episode.to_json`'s
    records keep: its index is its position; its context and its message are messages of the
    episode; its reward is a finite number and its flags bools; its token lists are both given or
    both null, of ints >= 0, with one finite log-prob per sampled token."""
    where = f"turns[{position}]"
    data = _checked(data, dict, where)
    unknown = next((key for key in data if key not in _TURN_FIELDS), None)
    if unknown is not None:
        raise DataFormatError(f"{where} has the key {unknown!r}, which no turn has; a turn's keys are "
                              f"{', '.join(_TURN_FIELDS)}")
    missing = next((key for key in _REQUIRED_TURN_FIELDS if key not in data), None)
    if missing is not None:
        raise DataFormatError(f"{where} has no {missing!r}")
    index = data["index"]
    if type(index) is not int or index != position:
        raise DataFormatError(f"{where}.index is {shown(index)}; a turn's index is its place in turns ({position})")
    reward = data["reward"]
    if not is_finite_real(reward):  # (a bool is no reward, nor a number too large for a float)
        raise DataFormatError(f"{where}.reward is {shown(reward)}; a reward is a finite number")
    prompt_ids = _checked_token_ids(data.get("prompt_ids"), f"{where}.prompt_ids")
    sampled_ids = _checked_token_ids(data.get("sampled_ids"), f"{where}.sampled_ids")
    if (prompt_ids is None) != (sampled_ids is None):
        given, null = ("prompt_ids", "sampled_ids") if sampled_ids is None else ("sampled_ids", "prompt_ids")
        raise DataFormatError(f"{where}.{given} is given but {null} is null; a turn records both token lists, "
                              "or neither")
    message_id = _checked_optional_str(data.get("message_id"), f"{where}.message_id")
    if message_id is not None and message_id not in messages:
        raise DataFormatError(f"{where}.message_id is {message_id!r}, which is the id of none of the episode's "
                              "messages")
    return Turn(
        index=index,
        context_ids=_checked_context_ids(data["context_ids"], messages, f"{where}.context_ids"),
        action=_checked(data["action"], str, f"{where}.action"),
        reward=reward,
        terminated=_checked(data["terminated"], bool, f"{where}.terminated"),
        truncated=_checked(data["truncated"], bool, f"{where}.truncated"),
        info=_checked(data.get("info", {}), dict, f"{where}.info"),
        prompt_ids=prompt_ids,
        sampled_ids=sampled_ids,
        logprobs=_checked_logprobs(data.get("logprobs"), sampled_ids, f"{where}.logprobs"),
        finish_reason=_checked_optional_str(data.get("finish_reason"), f"{where}.finish_reason"),
        message_id=message_id,
    )


def _json_default(obj: Any):
    # numpy scalars and arrays, tuples in info dicts
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # an env's result record: its fields
        return _json_ready({f.name: getattr(obj, f.name) for f in fields(obj)})
    if hasattr(obj, "tolist"):
        return _json_ready(obj.tolist())
    if isinstance(obj, (set, frozenset)):
        try:
            return _json_ready(sorted(obj))
        except TypeError:  # mixed types ({1, "a"}) have no order of their own
            return _json_ready(sorted(obj, key=repr))
    return repr(obj)


def write_episodes_jsonl(path, episodes: Iterable[Episode], compressed: bool | None = None) -> int:
    """Write ``episodes`` to ``path``, one JSON line each, through gzip when ``compressed`` (None:
    when the name ends in ``.gz``, as :func:`read_episodes_jsonl` reads it); return how many."""
    count = 0
    if compressed is None:
        compressed = str(path).lower().endswith(".gz")
    with (gzip.open(path, "wt", encoding="utf-8") if compressed else open(path, "w", encoding="utf-8")) as handle:
        for episode in episodes:
            append_episode_jsonl(handle, episode)
            count += 1
    return count


def _key_text(key: Any) -> str:
    """A dict key as JSON writes it (``True`` as ``true``, ``None`` as ``null``), else its ``str``."""
    if isinstance(key, (bool, float)) or key is None:
        return json.dumps(key)
    return str(key)


def _json_ready(obj: Any, _within: frozenset = frozenset()) -> Any:
    """``obj`` as strict JSON can hold it. Every dict key a string: other keys (ints, tuples, numpy
    ints) are written as JSON writes them, or as their ``str``; a key whose text another key of the
    same dict already has (``1`` beside ``"1"``, ``(1, 2)`` beside ``"(1, 2)"``) gets its type
    added, ``"1 (int)"``, so that no entry overwrites another when the line is read back. A NaN or
    infinite number becomes the string "NaN", "Infinity" or "-Infinity" (JSON has no such numbers:
    written bare, they would stop any strict reader). A container inside itself (a list that holds
    itself) is written as a note where it recurs, not followed until the recursion limit.
    ``_within``: the ids of the containers being written around ``obj``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in _within:
            return f"<the {type(obj).__name__} that holds this one>"
        _within = _within | {id(obj)}
    if isinstance(obj, dict):
        taken = {key for key in obj if isinstance(key, str)}
        texts = {}
        for key in obj:
            if isinstance(key, str):
                texts[key] = key
                continue
            text = _key_text(key)
            if text in taken:
                text = f"{text} ({type(key).__name__})"
            base, n = text, 2
            while text in taken:
                text, n = f"{base} #{n}", n + 1
            taken.add(text)
            texts[key] = text
        return {texts[key]: _json_ready(value, _within) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v, _within) for v in obj]
    return obj


def episode_json_line(episode: Episode) -> str:
    """One episode as one line of JSON (ASCII: lone surrogates in agent text stay valid JSON)."""
    record = episode.to_json()
    # Only info dicts come from an env (and may have int, tuple or numpy keys); the token lists
    # beside them are left as they are.
    record["reset_info"] = _json_ready(record["reset_info"])
    for turn in record["turns"]:
        turn["info"] = _json_ready(turn["info"])
    return json.dumps(record, default=_json_default)


def append_episode_jsonl(handle, episode: Episode) -> None:
    """One episode as one JSON line on an open text file, flushed (so a reader, or an interrupted
    run, has every finished line)."""
    handle.write(episode_json_line(episode) + "\n")
    handle.flush()


EPISODES_SHAPE = "one episode per line, as rftgym eval writes them"


def read_episodes_jsonl(path) -> Iterator[Episode]:
    """The episodes of a JSON-lines file that ``rftgym eval`` (or :func:`write_episodes_jsonl`)
    wrote, in order, one at a time (``.gz`` through gzip). A line that is not an episode (see
    :meth:`Episode.from_json`) stops the reading with a DataFormatError naming its line and the
    field at fault; the episodes before it have been yielded."""
    for number, record in read_jsonl(path, EPISODES_SHAPE):
        try:
            episode = Episode.from_json(record)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # from_json names what it refuses; anything else it let through is shown by its type
            why = f": {exc}" if isinstance(exc, DataFormatError) else f" ({type(exc).__name__}: {exc})"
            raise DataFormatError(f"{path}:{number}: not an episode{why}; expected {EPISODES_SHAPE}") from None
        yield episode
