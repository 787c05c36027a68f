"""One tag parser for every environment's tool tags.

Agents call tools with tags inside their assistant text: ``<answer>…</answer>``,
``<search>…</search>``, ``<evaluate>…</evaluate>``, ``<prune ids="a,b">note</prune>``, and
fenced code blocks. :func:`parse_tags` is tolerant (tag names are case-insensitive and may carry
whitespace: ``< Answer >`` works) and total: it never raises on any string. Whatever is wrong
(an unclosed tag, a stray closing tag, a tag this env does not know, an unclosed code fence) is
reported in :attr:`ParseResult.problems` so that the env can turn it into an observation.

Tags inside fenced code blocks are code, not tool calls, and are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

_TAG_TOKEN = re.compile(
    r"<\s*(?P<close>/)?\s*(?P<name>[A-Za-z][\w-]*)(?P<attrs>(?:\s+[^<>]*?)?)\s*(?P<selfclose>/)?\s*>"
)
_ATTRIBUTE = re.compile(r"""([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*$", re.MULTILINE)


@dataclass(frozen=True)
class Tag:
    """A known tag found in the text. ``body`` is the raw text between its open and close tags."""

    name: str
    body: str
    attrs: tuple[tuple[str, str], ...]
    start: int
    end: int
    closed: bool = True
    parent: str | None = None

    @property
    def text(self) -> str:
        return self.body.strip()

    def attr(self, key: str, default: str | None = None) -> str | None:
        key = key.lower()
        for name, value in self.attrs:
            if name == key:
                return value
        return default


@dataclass(frozen=True)
class CodeBlock:
    """A fenced code block (```lang … ```)."""

    language: str
    code: str
    start: int
    end: int
    closed: bool = True


@dataclass(frozen=True)
class ParseResult:
    tags: tuple[Tag, ...] = ()
    code_blocks: tuple[CodeBlock, ...] = ()
    problems: tuple[str, ...] = ()
    unknown_tags: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def find(self, name: str) -> list[Tag]:
        name = name.lower()
        return [t for t in self.tags if t.name == name]

    def first(self, name: str) -> Tag | None:
        found = self.find(name)
        return found[0] if found else None

    def names(self) -> list[str]:
        """Names of closed tags in order of their opening."""
        return [t.name for t in self.tags if t.closed]


def _parse_attrs(raw: str) -> tuple[tuple[str, str], ...]:
    out = []
    for match in _ATTRIBUTE.finditer(raw or ""):
        value = next((v for v in match.groups()[1:] if v is not None), "")
        out.append((match.group(1).lower(), value))
    return tuple(out)


def find_code_blocks(text: str) -> tuple[list[CodeBlock], list[str]]:
    """Fenced code blocks in order; an unclosed fence runs to the end and is reported."""
    blocks: list[CodeBlock] = []
    problems: list[str] = []
    fences = list(_FENCE.finditer(text))
    i = 0
    while i < len(fences):
        opening = fences[i]
        marker = opening.group(1)
        closing_index = None
        for j in range(i + 1, len(fences)):
            candidate = fences[j]
            # A closing fence is the same character, at least as long, with no info string.
            if candidate.group(1)[0] == marker[0] and len(candidate.group(1)) >= len(marker) \
                    and not candidate.group(2):
                closing_index = j
                break
        code_start = min(opening.end() + 1, len(text))
        if closing_index is None:
            blocks.append(CodeBlock(opening.group(2).lower(), text[code_start:], opening.start(), len(text), closed=False))
            problems.append("a code block opened with ``` is never closed; end it with ``` on its own line")
            break
        closing = fences[closing_index]
        code = text[code_start:closing.start()]
        blocks.append(CodeBlock(opening.group(2).lower(), code, opening.start(), closing.end()))
        i = closing_index + 1
    return blocks, problems


def parse_tags(text: str, known: Iterable[str]) -> ParseResult:
    """Parse the tags named in ``known`` (case-insensitive) and fenced code blocks out of ``text``."""
    if not isinstance(text, str):
        return ParseResult(problems=(f"expected text, got {type(text).__name__}",))
    known_names = {k.lower() for k in known}
    blocks, problems = find_code_blocks(text)
    in_code = [(b.start, b.end) for b in blocks]

    tags: list[Tag] = []
    unknown: list[str] = []
    stack: list[tuple[str, tuple, int, int]] = []  # (name, attrs, tag start, body start)

    def parent_name() -> str | None:
        return stack[-1][0] if stack else None

    for token in _TAG_TOKEN.finditer(text):
        if any(start <= token.start() < end for start, end in in_code):
            continue
        name = token.group("name").lower()
        if name not in known_names:
            if name not in unknown:
                unknown.append(name)
            continue
        if token.group("close"):
            open_names = [entry[0] for entry in stack]
            if name not in open_names:
                problems.append(f"</{name}> closes a tag that was never opened")
                continue
            while stack and stack[-1][0] != name:
                inner = stack.pop()
                problems.append(f"<{inner[0]}> is never closed (before </{name}>)")
                tags.append(Tag(inner[0], text[inner[3]:token.start()], inner[1], inner[2], token.start(),
                                closed=False, parent=name))
            opened = stack.pop()
            tags.append(Tag(name, text[opened[3]:token.start()], opened[1], opened[2], token.end(),
                            parent=parent_name()))
        elif token.group("selfclose"):
            problems.append(f"<{name}/> is empty; write <{name}>…</{name}>")
            tags.append(Tag(name, "", _parse_attrs(token.group("attrs")), token.start(), token.end(),
                            parent=parent_name()))
        else:
            stack.append((name, _parse_attrs(token.group("attrs")), token.start(), token.end()))

    while stack:
        opened = stack.pop()
        problems.append(f"<{opened[0]}> is never closed; end it with </{opened[0]}>")
        tags.append(Tag(opened[0], text[opened[3]:], opened[1], opened[2], len(text), closed=False,
                        parent=parent_name()))

    tags.sort(key=lambda t: t.start)
    return ParseResult(tuple(tags), tuple(blocks), tuple(problems), tuple(unknown))
