"""Reading the agent's turn (code blocks, pseudocode steps) and writing feedback about it.

Everything here turns agent text into data or data into text; nothing raises on bad text.
"""

from __future__ import annotations

import builtins
import re
from collections import Counter

from ...core.tags import UNCLOSED_FENCE
from .harness import BEFORE_TESTS

PYTHON_LANGUAGES = ("python", "py", "python3")
_STEP = re.compile(r"^\s*(?:step\s*)?(\d+)\s*[.):]\s*(.+?)\s*$", re.IGNORECASE)
MAX_SHOWN_CHARS = 300
MAX_KINDS_SHOWN = 4  # kinds of failure counted for a submission's hidden tests


CODE_IN_THINK = "the code is inside <think>, which is reasoning, not the submission; give it after </think>"


def extract_code(parsed, entry_point: str | None = None) -> tuple[str | None, str | None]:
    """The submitted code and what was wrong with the format (None when clean).

    The last closed python block counts; without one, the last closed block with no language.
    For a function task (``entry_point``), the last such block that defines the function: a
    solution followed by a block of example calls or tests is graded by the solution, as EvalPlus'
    sanitizer takes the code that defines the entry point. Blocks inside a closed ``<think>`` are
    drafts, never graded (a parse that looked for ``think`` tags knows them).
    """
    closed, drafts = [], []
    for block in parsed.code_blocks:
        if block.closed:
            (drafts if parsed.inside_closed(block, "think") else closed).append(block)
    python = [b for b in closed if b.language.lower() in PYTHON_LANGUAGES]
    bare = [b for b in closed if not b.language]
    chosen = python or bare
    problems = []
    if not chosen:
        if any(not b.closed for b in parsed.code_blocks):
            return None, UNCLOSED_FENCE
        if closed:
            return None, f"no python code block (found a ```{closed[-1].language} block)"
        return None, CODE_IN_THINK if drafts else "no fenced code block"
    graded = chosen[-1]
    if len(chosen) > 1:
        defining = [b for b in chosen if entry_point and _defines(b.code, entry_point)]
        if defining and defining[-1] is not graded:
            graded = defining[-1]
            problems.append(f"{len(chosen)} code blocks; the last one that defines {entry_point} was graded (the "
                            "blocks after it only use it)")
        else:
            problems.append(f"{len(chosen)} code blocks; the last one was graded")
    # A byte-order mark that an editor put first is no code (Python reads a file's as encoding).
    code = graded.code.lstrip("\ufeff")
    if not code.strip():
        return None, "the code block is empty"
    return code, "; ".join(problems) or None


def _defines(code: str, name: str) -> bool:
    """Whether ``code`` defines ``name`` at its top level (a def, an async def, a class or an
    assignment), read from its lines: code that does not parse may still be the submission."""
    pattern = rf"^(?:(?:async\s+)?def\s+{re.escape(name)}\s*\(|class\s+{re.escape(name)}\b|{re.escape(name)}\s*=[^=])"
    return re.search(pattern, code.lstrip("\ufeff"), re.MULTILINE) is not None


def stray_fence(parsed, text: str) -> str | None:
    """Why a reply's code block went unopened or unclosed, where a ``` that follows other text on
    its line ("Here it is: ```python", "return x```") is why: such a ``` is no fence. Said of the
    first one inside a block left unclosed (the closing fence meant), else of the first one outside
    every closed block; None where no block is missing or none is to blame."""
    if parsed.code_blocks and all(block.closed for block in parsed.code_blocks):
        return None
    closed = [(block.start, block.end) for block in parsed.code_blocks if block.closed]
    unclosed = [(block.start, block.end) for block in parsed.code_blocks if not block.closed]
    strays = []
    for mark in re.finditer(r"`{3,}", text):
        line_start = text.rfind("\n", 0, mark.start()) + 1
        before = text[line_start:mark.start()].strip()
        if before and not any(start <= mark.start() < end for start, end in closed):
            strays.append((mark.start(), before))
    meant = [stray for stray in strays if any(start <= stray[0] < end for start, end in unclosed)]
    if not strays:
        return None
    where, before = (meant or strays)[0]
    return (f"the ``` after {before[-20:]!r} (line {text.count(chr(10), 0, where) + 1}) is no code fence, as it does "
            "not start its line; put each ``` on a line of its own")


