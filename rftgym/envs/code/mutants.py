"""AST mutants of a reference solution and a test-suite quality report (mutation score).

Operators (one change per mutant): arithmetic swaps (``+``/``-``, ``*``->``+``/``//``, ``/``->``*``,
``//``->``/``, ``%``->``//``, ``**``->``*``, also in augmented assignments), comparison swaps
(``<``/``<=``, ``>``/``>=``, ``<``/``>``, ``==``/``!=``, ``in``/``not in``, ``is``/``is not``),
integer/float constants ±1 (so 0<->1 is included), ``and``/``or``, dropping a ``not``, and
off-by-one ``range`` bounds. Function-style tasks mutate only the entry point's body, so that
unreachable helpers do not make unkillable mutants. Mutants are deduplicated by unparsed source
and must compile.
"""

from __future__ import annotations

import ast
import copy
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from .harness import BEFORE_TESTS, grade_many
from .sandbox import Sandbox
from .tasks import CodeTask

_BINOP_SWAPS = {ast.Add: (ast.Sub,), ast.Sub: (ast.Add,), ast.Mult: (ast.Add, ast.FloorDiv), ast.Div: (ast.Mult,),
                ast.FloorDiv: (ast.Div,), ast.Mod: (ast.FloorDiv,), ast.Pow: (ast.Mult,)}
_CMP_SWAPS = {ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt,), ast.Gt: (ast.GtE, ast.Lt), ast.GtE: (ast.Gt,),
              ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.In: (ast.NotIn,), ast.NotIn: (ast.In,),
              ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,)}


def _sites(node: ast.AST) -> list[tuple[str, object]]:
    """The mutations applicable at ``node``: (operator name, argument)."""
    out: list[tuple[str, object]] = []
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        out += [("binop", new) for new in _BINOP_SWAPS.get(type(node.op), ())]
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            out += [("compare", (i, new)) for new in _CMP_SWAPS.get(type(op), ())]
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out += [("constant", +1), ("constant", -1)]
    elif isinstance(node, ast.BoolOp):
        out.append(("boolop", ast.Or if isinstance(node.op, ast.And) else ast.And))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("drop_not", None))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
          and 1 <= len(node.args) <= 3 and not node.keywords):
        stop = 0 if len(node.args) == 1 else 1
        out += [("range", (stop, +1)), ("range", (stop, -1))]
        if len(node.args) >= 2:
            out += [("range", (0, +1)), ("range", (0, -1))]
    return out


def _apply(node: ast.AST, parent: ast.AST | None, kind: str, arg) -> None:
    if kind == "binop":
        node.op = arg()
    elif kind == "compare":
        i, new = arg
        node.ops[i] = new()
    elif kind == "constant":
        node.value = node.value + arg
    elif kind == "boolop":
        node.op = arg()
    elif kind == "drop_not":
        _replace_child(parent, node, node.operand)
    elif kind == "range":
        i, delta = arg
        node.args[i] = ast.BinOp(node.args[i], ast.Add() if delta > 0 else ast.Sub(), ast.Constant(1))


def _replace_child(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for name, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, name, new)
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is old:
                    value[i] = new
                    return


