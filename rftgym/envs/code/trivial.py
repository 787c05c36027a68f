"""Answers that need no solution: a constant, or one builtin applied to one argument.

A policy under training finds such an answer whenever it pays: ``return False`` where random
inputs to a predicate are mostly False, ``return items`` where most random rotations come back
to the start, ``return sorted(intervals)`` where random intervals rarely overlap. The TCG reads
which of them each test admits (:func:`trivial_answers`) and keeps any one from passing most of
a suite (see :mod:`.tcg`); ``benchmarks/tcg_quality.py`` grades the same answers in the sandbox.

The one-step answers are computed on the host, on the test's arguments as parsed literals (never
by running code from a task), and compared with the expected output as the grader compares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from .codec import encode, encoded_equal
from .tasks import TestCase, parse_args_source


@dataclass(frozen=True)
class OneStep:
    name: str
    template: str  # Python source with "{arg}" where the argument goes
    apply: Callable[[Any], Any]


def _reversed(value: Any) -> Any:
    return value[::-1]


ONE_STEP = (
    OneStep("echo", "{arg}", lambda value: value),
    OneStep("sorted", "sorted({arg})", sorted),
    OneStep("reversed", "{arg}[::-1]", _reversed),
    OneStep("len", "len({arg})", len),
    OneStep("max", "max({arg})", max),
    OneStep("min", "min({arg})", min),
    OneStep("sum", "sum({arg})", sum),
)
_BY_NAME = {step.name: step for step in ONE_STEP}
ORDER_FREE = ("echo", "len")  # the one-step answers whose value never depends on iteration order

# A trivial answer: ("constant", <encoded output>) or (<one-step name>, <argument index>).
TrivialAnswer = tuple[str, Any]


@functools.lru_cache(maxsize=4096)
def trivial_answers(test: TestCase, how: str = "exact") -> tuple[TrivialAnswer, ...]:
    """The trivial answers that pass the function-style ``test``, its output compared as ``how``
    (the task's ``compare_as``, as grading compares it): its expected output as a constant, then
    each one-step answer, in :data:`ONE_STEP` order (a fixed order, so that ties between them are
    broken the same way in every process). Cached: a suite's build asks for a test's answers in
    each rare-output round and in each rebalancing pass."""
    answers: list[TrivialAnswer] = [("constant", test.expected)]
    try:
        args = parse_args_source(test.input)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return tuple(answers)
    for step in ONE_STEP:
        for index, arg in enumerate(args):
            # Over a set or a dict, sorted/max/min/sum (and [::-1]) depend on the iteration order,
            # which string hashing sets per process: an answer there would make suites differ
            # between processes (max of {1, 'a'} raises or not).
            if isinstance(arg, (set, frozenset, dict)) and step.name not in ORDER_FREE:
                continue
            try:
                value = step.apply(arg)
                passes = encoded_equal(test.expected, encode(value), how=how)
            except Exception:  # noqa: BLE001 - len(3), max([]), sorted of mixed types; an int too long to
                continue  # write out (sum of 4,300-digit numbers): not an answer here
            if passes:
                answers.append((step.name, index))
    return tuple(answers)


def describe(answer: TrivialAnswer) -> str:
    """``answer`` as the code it stands for (for reports): ``return sorted(args[0])``."""
    kind, detail = answer
    if kind == "constant":
        return f"return <the constant {detail}>"
    return "return " + _BY_NAME[kind].template.format(arg=f"args[{detail}]")


def one_step_programs(entry_point: str, n_args: int) -> list[tuple[str, str]]:
    """``(description, source)`` of each one-step answer as a program taking ``n_args`` arguments
    (guarded, so that an argument it does not apply to returns None rather than raising)."""
    programs = []
    for step in ONE_STEP:
        for index in range(n_args):
            expression = step.template.format(arg=f"args[{index}]")
            source = (f"def {entry_point}(*args, **kwargs):\n    try:\n        return {expression}\n"
                      "    except Exception:\n        return None\n")
            programs.append((f"return {expression}", source))
    return programs
