"""Stop strings for a local policy: a reply ends at the token whose text completes one.

A model that searches (``<search>…</search>``) must stop there, so that the env's results, not
the model's guess at them, come next; vLLM's and OpenAI's ``stop`` do this on a server. Here the
reply keeps every token it sampled up to and including the one that completes the string (the
tokens are recorded exactly, so the string stays in the text, with whatever else that last token
holds), and its finish reason is ``"stop"``.

Where the reply stops does not depend on how the decode loop found it: the generic loop reads
each row's tokens as they come (and stops a row there, saving the rest of its tokens), the CUDA
fast path reads its finished replies afterwards with :meth:`StopStrings.cut`, the same way. Each
token is sampled from its own draw, so the tokens before the stop are the same either way.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..core.errors import ConfigError


def checked_stop_strings(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string, or None for none, accepted)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"stop strings must be non-empty strings (one, or a list of them, e.g. '</search>'), "
                          f"got {stop!r}", field="stop")
    return tuple(stop)


class StopStrings:
    """Finds where a reply's tokens first complete one of ``stops``, decoding with ``decode``
    (token ids -> the reply's text).

    The text is read as vLLM's detokenizer reads it, a few tokens at a time: the text of the
    tokens since the last whole character, held back while it ends in an unfinished one (U+FFFD:
    a byte-level or byte-fallback token that spells part of a character; for at most
    ``MAX_HELD_TOKENS``), so that a character spelled over several tokens is read once it is whole,
    and a stop string is found at the token that completes it whatever its bytes."""

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str]):
        self.stops = tuple(stops)
        self.decode = decode
        self.longest = max(len(s) for s in self.stops)

    def reader(self) -> "StopReader":
        """A reader of one reply's tokens, fed them one at a time."""
        return StopReader(self)

    def cut(self, ids: Sequence[int]) -> int | None:
        """How many of ``ids`` a reply keeps (through the token that completes the first stop
        string), or None when the reply holds none: what a :meth:`reader` fed them finds."""
        # A reply whose whole text holds no stop string and no unfinished or invalid bytes (U+FFFD)
        # has none in any of its prefixes' texts either: most replies are settled by one decode.
        text = self.decode(ids)
        if "\ufffd" not in text and not any(stop in text for stop in self.stops):
            return None
        reader = self.reader()
        for length in range(1, len(ids) + 1):
            if reader.completes_stop(ids, length):
                return length
        return None


# A character is at most 4 bytes, each token at least one: text still unfinished after this many
# tokens holds a real U+FFFD (or bytes that make no character), and is read as it stands.
MAX_HELD_TOKENS = 4


class StopReader:
    """One reply's text so far, read a token at a time (see :class:`StopStrings`)."""

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.text = ""
        self.start = 0  # the first token of the text not yet read whole (some context before it)
        self.read = 0  # the tokens read into ``text``

    def completes_stop(self, ids: Sequence[int], end: int | None = None) -> bool:
        """Read ``ids[:end]`` (the reply's tokens so far: those read before and one more); whether
        the text they add completes a stop string."""
        end = len(ids) if end is None else end
        decode = self.stops.decode
        before = decode(ids[self.start:self.read])
        now = decode(ids[self.start:end])
        if now.endswith("\ufffd") and end - self.read < MAX_HELD_TOKENS:
            # A character not finished: wait for its next bytes; a stop string before it counts now
            # (a byte-level token can hold a string's last space and a character's first byte).
            return len(now) > len(before) and self._holds_stop(now.rstrip("\ufffd")[len(before):])
        if len(now) <= len(before):
            return False  # nothing yet
        added = now[len(before):]
        self.start, self.read = self.read, end
        found = self._holds_stop(added)
        self.text += added
        return found

    def _holds_stop(self, added: str) -> bool:
        """Whether the text read, then ``added``, holds a stop string; the text read alone holds
        none (this reader would have said so), so one found overlaps ``added``."""
        if not added:
            return False
        tail = self.text[-(self.stops.longest - 1):] if self.stops.longest > 1 else ""
        return any(stop in tail + added for stop in self.stops.stops)