def _walk_with_parents(root: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    stack: list[tuple[ast.AST, ast.AST | None]] = [(root, None)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        children = list(ast.iter_child_nodes(node))
        stack.extend((child, node) for child in reversed(children))


def _target(tree: ast.Module, entry_point: str | None) -> ast.AST:
    if entry_point:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == entry_point:
                return node
    return tree


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def make_mutants(source: str, entry_point: str | None = None, max_mutants: int | None = None,
                 seed: int = 0) -> list[str]:
    """Distinct, compilable single-change mutants of ``source`` (a random ``max_mutants`` of them
    if there are more, chosen by ``seed``)."""
    tree = ast.parse(source)
    original = ast.unparse(tree)
    target = _target(tree, entry_point)
    sites = [(index, kind, arg) for index, (node, parent) in enumerate(_walk_with_parents(target))
             for kind, arg in _sites(node) if not _is_docstring(node, parent)]
    mutants: dict[str, None] = {}
    for index, kind, arg in sites:
        clone = copy.deepcopy(tree)
        node, parent = list(_walk_with_parents(_target(clone, entry_point)))[index]
        _apply(node, parent, kind, arg)
        try:
            text = ast.unparse(ast.fix_missing_locations(clone))
            compile(text, "<mutant>", "exec")
        except (SyntaxError, ValueError, TypeError, RecursionError):
            continue
        if text != original:
            mutants.setdefault(text)
    out = list(mutants)
    if max_mutants is not None and len(out) > max_mutants:
        out = sorted(random.Random(seed).sample(out, max_mutants), key=out.index)
    return out


# ---------------------------------------------------------------- quality report

@dataclass(frozen=True)
class TaskQuality:
    task_id: str
    tests: int
    tests_by_origin: dict
    reference_pass_rate: float
    mutants: int
    killed: int            # by the whole suite
    killed_dataset: int    # by the example/dataset-derived tests alone

    @property
    def mutation_score(self) -> float:
        return self.killed / self.mutants if self.mutants else float("nan")

    @property
    def mutation_score_dataset(self) -> float:
        return self.killed_dataset / self.mutants if self.mutants else float("nan")


DATASET_ORIGINS = ("example", "dataset")


def _killed_by(result, subset: Sequence[int]) -> bool:
    if result.status in BEFORE_TESTS:
        return True
    return any(not result.results[i].passed for i in subset)


def quality_report(tasks: Sequence[CodeTask], sandbox: Sandbox, max_mutants: int = 20, seed: int = 0,
                   per_test_seconds: float = 0.5) -> list[TaskQuality]:
    """Per task (with tests built): the reference's pass rate on its tests, and how many mutants
    the whole suite and its dataset-derived part reject. The TCG puts dataset-derived tests first,
    so a mutant that hangs a later test is still judged on them."""
    items, owners, mutant_counts = [], [], []
    for t_index, task in enumerate(tasks):
        items.append((task, task.reference))
        owners.append(t_index)
        mutants = make_mutants(task.reference, task.entry_point if task.style == "function" else None,
                               max_mutants, seed)
        mutant_counts.append(len(mutants))
        items += [(task, m) for m in mutants]
        owners += [t_index] * len(mutants)
    # A mutant that hangs on one test is killed already; skipping its other tests saves minutes.
    results = grade_many(items, sandbox, per_test_seconds, max_timeouts=1)
    report = []
    cursor = 0
    for t_index, task in enumerate(tasks):
        ref, mutant_results = results[cursor], results[cursor + 1: cursor + 1 + mutant_counts[t_index]]
        cursor += 1 + mutant_counts[t_index]
        subset = [i for i, t in enumerate(task.tests) if t.origin in DATASET_ORIGINS]
        everything = list(range(len(task.tests)))
        origins: dict[str, int] = {}
        for test in task.tests:
            origins[test.origin] = origins.get(test.origin, 0) + 1
        report.append(TaskQuality(task.task_id, len(task.tests), origins, ref.pass_rate, mutant_counts[t_index],
                                  sum(_killed_by(r, everything) for r in mutant_results),
                                  sum(_killed_by(r, subset) for r in mutant_results)))
    return report


def summarize(report: Sequence[TaskQuality]) -> dict:
    """Aggregate figures: tasks, tests per task by origin, reference pass %, mutation scores."""
    n = len(report) or 1
    origins: dict[str, float] = {}
    for row in report:
        for origin, count in row.tests_by_origin.items():
            origins[origin] = origins.get(origin, 0) + count / n
    mutants = sum(r.mutants for r in report) or 1
    return {"tasks": len(report), "tests_per_task": sum(r.tests for r in report) / n,
            "tests_per_task_by_origin": {k: round(v, 2) for k, v in sorted(origins.items())},
            "reference_pass_pct": 100.0 * sum(r.reference_pass_rate == 1.0 for r in report) / n,
            "untestable_tasks": sum(r.tests == 0 for r in report),
            "mutants": sum(r.mutants for r in report),
            "mutation_score_dataset_pct": 100.0 * sum(r.killed_dataset for r in report) / mutants,
            "mutation_score_tcg_pct": 100.0 * sum(r.killed for r in report) / mutants}
