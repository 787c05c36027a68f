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

import bisect
import re
from dataclasses import dataclass, field, replace
from typing import Iterable

# Possessive quantifiers keep matching linear: the earlier pattern's lazy attribute run next to
# optional whitespace backtracked cubically ("<a" followed by 1,000 spaces took minutes). A
# trailing "/" inside the attribute run ("<prune ids=a />") is split off in Python instead.
_TAG_TOKEN = re.compile(
    r"<\s*+(?P<close>/)?\s*+(?P<name>[A-Za-z][\w-]*+)(?P<attrs>(?:\s[^<>]*+)?)(?P<selfclose>/\s*+)?>"
)
# The lookbehind stops a search from restarting inside a name, which made a long run of letters
# without "=" quadratic.
# Values quoted with ASCII or typographic quotes (a model's text often "smartens" them), or bare.
# A bare value is read with the comma list it heads, spaces after the commas and all (ids=r1, r6),
# up to a word that names another attribute (ids=r1, id=2).
_ATTRIBUTE = re.compile(r"""(?<![\w-])([A-Za-z_][\w-]*+)\s*+=\s*+"""
                        r"""(?:"([^"]*)"|'([^']*)'|\u201c([^\u201d]*)\u201d|\u2018([^\u2019]*)\u2019"""
                        r"""|([^\s"'>,\u201c\u2018]++(?:\s*+,\s*+[^\s"'>,=\u201c\u2018]++(?!\s*=))*+,?))""")
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*$", re.MULTILINE)


@dataclass(frozen=True)
class Tag:
    """A known tag found in the text. ``body`` is the raw text between its open and close tags
    (for an unclosed tag, to the next closing tag or the end of the text)."""

    name: str
    source: str = field(repr=False, compare=False)  # the parsed text, shared by its tags
    body_start: int
    body_end: int
    attrs: tuple[tuple[str, str], ...]
    start: int
    end: int
    closed: bool = True
    parent: str | None = None

    @property
    def body(self) -> str:
        # Sliced when asked: nested unclosed tags each run to the end of the text, so copies made
        # while parsing grew with the square of the reply's length (gigabytes at 256k characters).
        return self.source[self.body_start:self.body_end]

    @property
    def text(self) -> str:
        return self.body.strip()

    @property
    def stray_attribute_text(self) -> str:
        """Text in the opening tag that no attribute took: "r6" in ``<prune ids=r1 r6>``, where a
        bare value stops at the space (quote it: ``ids="r1 r6"``)."""
        opening = _TAG_TOKEN.match(self.source, self.start)
        if opening is None or opening.group("close") or opening.group("name").lower() != self.name:
            return ""   # the tag was opened before the text (a template's <think>)
        return " ".join(_ATTRIBUTE.sub(" ", opening.group("attrs")).replace("/", " ").split())

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

    def inside_closed(self, tag: Tag, name: str) -> bool:
        """Whether ``tag`` lies inside a closed ``<name>…</name>`` (e.g. reasoning in ``<think>``).
        An unclosed ``<name>`` encloses nothing: it is reported, and what follows it still counts."""
        starts, ends = self._closed_spans(name.lower())
        k = bisect.bisect_right(starts, tag.start) - 1  # the last span that opens at or before the tag
        if k >= 0 and starts[k] == tag.start and ends[k] == tag.end:  # the tag itself
            k -= 1
        return k >= 0 and tag.end <= ends[k]

    def _closed_spans(self, name: str) -> tuple[list[int], list[int]]:
        """The outermost closed ``name`` tags' (starts, ends), in order: closed tags nest or are
        disjoint, so a tag is inside one of them exactly when it is inside the last that opens
        before it. Built once per name (a reply may hold thousands of tags)."""
        cache = self.__dict__.setdefault("_spans", {})  # frozen: set through __dict__
        if name not in cache:
            starts: list[int] = []
            ends: list[int] = []
            for tag in self.tags:  # sorted by start
                if tag.name == name and tag.closed and not (ends and tag.end <= ends[-1]):
                    starts.append(tag.start)
                    ends.append(tag.end)
            cache[name] = (starts, ends)
        return cache[name]


def never_closed(name: str) -> str:
    """The problem :func:`parse_tags` reports for a ``<name>`` left open at the end of the text (an
    env that allows that, e.g. a search inside an open ``<think>``, drops it by this text)."""
    return f"<{name}> is never closed; end it with </{name}>"


def _parse_attrs(raw: str) -> tuple[tuple[str, str], ...]:
    out = []
    for match in _ATTRIBUTE.finditer(raw or ""):
        value = next((v for v in match.groups()[1:] if v is not None), "")
        out.append((match.group(1).lower(), value))
    return tuple(out)


UNCLOSED_FENCE = "a code block opened with ``` is never closed; end it with ``` on its own line"


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
        # A fence indented (in a list item, say) indents its lines as much: CommonMark takes that
        # much indentation off each line, or the code would not even parse.
        indent = len(opening.group(0)) - len(opening.group(0).lstrip(" \t"))
        if closing_index is None:
            blocks.append(CodeBlock(opening.group(2).lower(), _dedent(text[code_start:], indent), opening.start(),
                                    len(text), closed=False))
            problems.append(UNCLOSED_FENCE)
            break
        closing = fences[closing_index]
        code = _dedent(text[code_start:closing.start()], indent)
        blocks.append(CodeBlock(opening.group(2).lower(), code, opening.start(), closing.end()))
        i = closing_index + 1
    return blocks, problems


