"""Relations between a function's arguments that every example shows, kept by generated inputs.

Inputs are sampled one argument at a time (:mod:`.inputs`), so a rule that ties arguments together
is broken by most of them: ``f(arr, n)`` called with ``n == len(arr)`` in every assert (89 MBPP
tasks), two strings of one length (HumanEval 11), ``len(operator) == len(operand) - 1``
(HumanEval 160), a list without repeats ("unique elements"), a sentence of one shape
("5 apples and 6 oranges"). The reference's output outside that domain is whatever its code
happens to give, and a correct solution that differs there could never pass its whole suite.

So each relation that holds in every example (of at least two) is kept: a generated input is
mended to hold it (its repeats dropped, a sequence cut to the length asked, the int set to the
length, a sentence's words put back around its numbers; never shorter than the shortest example),
or dropped where no mending can. A relation the examples show by chance only narrows the inputs;
it never makes a test wrong.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ...core.values import is_int

SIZED = (str, list, tuple)
_NUMBER = re.compile(r"\d+")
MIN_EXAMPLES = 2
MAX_PAIRWISE = 200  # unhashable items compared pairwise for repeats: at most this many
MAX_SHAPED_DIGITS = 9  # a sentence's numbers (counts, amounts) have at most this many digits


@dataclass(frozen=True)
class LengthIs:
    """``args[target] == len(args[sized]) + offset`` (an int: ``f(arr, n)``, ``f(arr, 0, len(arr) - 1)``)."""

    target: int
    sized: int
    offset: int

    @property
    def positions(self) -> tuple[int, ...]:
        return self.target, self.sized

    def holds(self, args: tuple) -> bool:
        value, sized = args[self.target], args[self.sized]
        return is_int(value) and isinstance(sized, SIZED) and value == len(sized) + self.offset

    def mend(self, args: list, rng: random.Random) -> None:
        if is_int(args[self.target]) and isinstance(args[self.sized], SIZED):
            args[self.target] = len(args[self.sized]) + self.offset


@dataclass(frozen=True)
class SameLength:
    """``len(args[first]) == len(args[second]) + offset``."""

    first: int
    second: int
    offset: int

    @property
    def positions(self) -> tuple[int, ...]:
        return self.first, self.second

    def holds(self, args: tuple) -> bool:
        a, b = args[self.first], args[self.second]
        return isinstance(a, SIZED) and isinstance(b, SIZED) and len(a) == len(b) + self.offset

    def mend(self, args: list, rng: random.Random) -> None:
        a, b = args[self.first], args[self.second]
        if not (isinstance(a, SIZED) and isinstance(b, SIZED)):
            return
        if len(a) > len(b) + self.offset:  # the longer one is cut (never below nothing)
            args[self.first] = a[:max(len(b) + self.offset, 0)]
        else:
            args[self.second] = b[:max(len(a) - self.offset, 0)]


@dataclass(frozen=True)
class Distinct:
    """The items of ``args[position]`` (a list or tuple) all differ."""

    position: int

    @property
    def positions(self) -> tuple[int, ...]:
        return (self.position,)

    def holds(self, args: tuple) -> bool:
        value = args[self.position]
        if not isinstance(value, (list, tuple)):
            return False
        kept = _without_repeats(value)
        return kept is not None and len(kept) == len(value)

    def mend(self, args: list, rng: random.Random) -> None:
        """Its repeats dropped, the first of each kept (a list that ends shorter than every
        example's is then refused by :class:`MinLength`; one too long to compare is left, and fails)."""
        value = args[self.position]
        kept = _without_repeats(value) if isinstance(value, (list, tuple)) else None
        if kept is not None:
            args[self.position] = type(value)(kept)


@dataclass(frozen=True)
class MinLength:
    """``args[position]`` is at least as long as the shortest example's (a guard, mending nothing:
    the values that :class:`Distinct` and :class:`SameLength` shorten are not taken below it)."""

    position: int
    length: int

    @property
    def positions(self) -> tuple[int, ...]:
        return (self.position,)

    def holds(self, args: tuple) -> bool:
        value = args[self.position]
        return not isinstance(value, SIZED) or len(value) >= self.length

    def mend(self, args: list, rng: random.Random) -> None:
        pass


@dataclass(frozen=True)
class Shaped:
    """``args[position]`` is a sentence of one shape, numbers aside (``"5 apples and 6 oranges"``):
    ``words`` are the text around its numbers; ``largest`` the largest number an example holds."""

    position: int
    words: tuple[str, ...]
    largest: int

    @property
    def positions(self) -> tuple[int, ...]:
        return (self.position,)

    def holds(self, args: tuple) -> bool:
        value = args[self.position]
        return isinstance(value, str) and tuple(_NUMBER.split(value)) == self.words

    def mend(self, args: list, rng: random.Random) -> None:
        """A sentence of this shape, with numbers of the string it replaces where it has enough,
        else drawn up to half again the largest an example holds."""
        if not isinstance(args[self.position], str):
            return
        found = [int(n) for n in _NUMBER.findall(args[self.position]) if len(n) <= MAX_SHAPED_DIGITS]
        numbers = [found[i] if i < len(found) else rng.randint(0, self.largest + self.largest // 2 + 1)
                   for i in range(len(self.words) - 1)]
        pieces = [self.words[0]]
        for number, word in zip(numbers, self.words[1:]):
            pieces += [str(number), word]
        args[self.position] = "".join(pieces)


Relation = LengthIs | SameLength | Distinct | Shaped | MinLength


def _without_repeats(items: Sequence[Any]) -> list | None:
    """``items`` with each repeat dropped (the first kept), or None for more unhashable items than
    are compared pairwise."""
    try:
        return list(dict.fromkeys(items))
    except TypeError:  # unhashable items (lists): compared pairwise, where there are few
        if len(items) > MAX_PAIRWISE:
            return None
        kept: list = []
        for item in items:
            if all(item != other for other in kept):
                kept.append(item)
        return kept


def observed_relations(examples: Sequence[tuple]) -> tuple[Relation, ...]:
    """The relations every one of ``examples`` (argument tuples of one arity; at least two) holds."""
    arity = max((len(e) for e in examples), default=0)
    examples = [e for e in examples if len(e) == arity]
    if len(examples) < MIN_EXAMPLES or arity == 0:
        return ()
    found: list[Relation] = []
    positions = range(arity)

    def every(kind) -> bool:
        return all(kind.holds(e) for e in examples)

    shortened: set[int] = set()  # the positions a mending may shorten
    for position in positions:  # first, what mends one argument alone
        values = [e[position] for e in examples]
        # Items that differ in lists of one length may be a pair's or a point's fields that differ
        # by chance (HumanEval 52's four numbers): only lists of several lengths say "no repeats".
        if every(Distinct(position)) and sum(len(v) for v in values) >= 2 * MIN_EXAMPLES + 2 \
                and len({len(v) for v in values}) > 1:
            found.append(Distinct(position))
            shortened.add(position)
        if all(isinstance(v, str) for v in values):
            shapes = {tuple(_NUMBER.split(v)) for v in values}
            numbers = [n for v in values for n in _NUMBER.findall(v)]
            if len(shapes) == 1 and len(next(iter(shapes))) > 1 and any(c.isalpha() for c in values[0]) \
                    and all(len(n) <= MAX_SHAPED_DIGITS for n in numbers):  # (a sentence's counts, not a long number)
                found.append(Shaped(position, next(iter(shapes)), max(int(n) for n in numbers)))
    for first in positions:  # then lengths between arguments (a cut keeps items distinct)
        for second in positions:
            if first < second:
                offset = next((o for o in (0, -1, 1) if every(SameLength(first, second, o))), None)
                if offset is not None:
                    found.append(SameLength(first, second, offset))
                    shortened.update((first, second))
    found += [MinLength(position, min(len(e[position]) for e in examples)) for position in sorted(shortened)]
    for target in positions:  # last, ints set from the lengths those leave
        for sized in positions:
            offset = next((o for o in (0, -1) if sized != target and every(LengthIs(target, sized, o))), None)
            if offset is not None:
                found.append(LengthIs(target, sized, offset))
                break
    return tuple(found)


def conform(args: tuple, relations: Sequence[Relation], rng: random.Random) -> tuple | None:
    """``args`` mended to hold every relation, or None where that cannot be done (another type than
    the examples', relations that pull apart)."""
    if not relations:
        return args
    if len(args) <= max(max(r.positions) for r in relations):
        return None
    mended = list(args)
    for relation in relations:
        relation.mend(mended, rng)
    mended = tuple(mended)
    return mended if all(r.holds(mended) for r in relations) else None
