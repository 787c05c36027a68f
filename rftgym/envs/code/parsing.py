"""Extract test inputs from specs and dataset tests: calls with literal arguments.

``calls_with_literal_args`` finds ``f(...)`` calls in code (HumanEval's ``candidate(...)`` in
``check``, MBPP's asserts); ``example_calls`` finds them in a docstring (``>>> f(x)``,
``f(x) == y``, ``f(x) ➞ y``, prose). Arguments must be Python literals (``ast.literal_eval``);
calls with keywords, starred or computed arguments are skipped.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Iterable

from .tasks import UNPARSABLE, args_source


def literal_args(call: ast.Call) -> tuple | None:
    """The call's positional arguments as values, or None if any is not a literal."""
    if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    try:
        return tuple(ast.literal_eval(a) for a in call.args)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _callee(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def calls_with_literal_args(code: str, names: Iterable[str]) -> list[str]:
    """Input sources of the calls to ``names`` in ``code`` whose arguments are literals, in
    source order, deduplicated."""
    wanted = set(names)
    try:
        tree = ast.parse(code)
    except UNPARSABLE:
        return []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) in wanted]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    out: list[str] = []
    for call in calls:
        args = literal_args(call)
        if args is not None:
            source = args_source(args)
            if source not in out:
                out.append(source)
    return out


def stated_outputs(code: str, name: str) -> dict[str, Any]:
    """What the asserts ``assert name(literals) == literal`` (either side) in ``code`` say each call
    returns: input source -> value. Other asserts (a computed side, ``!=``, ``math.isclose``) are
    skipped; for an input stated twice the first counts."""
    try:
        tree = ast.parse(code)
    except UNPARSABLE:
        return {}
    stated: dict[str, Any] = {}
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.Assert) else None
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            continue
        for call, other in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
            if isinstance(call, ast.Call) and _callee(call) == name and (args := literal_args(call)) is not None:
                try:
                    stated.setdefault(args_source(args), ast.literal_eval(other))
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    pass
                break
    return stated


def _balanced_call(text: str, start: int) -> str | None:
    """The text from ``start`` (just after a name) through the matching ')', if balanced."""
    if start >= len(text) or text[start] != "(":
        return None
    depth, quote, i = 0, None, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
        i += 1
    return None


def example_calls(text: str, entry_point: str) -> list[str]:
    """Input sources of ``entry_point(...)`` calls written anywhere in ``text`` (not its def)."""
    out: list[str] = []
    for match in re.finditer(r"(?<![\w.])" + re.escape(entry_point) + r"\s*(?=\()", text):
        if re.search(r"def\s+$", text[:match.start()]):
            continue
        call_text = _balanced_call(text, match.end())
        if call_text is None:
            continue
        try:
            node = ast.parse(entry_point + call_text.replace("\n", " "), mode="eval").body
        except UNPARSABLE:
            continue
        if isinstance(node, ast.Call):
            args = literal_args(node)
            if args is not None and args_source(args) not in out:
                out.append(args_source(args))
    return out


def top_level_functions(code: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(code)
    except UNPARSABLE:
        return []
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def called_names(code: str) -> list[str]:
    """Names called in ``code``, in source order, deduplicated."""
    try:
        tree = ast.parse(code)
    except UNPARSABLE:
        return []
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n)),
                   key=lambda n: (n.lineno, n.col_offset))
    return list(dict.fromkeys(_callee(c) for c in calls))


def signature_of(code: str, name: str) -> str | None:
    """``def name(args) -> ret`` of the top-level function ``name`` in ``code``."""
    for fn in top_level_functions(code):
        if fn.name == name:
            returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
            return f"def {name}({ast.unparse(fn.args)}){returns}"
    return None