def _dedent(code: str, indent: int) -> str:
    """``code`` with up to ``indent`` spaces or tabs taken off the start of each line."""
    if not indent:
        return code
    return re.sub(rf"^[ \t]{{1,{indent}}}", "", code, flags=re.MULTILINE)


def _split_token(token: re.Match) -> tuple[str, str, bool]:
    """(name, raw attributes, self-closing) of a tag token."""
    attrs = token.group("attrs")
    selfclose = token.group("selfclose") is not None
    trimmed = attrs.rstrip()
    if trimmed.endswith("/"):  # "<answer />", "<prune ids=a/>"
        attrs, selfclose = trimmed[:-1], True
    return token.group("name").lower(), attrs, selfclose


def parse_tags(text: str, known: Iterable[str], *, may_be_empty: Iterable[str] = (),
               opened_before: Iterable[str] = ("think",)) -> ParseResult:
    """Parse the tags named in ``known`` (case-insensitive) and fenced code blocks out of ``text``.
    A self-closing tag (``<answer/>``) is reported as empty, except those named in ``may_be_empty``
    (a tag whose attributes say all, e.g. MemoryQA's ``<prune ids="r1"/>``). A tag named in
    ``opened_before`` may have been opened before the text, by the chat template (a reasoning
    model's generation prompt ends in ``<think>``): its first closing, before any opening of it and
    with more of the text after it, closes one that opens at the text's start (everything before
    it is inside). A stray closing that ends the text is reported, as any other."""
    if not isinstance(text, str):
        return ParseResult(problems=(f"expected text, got {type(text).__name__}",))
    if isinstance(known, str):
        known = (known,)
    known_names = {k.lower() for k in known}
    empty_ok = {k.lower() for k in may_be_empty}
    implicit = {k.lower() for k in opened_before} & known_names  # still able to have been opened before
    seen: set[str] = set()
    blocks, problems = find_code_blocks(text)
    # Blocks are sorted and disjoint: a token is in code if it starts before the end of the last
    # block that starts at or before it (bisect keeps this fast with thousands of blocks).
    block_starts = [b.start for b in blocks]

    def in_code(position: int) -> bool:
        k = bisect.bisect_right(block_starts, position) - 1
        return k >= 0 and position < blocks[k].end

    tags: list[Tag] = []
    unknown: dict[str, None] = {}  # ordered set
    stack: list[tuple[str, tuple, int, int]] = []  # (name, attrs, tag start, body start)
    open_counts: dict[str, int] = {}

    def parent_name() -> str | None:
        return stack[-1][0] if stack else None

    def pop() -> tuple[str, tuple, int, int]:
        entry = stack.pop()
        open_counts[entry[0]] -= 1
        return entry

    for token in _TAG_TOKEN.finditer(text):
        if in_code(token.start()):
            continue
        name, raw_attrs, selfclose = _split_token(token)
        if name not in known_names:
            unknown.setdefault(name)
            continue
        first_of_its_name = name not in seen
        seen.add(name)
        if token.group("close"):
            # The reply goes on after it: a model that ends its reply with a stray </think> (one
            # that never thinks) keeps what it did before it.
            if not open_counts.get(name) and name in implicit and first_of_its_name and text[token.end():].strip():
                while stack:  # opened inside that thinking, and left open at its end
                    inner = pop()
                    problems.append(f"<{inner[0]}> is never closed (before </{name}>)")
                    tags.append(Tag(inner[0], text, inner[3], token.start(), inner[1], inner[2], token.start(),
                                    closed=False, parent=parent_name()))
                # what came before lies inside it: the outermost of those tags are its children
                tags[:] = [replace(t, parent=name) if t.parent is None else t for t in tags]
                tags.append(Tag(name, text, 0, token.start(), (), 0, token.end()))  # opened before the text
                continue
            if not open_counts.get(name):
                problems.append(f"</{name}> closes a tag that was never opened")
                continue
            while stack[-1][0] != name:
                inner = pop()
                problems.append(f"<{inner[0]}> is never closed (before </{name}>)")
                tags.append(Tag(inner[0], text, inner[3], token.start(), inner[1], inner[2], token.start(),
                                closed=False, parent=parent_name()))
            opened = pop()
            tags.append(Tag(name, text, opened[3], token.start(), opened[1], opened[2], token.end(),
                            parent=parent_name()))
        elif selfclose:
            if name not in empty_ok:
                problems.append(f"<{name}/> is empty; write <{name}>…</{name}>")
            tags.append(Tag(name, text, token.end(), token.end(), _parse_attrs(raw_attrs), token.start(), token.end(),
                            parent=parent_name()))
        else:
            stack.append((name, _parse_attrs(raw_attrs), token.start(), token.end()))
            open_counts[name] = open_counts.get(name, 0) + 1

    while stack:
        opened = pop()
        problems.append(never_closed(opened[0]))
        tags.append(Tag(opened[0], text, opened[3], len(text), opened[1], opened[2], len(text), closed=False,
                        parent=parent_name()))

    tags.sort(key=lambda t: t.start)
    return ParseResult(tuple(tags), tuple(blocks), tuple(problems), tuple(unknown))
