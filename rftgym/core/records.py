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

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

from .errors import DataFormatError
from .jsonl import read_jsonl
from .messages import Context, Message

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
                f"turn {turn.index}: {len(logprobs)} log-probs for {len(sampled)} sampled tokens"
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
            "turns": [asdict(t) for t in self.turns],
            "final_context_ids": list(self.final_context_ids),
            "reset_info": self.reset_info,
            "summary": {
                "total_reward": self.total_reward,
                "success": self.success,
                "turns": len(self.turns),
                "prompt_tokens": self.num_prompt_tokens,
                "sampled_tokens": self.num_sampled_tokens,
                "segments": len(self.segments),
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Episode":
        messages = {d["id"]: Message.from_dict(d) for d in data["messages"]}
        turns = []
        for t in data["turns"]:
            t = dict(t)
            t["context_ids"] = tuple(t["context_ids"])
            turns.append(Turn(**t))
        return cls(
            env_id=data["env_id"],
            seed=data.get("seed"),
            messages=messages,
            turns=turns,
            final_context_ids=tuple(data["final_context_ids"]),
            reset_info=data.get("reset_info", {}),
        )


def _json_default(obj: Any):
    # numpy scalars and arrays, tuples in info dicts
    if hasattr(obj, "tolist"):
        return _json_ready(obj.tolist())
    if isinstance(obj, (set, frozenset)):
        try:
            return _json_ready(sorted(obj))
        except TypeError:  # mixed types ({1, "a"}) have no order of their own
            return _json_ready(sorted(obj, key=repr))
    return repr(obj)


def write_episodes_jsonl(path, episodes: Iterable[Episode]) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for episode in episodes:
            append_episode_jsonl(handle, episode)
            count += 1
    return count


def _key_text(key: Any) -> str:
    """A dict key as JSON writes it (``True`` as ``true``, ``None`` as ``null``), else its ``str``."""
    if isinstance(key, (bool, float)) or key is None:
        return json.dumps(key)
    return str(key)


def _json_ready(obj: Any) -> Any:
    """``obj`` as strict JSON can hold it. Every dict key a string: other keys (ints, tuples, numpy
    ints) are written as JSON writes them, or as their ``str``; a key whose text another key of the
    same dict already has (``1`` beside ``"1"``, ``(1, 2)`` beside ``"(1, 2)"``) gets its type
    added, ``"1 (int)"``, so that no entry overwrites another when the line is read back. A NaN or
    infinite number becomes the string "NaN", "Infinity" or "-Infinity" (JSON has no such numbers:
    written bare, they would stop any strict reader)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
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
        return {texts[key]: _json_ready(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
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
    wrote, in order, one at a time (``.gz`` through gzip). A line that is not an episode stops the
    reading with a DataFormatError naming its line; the episodes before it have been yielded."""
    for number, record in read_jsonl(path, EPISODES_SHAPE):
        try:
            episode = Episode.from_json(record)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataFormatError(f"{path}:{number}: not an episode ({type(exc).__name__}: {exc}); expected "
                                  f"{EPISODES_SHAPE}") from None
        yield episode
