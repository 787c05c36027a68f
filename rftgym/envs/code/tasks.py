"""Code tasks: the :class:`CodeTask` and :class:`TestCase` types.

A task is either *function*-style (the agent writes ``entry_point``; a test's ``input`` is the
argument tuple as Python source, e.g. ``"([1, 2], 3)"``, and ``expected`` the return value in
the type-tagged encoding of :mod:`.codec`) or *stdio*-style (the agent writes a program that reads
stdin and prints; ``input`` is stdin text, ``expected`` stdout text).

Tasks come from datasets (:mod:`.datasets`) or from the seeded generator in :mod:`.generator`,
which needs no files.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass, field, replace
from typing import Callable

STYLES = ("function", "stdio")
ORIGINS = ("example", "dataset", "random", "edge", "llm")

# For generated tasks: ``sampler(rng) -> input`` draws one in-domain test input.
InputSampler = Callable[[random.Random], str]


@dataclass(frozen=True)
class TestCase:
    """One test. ``expected`` is None until the reference has been run on ``input`` (the TCG
    fills it); graded tests always have it."""

    __test__ = False  # not a pytest test class

    input: str
    expected: str | None
    origin: str = "dataset"

    def __post_init__(self) -> None:
        if self.origin not in ORIGINS:
            raise ValueError(f"TestCase origin must be one of {ORIGINS}, got {self.origin!r}")
        if not isinstance(self.input, str):
            raise TypeError(f"TestCase input must be str (argument-tuple source or stdin), got {type(self.input).__name__}")


@dataclass(frozen=True)
class CodeTask:
    """One programming problem with a reference solution.

    ``prompt`` is what the agent sees (spec, signature, examples). ``reference`` is a complete
    solution program (for function style it defines ``entry_point``). ``setup_code`` runs before
    the candidate's code in the same namespace (helpers the prompt defines, dataset setup).
    ``dataset_tests`` keeps the dataset's own assert/check code for an agreement check;
    ``challenge_tests`` the asserts a dataset gives besides those of its official check (MBPP's
    ``challenge_test_list``), whose inputs are among the tests and whose stated outputs are
    checked against the reference's.
    ``compare_as`` says how a function's returned value is compared with the reference's
    (:data:`~rftgym.envs.code.codec.COMPARISONS`; :mod:`~rftgym.envs.code.comparison` reads it
    off a dataset task's asserts and reference).
    """

    task_id: str
    source: str
    style: str
    prompt: str
    entry_point: str | None
    reference: str
    setup_code: str = ""
    examples: tuple[TestCase, ...] = ()
    tests: tuple[TestCase, ...] = ()
    dataset_tests: str | None = None
    challenge_tests: str = ""
    difficulty: int = 0
    input_sampler: InputSampler | None = field(default=None, compare=False, repr=False)
    compare_as: str = "exact"
    # A property the result is graded by instead (comparison.PROPERTIES), for a task whose check
    # accepts any result that has it; the reference's output stays the expected one shown.
    output_property: str | None = None

    def __post_init__(self) -> None:
        from .codec import COMPARISONS
        from .comparison import PROPERTIES

        if self.style not in STYLES:
            raise ValueError(f"CodeTask style must be one of {STYLES}, got {self.style!r}")
        if self.compare_as not in COMPARISONS:
            raise ValueError(f"CodeTask compare_as must be one of {COMPARISONS}, got {self.compare_as!r}")
        if self.output_property is not None and (self.output_property not in PROPERTIES or self.style != "function"):
            raise ValueError(f"CodeTask output_property must be None or, for a function-style task, one of "
                             f"{sorted(PROPERTIES)}, got {self.output_property!r}")
        if self.style == "function" and not self.entry_point:
            raise ValueError(f"function-style task {self.task_id!r} needs an entry_point")
        for name in ("examples", "tests"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    def with_tests(self, tests) -> "CodeTask":
        return replace(self, tests=tuple(tests))


def args_source(args: tuple) -> str:
    """The input source of a function-style test whose arguments are ``args`` (literals)."""
    if len(args) == 1:
        return f"({args[0]!r},)"
    return "(" + ", ".join(repr(a) for a in args) + ")"


# What parsing a text Python never ran may raise: a syntax error, a NUL byte (ValueError), or
# nesting past the parser's depth, "1+1+...+1" thousands long (RecursionError, MemoryError).
UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


def parse_args_source(source: str) -> tuple:
    """Host-side parse of a function-style input; raises ValueError if it is not a literal tuple."""
    value = ast.literal_eval(source)
    if not isinstance(value, tuple):
        raise ValueError(f"test input must be a tuple of arguments, got {source!r}")
    return value


def call_source(entry_point: str, input_source: str) -> str:
    """``f(a, b)`` for the input ``"(a, b)"`` (or ``f(*<input>)`` if it is not a tuple display)."""
    try:
        node = ast.parse(input_source, mode="eval").body
    except UNPARSABLE:
        node = None
    if isinstance(node, ast.Tuple):
        return f"{entry_point}({', '.join(ast.unparse(e) for e in node.elts)})"
    return f"{entry_point}(*{input_source})"

