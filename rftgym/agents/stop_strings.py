"""Stop strings for a local policy: a reply ends at the token whose text completes one.

A model that searches (``<search>…</search>``) must stop there, so that the env's results, not
the model's guess at them, come next; vLLM's and OpenAI's ``stop`` do this on a server. Here the
reply keeps every token it sampled up to and including the one that completes the string (the
tokens are recorded exactly, so the string stays in the text, with whatever else that last token
holds), and its finish reason is ``"stop"``.

Where the reply stops does not depend on how the decode loop found it: the generic loop checks
after each token (and stops a row there, saving the rest of its tokens), the CUDA fast path cuts
its finished replies afterwards with :meth:`StopStrings.cut`. Each token is sampled from its own
draw, so the tokens before the stop are the same either way.
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
    (token ids -> the reply's text)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str]):
        self.stops = tuple(stops)
        self.decode = decode
        # Every token holds at least one byte of text, so the tokens that spell a string are at
        # most its length in bytes; one more lets the first of them begin mid-character.
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 1

    def ends_at_stop(self, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids``' last few tokens holds a stop string. Checked after every
        token, the first time it is true is the token that completed one."""
        tail = self.decode(ids[-self.window:])
        return any(stop in tail for stop in self.stops)

    def cut(self, ids: Sequence[int]) -> int | None:
        """How many of ``ids`` a reply keeps (through the token that completes the first stop
        string), or None when the reply holds none."""
        text = self.decode(ids)
        if not any(stop in text for stop in self.stops):
            return None
        for length in range(1, len(ids) + 1):
            if self.ends_at_stop(ids[:length]):
                return length
        return None  # only in the whole text (a decoder that joins tokens differently): left whole