def parse_pseudocode(parsed, action: str) -> tuple[list[str], str | None]:
    """The numbered steps inside ``<pseudocode>`` and what was wrong (None when clean).

    As with code, a plan inside a closed ``<think>`` is a draft: the plan is what follows it.
    """
    closed = [t for t in parsed.find("pseudocode") if t.closed]
    blocks = [t for t in closed if not parsed.inside_closed(t, "think")]
    if not blocks:
        if closed:
            return [], "the <pseudocode> block is inside <think>, which is reasoning; give the plan after </think>"
        return [], "no <pseudocode>…</pseudocode> block"
    problems = []
    if len(blocks) > 1:
        problems.append("more than one <pseudocode> block; the last one was used")
    if any(not parsed.inside_closed(b, "think") for b in parsed.code_blocks):
        problems.append("code was written in the planning turn; it was ignored")
    steps = []
    for line in blocks[-1].text.splitlines():
        match = _STEP.match(line)
        if match:
            steps.append(match.group(2))
        elif line.strip() and steps:
            steps[-1] += " " + line.strip()  # a step continued on the next line
    if not steps:
        return [], "the <pseudocode> block has no numbered steps (write 1. ..., 2. ...)"
    return steps, "; ".join(problems) or None


def describe_failures(result, shown: int, attempts_left: int, format_error: str | None = None,
                      examples=None) -> str:
    """Feedback after a failing submission: the status, what was wrong with the reply's form
    (``format_error``, e.g. which of several code blocks was graded), up to ``shown`` of the task's
    own failing examples (input, expected, what the code gave: from ``examples``, their results in
    a run of their own, where given), and how many hidden tests failed and how, without their
    inputs or outputs (no test at all for a submission that failed before any test ran)."""
    plural = "s" if attempts_left != 1 else ""
    head = {
        "syntax_error": "Your code has a syntax error",
        "import_error": "Your code failed before any test ran",
        "missing_entry_point": "Your code does not define the required function",
        "timeout": "Your code ran out of time",
        "crashed": "Your code crashed",
    }.get(result.status, f"Your code passed {result.passed} of {result.total} tests")
    lines = [f"{head}. Fix it and submit the whole solution again ({attempts_left} attempt{plural} left)."]
    if format_error:
        lines.append(f"Note: {format_error}.")
    before_tests = result.status in BEFORE_TESTS
    # The task's own examples are shown: their expected outputs are in the prompt already. Of a
    # hidden test neither input nor output is: a later attempt could pass it from a table of what
    # feedback showed (an input that failed with "got False" answers True).
    failed = [] if before_tests else [r for r in result.results if not r.passed]
    shown_examples = failed if examples is None or before_tests else [r for r in examples if not r.passed]
    failing = [r for r in shown_examples if r.origin == "example"][:shown]
    for r in failing:
        outcome = f"error: {r.error}" if r.error else f"got: {r.got}"
        lines.append(f"- input: {_clip(r.input)}\n  expected: {_clip(r.expected)}\n  {_clip(outcome)}")
    hidden = [r for r in failed if r.origin != "example"] if shown else []
    if hidden:
        kinds = Counter(_failure_kind(r.error) for r in hidden).most_common()
        if len(kinds) > MAX_KINDS_SHOWN:  # the rest as one count, so that the counts add up
            kinds = kinds[:MAX_KINDS_SHOWN - 1] + [("other", sum(count for _, count in kinds[MAX_KINDS_SHOWN - 1:]))]
        said = ", ".join(f"{count} {kind}" for kind, count in kinds)
        lines.append(f"- {len(hidden)} hidden test{'s' if len(hidden) != 1 else ''} failed ({said}); their inputs and "
                     "outputs are not shown")
    detail = getattr(result, "message", None)
    if before_tests and not detail:  # the error is the same for every test: say it once
        detail = next((r.error for r in result.results if r.error), None)
    if detail and not (failing or hidden):
        lines.append(_clip(str(detail)))
    return "\n".join(lines)


# What the runner itself reports a test ended with, besides Python's own exceptions.
RUNNER_OUTCOMES = ("Timeout", "Skipped", "OutputTooLarge", "SystemExit")


def _failure_kind(error: str | None) -> str:
    """How a hidden test failed, in a word that tells nothing of its input or output: a wrong
    answer, a Python exception's name ("ValueError") or the runner's ("Timeout"); anything else,
    such as an exception class the code named itself (its name could spell the input), is "error"."""
    if not error:
        return "wrong answer"
    name = error.split(":", 1)[0].strip()
    builtin = getattr(builtins, name, None)
    known = name in RUNNER_OUTCOMES or (isinstance(builtin, type) and issubclass(builtin, BaseException))
    return name if known else "error"


def _clip(text) -> str:
    text = str(text)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + f"… ({len(text)} chars)"
