"""A seeded generator of small programming tasks with reference solutions (no files needed).

Each template draws its parameters (a base, a shift, a word property, ...) from the seed and
ships an input sampler, so the TCG can make in-domain tests. ``difficulty`` (1-3) scales input
sizes. Examples in the prompt are computed on the host by running our own reference.
Same seed, same tasks.

Samplers are module-level functions bound to their parameters with :func:`functools.partial`
(never closures or lambdas), so that a task, and an env holding one, pickles: a worker pool or
Gymnasium's async vector env sends them to other processes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import random
import string
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...core.errors import ConfigError
from .codec import encode
from .tasks import CodeTask, InputSampler, TestCase, args_source, call_source

DIFFICULTIES = (1, 2, 3)


@dataclass(frozen=True)
class _Spec:
    style: str
    entry_point: str | None  # None for stdio
    signature: str | None
    description: str
    reference: str
    sampler: InputSampler


def _ints(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


# ---------------------------------------------------------------- function-style templates

def _digit_sum(rng: random.Random, d: int) -> _Spec:
    base = rng.choice([2, 3, 5, 7, 8, 9, 16])
    ref = ("def digit_sum(n: int) -> int:\n    total = 0\n    while n > 0:\n"
           f"        total += n % {base}\n        n //= {base}\n    return total\n")
    return _Spec("function", "digit_sum", "def digit_sum(n: int) -> int",
                 f"Return the sum of the digits of the non-negative integer n written in base {base}.",
                 ref, functools.partial(_sample_digit_sum, d))


def _sample_digit_sum(d: int, r: random.Random) -> str:
    return args_source((r.randint(0, 10 ** (2 + 2 * d)),))


def _run_length(rng: random.Random, d: int) -> _Spec:
    alphabet = "".join(rng.sample("abcxyz", 2 + d))
    ref = ("def run_length(s: str) -> str:\n    out = []\n    i = 0\n    while i < len(s):\n"
           "        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
           "        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n")
    return _Spec("function", "run_length", "def run_length(s: str) -> str",
                 "Run-length encode s: each maximal run of k equal characters c becomes c followed by k "
                 "(e.g. 'aaab' -> 'a3b1'). The empty string encodes to ''.", ref,
                 functools.partial(_sample_run_length, alphabet, d))


def _sample_run_length(alphabet: str, d: int, r: random.Random) -> str:
    return args_source(("".join(r.choice(alphabet) * r.randint(1, 3 + 2 * d) for _ in range(r.randint(0, 3 + 2 * d))),))


def _kth_largest(rng: random.Random, d: int) -> _Spec:
    ref = "def kth_largest(nums: list, k: int) -> int:\n    return sorted(nums, reverse=True)[k - 1]\n"
    return _Spec("function", "kth_largest", "def kth_largest(nums: list, k: int) -> int",
                 "Return the k-th largest element of the non-empty list nums (k = 1 is the maximum; "
                 "duplicates count separately; 1 <= k <= len(nums)).", ref, functools.partial(_sample_kth_largest, d))


def _sample_kth_largest(d: int, r: random.Random) -> str:
    # Mostly two or more numbers: on one, k = 1 and max(nums) or min(nums) would pass.
    nums = _ints(r, r.randint(2, 4 + 4 * d) if r.random() < 0.9 else 1, -10 * d, 10 * d)
    return args_source((nums, r.randint(1, len(nums))))


def _rotate(rng: random.Random, d: int) -> _Spec:
    right = rng.random() < 0.5
    word = "right" if right else "left"
    body = "items[-k:] + items[:-k]" if right else "items[k:] + items[:k]"
    ref = ("def rotate(items: list, k: int) -> list:\n    if not items:\n        return []\n"
           f"    k %= len(items)\n    return {body}\n")
    return _Spec("function", "rotate", "def rotate(items: list, k: int) -> list",
                 f"Return a new list: items rotated {word} by k positions (k >= 0 may exceed the length; "
                 "an empty list gives []).", ref, functools.partial(_sample_rotate, d))


def _sample_rotate(d: int, r: random.Random) -> str:
    # Mostly a rotation that moves the items: with k a multiple of the length, or under two items,
    # the list comes back as it was and `return items` would pass.
    n = r.randint(2, 3 + 3 * d) if r.random() < 0.85 else r.randint(0, 1)
    turns = n * r.randint(0, d)
    k = turns + r.randint(1, n - 1) if n >= 2 and r.random() < 0.85 else turns
    return args_source((_ints(r, n, 0, 20), k))


def _brackets(rng: random.Random, d: int) -> _Spec:
    pairs = "()" if d == 1 else rng.choice(["()[]", "()[]{}"])
    opens, closes = pairs[0::2], pairs[1::2]
    ref = (f"def balanced(s: str) -> bool:\n    match = {dict(zip(closes, opens))!r}\n    stack = []\n"
           "    for ch in s:\n        if ch in match.values():\n            stack.append(ch)\n"
           "        elif ch in match:\n            if not stack or stack.pop() != match[ch]:\n"
           "                return False\n    return not stack\n")
    return _Spec("function", "balanced", "def balanced(s: str) -> bool",
                 f"s consists only of the characters {pairs!r}. Return True if every bracket is closed by "
                 "a bracket of the same kind in the right order, else False.", ref,
                 functools.partial(_sample_brackets, opens, closes, d))


def _sample_brackets(opens: str, closes: str, d: int, r: random.Random) -> str:
    s, depth = [], []
    for _ in range(r.randint(0, 4 + 4 * d)):
        if depth and r.random() < 0.5:
            s.append(closes[opens.index(depth.pop())] if r.random() < 0.85 else r.choice(closes))
        else:
            depth.append(r.choice(opens))
            s.append(depth[-1])
    if r.random() < 0.5:
        s.extend(closes[opens.index(o)] for o in reversed(depth))
    return args_source(("".join(s),))


def _merge_intervals(rng: random.Random, d: int) -> _Spec:
    ref = ("def merge_intervals(intervals: list) -> list:\n    out = []\n"
           "    for start, end in sorted(intervals):\n        if out and start <= out[-1][1]:\n"
           "            out[-1][1] = max(out[-1][1], end)\n        else:\n            out.append([start, end])\n"
           "    return out\n")
    return _Spec("function", "merge_intervals", "def merge_intervals(intervals: list) -> list",
                 "intervals is a list of [start, end] pairs with start <= end. Merge intervals that overlap or "
                 "share an endpoint ([1, 3] and [3, 5] merge into [1, 5]; [1, 3] and [4, 5] stay apart) and "
                 "return the merged [start, end] lists sorted by start.", ref,
                 functools.partial(_sample_merge_intervals, d))


def _sample_merge_intervals(d: int, r: random.Random) -> str:
    spans = []
    # Mostly two or more intervals, starting close enough for most lists to hold an overlap:
    # else sorted(intervals) would pass.
    for _ in range(r.randint(2, 2 + 2 * d) if r.random() < 0.85 else r.randint(0, 1)):
        a = r.randint(0, 8 * d)
        spans.append([a, a + r.randint(0, 5 * d)])
    return args_source((spans,))


def _collatz(rng: random.Random, d: int) -> _Spec:
    peak = rng.random() < 0.5
    what = "the largest value reached (n itself included)" if peak else "the number of steps until n becomes 1"
    ref = ("def collatz(n: int) -> int:\n    steps, top = 0, n\n    while n != 1:\n"
           "        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        steps += 1\n        top = max(top, n)\n"
           f"    return {'top' if peak else 'steps'}\n")
    return _Spec("function", "collatz", "def collatz(n: int) -> int",
                 f"Starting from n >= 1, repeatedly replace n by n // 2 if n is even, else by 3 * n + 1, until "
                 f"n is 1. Return {what}.", ref, functools.partial(_sample_collatz, d))


def _sample_collatz(d: int, r: random.Random) -> str:
    return args_source((r.randint(1, 10 ** (1 + d)),))


def _second_smallest(rng: random.Random, d: int) -> _Spec:
    ref = ("def second_smallest(nums: list):\n    values = sorted(set(nums))\n"
           "    return values[1] if len(values) > 1 else None\n")
    return _Spec("function", "second_smallest", "def second_smallest(nums: list)",
                 "Return the second smallest distinct value in nums, or None if there is none.", ref,
                 functools.partial(_sample_second_smallest, d))


def _sample_second_smallest(d: int, r: random.Random) -> str:
    return args_source((_ints(r, r.randint(0, 3 + 3 * d), -5 * d, 5 * d),))


def _word_scores(rng: random.Random, d: int) -> _Spec:
    ref = ("def word_scores(text: str) -> dict:\n    scores = {}\n    for word in text.split():\n"
           "        scores[word] = scores.get(word, 0) + sum(ord(c) - 96 for c in word)\n    return scores\n")
    return _Spec("function", "word_scores", "def word_scores(text: str) -> dict",
                 "text holds lowercase words separated by spaces. A word's score is the sum of its letters' "
                 "positions in the alphabet (a=1). Return a dict from each distinct word to its score times "
                 "the number of times it occurs.", ref, functools.partial(_sample_word_scores, d))


def _sample_word_scores(d: int, r: random.Random) -> str:
    words = ["".join(r.choice("abcde") for _ in range(r.randint(1, 2 + d))) for _ in range(r.randint(0, 3 + 2 * d))]
    return args_source((" ".join(words),))


# ---------------------------------------------------------------- stdio templates

def _caesar(rng: random.Random, d: int) -> _Spec:
    k = rng.randint(1, 25)
    ref = ("import sys\nk = %d\nout = []\nfor ch in sys.stdin.read().rstrip('\\n'):\n"
           "    if 'a' <= ch <= 'z':\n        out.append(chr((ord(ch) - 97 + k) %% 26 + 97))\n"
           "    elif 'A' <= ch <= 'Z':\n        out.append(chr((ord(ch) - 65 + k) %% 26 + 65))\n"
           "    else:\n        out.append(ch)\nprint(''.join(out))\n") % k
    return _Spec("stdio", None, None,
                 f"Read one line of text from standard input and print it with every letter shifted {k} places "
                 "forward in the alphabet (wrapping around, keeping case); other characters stay.", ref,
                 functools.partial(_sample_caesar, d))


def _sample_caesar(d: int, r: random.Random) -> str:
    return "".join(r.choice(string.ascii_letters + "  ,.!") for _ in range(r.randint(1, 10 * d))) + "\n"


def _count_words(rng: random.Random, d: int) -> _Spec:
    length = rng.randint(3, 5)
    prop, test = rng.choice([
        ("start with a vowel", "w[0] in 'aeiou'"),
        (f"have at least {length} letters", f"len(w) >= {length}"),
        ("are palindromes", "w == w[::-1]"),
    ])
    ref = f"import sys\nwords = sys.stdin.read().split()\nprint(sum(1 for w in words if {test}))\n"
    return _Spec("stdio", None, None,
                 f"Standard input holds lowercase words separated by spaces and newlines. Print how many words {prop}.",
                 ref, functools.partial(_sample_count_words, d))


def _sample_count_words(d: int, r: random.Random) -> str:
    lines = [" ".join("".join(r.choice("abeio") for _ in range(r.randint(1, 6)))
                      for _ in range(r.randint(0, 5 * d))) for _ in range(r.randint(1, d + 1))]
    return "\n".join(lines) + "\n"


def _sum_multiples(rng: random.Random, d: int) -> _Spec:
    a, b = rng.sample([2, 3, 5, 7], 2)
    ref = (f"t = int(input())\nfor _ in range(t):\n    n = int(input())\n"
           f"    print(sum(x for x in range(n) if x % {a} == 0 or x % {b} == 0))\n")
    return _Spec("stdio", None, None,
                 f"The first line holds T; each of the next T lines holds an integer n >= 0. For each n print the "
                 f"sum of the integers 0 <= x < n divisible by {a} or by {b}.", ref,
                 functools.partial(_sample_sum_multiples, d))


def _sample_sum_multiples(d: int, r: random.Random) -> str:
    ns = _ints(r, r.randint(1, 2 + d), 0, 10 ** (1 + d))
    return f"{len(ns)}\n" + "".join(f"{n}\n" for n in ns)


def _row_sums(rng: random.Random, d: int) -> _Spec:
    ref = ("r, c = map(int, input().split())\nrows = [list(map(int, input().split())) for _ in range(r)]\n"
           "print(*[sum(row) for row in rows])\nprint(max(sum(col) for col in zip(*rows)))\n")
    return _Spec("stdio", None, None,
                 "The first line holds r and c; then r lines of c integers. Print the r row sums on one line "
                 "separated by spaces, then on a second line the largest column sum.", ref,
                 functools.partial(_sample_row_sums, d))


def _sample_row_sums(d: int, r: random.Random) -> str:
    nr, nc = r.randint(1, 2 + d), r.randint(1, 2 + d)
    rows = [" ".join(map(str, _ints(r, nc, -9 * d, 9 * d))) for _ in range(nr)]
    return f"{nr} {nc}\n" + "\n".join(rows) + "\n"


def _running_max(rng: random.Random, d: int) -> _Spec:
    ref = ("n = int(input())\nvalues = list(map(int, input().split())) if n else []\nout, best = [], None\n"
           "for v in values:\n    best = v if best is None or v > best else best\n    out.append(best)\n"
           "print(' '.join(map(str, out)))\n")
    return _Spec("stdio", None, None,
                 "The first line holds n >= 1; the second n integers. Print the running maximum "
                 "(the maximum of the first i values, for i = 1..n) separated by spaces.", ref,
                 functools.partial(_sample_running_max, d))


def _sample_running_max(d: int, r: random.Random) -> str:
    vals = _ints(r, r.randint(1, 4 + 4 * d), -20 * d, 20 * d)
    return f"{len(vals)}\n{' '.join(map(str, vals))}\n"


def _fizz(rng: random.Random, d: int) -> _Spec:
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    wa, wb = rng.sample(["Fizz", "Buzz", "Bang", "Pop", "Zap"], 2)
    ref = (f"n = int(input())\nfor i in range(1, n + 1):\n    word = ('{wa}' if i % {a} == 0 else '') + "
           f"('{wb}' if i % {b} == 0 else '')\n    print(word or i)\n")
    return _Spec("stdio", None, None,
                 f"Read n >= 0 and print the numbers 1..n, one per line, but print '{wa}' for multiples of {a}, "
                 f"'{wb}' for multiples of {b}, and '{wa}{wb}' for multiples of both.", ref,
                 functools.partial(_sample_fizz, d))


def _sample_fizz(d: int, r: random.Random) -> str:
    return f"{r.randint(0, 10 * d)}\n"


TEMPLATES: dict[str, Callable[[random.Random, int], _Spec]] = {
    "digit_sum": _digit_sum, "run_length": _run_length, "kth_largest": _kth_largest, "rotate": _rotate,
    "brackets": _brackets, "merge_intervals": _merge_intervals, "collatz": _collatz,
    "second_smallest": _second_smallest, "word_scores": _word_scores,
    "caesar": _caesar, "count_words": _count_words, "sum_multiples": _sum_multiples,
    "row_sums": _row_sums, "running_max": _running_max, "fizz": _fizz,
}


# ---------------------------------------------------------------- host-side reference runs

def run_reference_on_host(spec_style: str, reference: str, entry_point: str | None, test_input: str) -> str:
    """Expected output of OUR generator's reference (trusted code) for the prompt's examples."""
    namespace: dict = {"__name__": "__main__"}
    if spec_style == "function":
        exec(compile(reference, "<reference>", "exec"), namespace)  # our own template source
        return encode(namespace[entry_point](*eval(test_input, {})))  # input made by our sampler
    stdin, stdout = sys.stdin, io.StringIO()
    try:
        sys.stdin = io.StringIO(test_input)
        with contextlib.redirect_stdout(stdout):
            exec(compile(reference, "<reference>", "exec"), namespace)  # our own template source
    finally:
        sys.stdin = stdin
    return stdout.getvalue()


def _prompt(spec: _Spec, examples: tuple[TestCase, ...]) -> str:
    from .codec import display

    if spec.style == "function":
        lines = [f"Write a Python function with this signature:\n\n    {spec.signature}\n", spec.description, "", "Examples:"]
        for ex in examples:
            lines.append(f"    {call_source(spec.entry_point, ex.input)} == {display(ex.expected, 400)}")
        return "\n".join(lines)
    lines = ["Write a Python program that reads standard input and prints to standard output.", "",
             spec.description, ""]
    for i, ex in enumerate(examples, 1):
        lines += [f"Example {i} input:", "```", ex.input.rstrip("\n"), "```", f"Example {i} output:", "```",
                  ex.expected.rstrip("\n"), "```"]
    return "\n".join(lines)


def generate_task(rng: np.random.Generator, kind: str | None = None, difficulty: int = 1, n_examples: int = 2) -> CodeTask:
    """One task of template ``kind`` (random if None) drawn from ``rng`` (e.g. an env's np_random)."""
    if difficulty not in DIFFICULTIES:
        raise ConfigError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    names = sorted(TEMPLATES)
    if kind is None:
        kind = names[int(rng.integers(len(names)))]
    if kind not in TEMPLATES:
        raise ConfigError(f"unknown task kind {kind!r}; choose from {names}")
    serial = int(rng.integers(0, 2**31))
    local = random.Random(serial)
    spec = TEMPLATES[kind](local, difficulty)
    examples: list[TestCase] = []
    seen: set[str] = set()
    for _ in range(10 * n_examples):
        if len(examples) == n_examples:
            break
        test_input = spec.sampler(local)
        if test_input in seen:
            continue
        seen.add(test_input)
        expected = run_reference_on_host(spec.style, spec.reference, spec.entry_point, test_input)
        examples.append(TestCase(test_input, expected, "example"))
    examples_t = tuple(examples)
    return CodeTask(task_id=f"gen-{kind}-d{difficulty}-{serial:08x}", source="generated", style=spec.style,
                    prompt=_prompt(spec, examples_t), entry_point=spec.entry_point, reference=spec.reference,
                    examples=examples_t, tests=examples_t, difficulty=difficulty, input_sampler=spec.sampler)


def generate_tasks(n: int, seed: int = 0, difficulty: int = 1, kinds: tuple[str, ...] | None = None) -> list[CodeTask]:
    """``n`` tasks from ``seed``, cycling through ``kinds`` (all templates by default)."""
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}")
    kinds = tuple(kinds) if kinds else tuple(sorted(TEMPLATES))
    for kind in kinds:
        if kind not in TEMPLATES:
            raise ConfigError(f"unknown task kind {kind!r}; choose from {sorted(TEMPLATES)}")
    rng = np.random.default_rng(seed)
    return [generate_task(rng, kinds[i % len(kinds)], difficulty) for i in range(n)]
