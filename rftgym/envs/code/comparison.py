"""How a dataset task's outputs are compared: what its own asserts and its reference say.

The tests' expected outputs are the reference's (O1-CODER's test case generator), so an output
whose form the task leaves open would fail correct code if it were compared as Python's ``==``
compares: the order of a tuple the reference built from a set (MBPP 2, ``tuple(set(a) &
set(b))``: the order CPython's set happens to iterate in), or a list where the check reads
``tuple(candidate(x))`` (HumanEval 33). :func:`comparison_of` reads both sources:

- the dataset's asserts, when every one that compares the function's result wraps it alike:
  ``tuple(f(x))`` or ``list(f(x))`` compare as "sequence" (a list is a tuple's equal),
  ``sorted(f(x))`` as "multiset", ``set(f(x))`` as "set" (EvalPlus' MBPP+ writes its unordered
  tasks so);
- the reference: a function that returns a list or tuple made from a set's iteration (``tuple(S)``,
  ``list(S)``, a comprehension or ``map`` over ``S``, or a concatenation of such), where ``S`` is a
  set expression (``set(...)``, a set literal, ``&``, ``|``, ``-``, ``^`` or ``.intersection(...)``
  and its kin on a set, or a name bound to one), compares as "multiset"; a name put in order
  (``.sort()``, ``.reverse()``, ``sorted(...)``) and what functions nested in it return do not.

The asserts win where they say something. Anything else stays "exact". What this cannot see: a
task with several valid answers that no wrapper states (ties broken one way) still accepts only
the reference's; where a dataset's check asserts a property of the result instead of its value,
:data:`TASK_PROPERTIES` names the property a result is graded by (HumanEval 32, whose check takes
any zero of the polynomial, as EvalPlus grades it too).
"""

from __future__ import annotations

import ast
import math
from typing import Any, Callable

from .tasks import UNPARSABLE

_WRAPPER_COMPARISON = {"tuple": "sequence", "list": "sequence", "sorted": "multiset", "set": "set",
                       "frozenset": "set"}
_SET_METHODS = {"intersection", "union", "difference", "symmetric_difference"}
_SET_OPERATORS = (ast.BitAnd, ast.BitOr, ast.Sub, ast.BitXor)


def _is_a_zero_of_the_polynomial(args: tuple, got: Any) -> bool:
    """HumanEval 32 (``find_zero(xs)``): ``got`` is a real zero of the polynomial with coefficients
    ``xs`` (lowest first), as its check asserts: ``abs(poly(xs, x)) < 1e-4``."""
    if len(args) != 1 or not isinstance(args[0], (list, tuple)) or isinstance(got, bool) \
            or not isinstance(got, (int, float)):
        return False
    try:
        # As a float, as the check's math.pow takes it: a huge int overflows here at once, where
        # its exact powers would keep the host busy for minutes.
        x = float(got)
        value = math.fsum(coefficient * math.pow(x, power) for power, coefficient in enumerate(args[0]))
    except (OverflowError, TypeError, ValueError):
        return False
    return math.isfinite(value) and abs(value) < 1e-4


def _has_a_zero_as_promised(args: tuple) -> bool:
    """HumanEval 32's domain, as its docstring states it: an even number of coefficients, the
    largest (the last) not zero, which guarantees a real zero."""
    xs = args[0] if len(args) == 1 else None
    return isinstance(xs, (list, tuple)) and len(xs) % 2 == 0 and len(xs) > 0 and xs[-1] != 0


# Properties a result is graded by, in place of equality with the reference's (the expected
# value stays the reference's, shown in feedback), each with the inputs it is promised for (a
# generated test outside them is dropped); and the dataset tasks that take one.
PROPERTIES: dict[str, Callable[[tuple, Any], bool]] = {"zero_of_polynomial": _is_a_zero_of_the_polynomial}
DOMAINS: dict[str, Callable[[tuple], bool]] = {"zero_of_polynomial": _has_a_zero_as_promised}
TASK_PROPERTIES = {("humaneval", "HumanEval/32"): "zero_of_polynomial"}


def comparison_of(reference: str, entry_point: str, dataset_tests: str | None, *callees: str) -> str:
    """The comparison (:data:`~rftgym.envs.code.codec.COMPARISONS`) of a task whose function
    ``entry_point`` the ``reference`` defines and the ``dataset_tests`` call (by that name or as one
    of ``callees``, HumanEval's ``candidate``)."""
    stated = _stated_by_asserts(dataset_tests, {entry_point, *callees}) if dataset_tests else None
    if stated is not None:
        return stated
    return "multiset" if _returns_set_order(reference, entry_point) else "exact"


