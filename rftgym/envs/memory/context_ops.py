"""The memory env's message formats and the prune operation, as pure functions.

Search results. Each ``<search>`` becomes ONE user message (a batch) holding every hit, each hit
on its own line under a short id unique in the episode (``r1``, ``r2``, … never reused)::

    [search results for: Alda Mertz]
    [r4] Alda Mertz: Alda Mertz is a pilot born in 1931 in Veloria. …
    [r5] Veloria: Veloria is a city in Tulen. …

A search that matches nothing still gets one id (``[r6] (no documents matched)``) so that its
message can be pruned too.

Memory notes. A prune's note becomes one user message ``[memory m2] note``; ``m<n>`` is the
note's own id (also never reused), so old notes can be pruned and replaced by a shorter one.

Prune rule. ``<prune ids="r4,m2">note</prune>`` names result ids and/or memory ids. Naming ANY
one id of a message deletes that WHOLE message (a search batch goes as a unit; its other ids
vanish with it). Only ids shown in the observation the turn answered can be named; a prune with
any id that is not (unknown, already pruned, the task, a message id) deletes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..search.retrievers import Hit

RESULT_HEADER = "[search results for: "
MEMORY_PREFIX = "[memory "
RESULT_LINE = re.compile(r"^\[(r\d+)\] (.*)$", re.MULTILINE)
MEMORY_LINE = re.compile(r"^\[memory (m\d+)\] ", re.MULTILINE)
_ID_SEPARATORS = re.compile(r"[\s,;]+")
MAX_SHOWN_ID_CHARS = 40  # a refusal quotes the bad ids, cut so that its message stays short


def one_line(text: str) -> str:
    return " ".join(text.split())


def format_results(query: str, hits: list[Hit], result_ids: list[str], max_doc_chars: int) -> str:
    """A search batch message; ``result_ids`` has one id per hit (one id when ``hits`` is empty)."""
    lines = [f"{RESULT_HEADER}{one_line(query)}]"]
    if not hits:
        lines.append(f"[{result_ids[0]}] (no documents matched)")
    for rid, hit in zip(result_ids, hits):
        text = one_line(hit.text)
        if len(text) > max_doc_chars:
            text = text[: max_doc_chars - 1].rstrip() + "…"
        lines.append(f"[{rid}] {one_line(hit.title)}: {text}")
    return "\n".join(lines)


def format_memory(memory_id: str, note: str) -> str:
    return f"{MEMORY_PREFIX}{memory_id}] {note}"


def is_results(content: str) -> bool:
    return content.startswith(RESULT_HEADER)


def result_lines(content: str) -> list[tuple[str, str]]:
    """(result id, "Title: text") for each hit line of a search batch message."""
    if not is_results(content):
        return []
    return [(m.group(1), m.group(2)) for m in RESULT_LINE.finditer(content)]


def parse_prune_ids(raw: str | None) -> list[str]:
    """The ids named in a prune's ``ids`` attribute: comma/space separated, case-insensitive,
    brackets and the word ``memory`` tolerated, as the context shows a note as ``[memory m1]``
    (``"[R4], [memory m1]"`` -> ``["r4", "m1"]``); order kept, duplicates dropped."""
    if not raw:
        return []
    names = (name.strip("[]()").lower() for name in _ID_SEPARATORS.split(raw.strip()))
    return list(dict.fromkeys(name for name in names if name and name != "memory"))


@dataclass
class PruneCheck:
    """Whether a prune may run: the messages it deletes, or why it deletes nothing."""

    named: list[str]
    message_ids: list[str] = field(default_factory=list)
    error: str | None = None


def check_prune(named: list[str], visible: dict[str, str], protected: dict[str, str]) -> PruneCheck:
    """Validate a prune.

    ``visible`` maps each prunable id shown in the observation (result and memory ids) to the id of
    the message holding it; ``protected`` maps names that must never be pruned (the task, its
    objective numbers, message ids of other messages) to what they are, for a clear refusal.
    """
    check = PruneCheck(named)
    if not named:
        check.error = ('a <prune> needs ids="r1,r2" naming search result ids ([r…]) or memory ids ([memory m…]) '
                       "shown in your context; nothing was pruned")
        return check
    problems = []
    for name in named:
        if name in visible:
            continue
        shown = repr(name if len(name) <= MAX_SHOWN_ID_CHARS else name[:MAX_SHOWN_ID_CHARS] + "…")
        if name in protected:
            problems.append(f"{shown} is {protected[name]}, which cannot be pruned")
        else:
            problems.append(f"{shown} is not a search result or memory id in your context (unknown or already pruned)")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        check.error = f"{shown}; nothing was pruned (only [r…] and [memory m…] ids can be pruned)"
        return check
    check.message_ids = list(dict.fromkeys(visible[name] for name in named))
    return check