def _stated_by_asserts(code: str, names: set[str]) -> str | None:
    """The comparison every assert of ``code`` that compares a call of ``names`` states by wrapping
    it; None when there is none, or when they differ (one bare, one wrapped)."""
    try:
        tree = ast.parse(code)
    except UNPARSABLE:
        return None
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.ops[0], ast.Eq)):
            continue
        for side in (node.test.left, node.test.comparators[0]):
            if _calls(side, names):
                found.add("exact")
            elif (isinstance(side, ast.Call) and isinstance(side.func, ast.Name) and len(side.args) == 1
                  and not side.keywords and side.func.id in _WRAPPER_COMPARISON and _calls(side.args[0], names)):
                found.add(_WRAPPER_COMPARISON[side.func.id])
    return found.pop() if len(found) == 1 and found != {"exact"} else None


def _calls(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names


def _own_nodes(function: ast.AST):
    """The nodes of ``function``'s body, not those of the functions, lambdas and classes in it
    (another scope: what their code returns is not this function's result)."""
    def inner(node: ast.AST) -> list[ast.AST]:
        return [child for child in ast.iter_child_nodes(node)
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))]

    stack = inner(function)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(inner(node))


def _returns_set_order(reference: str, entry_point: str) -> bool:
    """Whether the reference's ``entry_point`` returns, anywhere, a list or tuple whose order is a
    set's iteration order."""
    try:
        tree = ast.parse(reference)
    except UNPARSABLE:
        return False
    function = next((node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.name == entry_point), None)
    if function is None:
        return False
    own = list(_own_nodes(function))
    # What each name is bound to (``name = value``; ``name += value`` as ``name + value``), and the
    # names put in order in place (``.sort()``, ``.reverse()``) or bound to a sorted copy: their
    # order is no set's, whatever they held before.
    bound: dict[str, list[ast.AST]] = {}
    ordered = set()
    for node in own:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(node.value)
                    if _calls(node.value, {"sorted", "reversed"}):
                        ordered.add(target.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and isinstance(node.op, ast.Add):
            name = node.target.id
            bound.setdefault(name, []).append(ast.BinOp(ast.Name(name, ast.Load()), ast.Add(), node.value))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("sort", "reverse") and isinstance(node.func.value, ast.Name)):
            ordered.add(node.func.value.id)

    def is_set(node: ast.AST, seen: frozenset = frozenset()) -> bool:
        if isinstance(node, (ast.Set, ast.SetComp)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return node.func.id in ("set", "frozenset")
        if isinstance(node, ast.BinOp) and isinstance(node.op, _SET_OPERATORS):
            return is_set(node.left, seen) or is_set(node.right, seen)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SET_METHODS:
            base = node.func.value
            return (isinstance(base, ast.Name) and base.id in ("set", "frozenset")) or is_set(base, seen)
        return named(node, seen, is_set)

    def in_set_order(node: ast.AST, seen: frozenset = frozenset()) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("tuple", "list") \
                and len(node.args) == 1:
            arg = node.args[0]
            return is_set(arg, seen) or iterates_a_set(arg, seen) or in_set_order(arg, seen)
        if isinstance(node, ast.ListComp):
            return is_set(node.generators[0].iter, seen)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return in_set_order(node.left, seen) or in_set_order(node.right, seen)
        return named(node, seen, in_set_order)

    def iterates_a_set(node: ast.AST, seen: frozenset) -> bool:
        if isinstance(node, ast.GeneratorExp):
            return is_set(node.generators[0].iter, seen)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("map", "filter") \
                and len(node.args) == 2:
            return is_set(node.args[1], seen)
        return False

    def named(node: ast.AST, seen: frozenset, test) -> bool:
        """A name one of whose bindings passes ``test`` (a first ``res = []`` aside), never put in order."""
        if not isinstance(node, ast.Name) or node.id not in bound or node.id in ordered or node.id in seen:
            return False
        return any(test(value, seen | {node.id}) for value in bound[node.id])

    return any(isinstance(node, ast.Return) and node.value is not None and in_set_order(node.value) for node in own)
