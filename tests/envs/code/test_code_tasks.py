"""Task types, the seeded generator, and the HumanEval/MBPP loaders (parsing of examples/asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rftgym.core.errors import ConfigError, DataFormatError
from rftgym.envs.code.datasets import load_humaneval, load_mbpp
from rftgym.envs.code.parsing import calls_with_literal_args, example_calls
from rftgym.envs.code.generator import TEMPLATES, generate_task, generate_tasks
from rftgym.envs.code.tasks import CodeTask, TestCase, args_source, call_source

# The shared data folder beside the checkout (CI puts ../shared there).
MBPP = str(Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "code" / "mbpp.jsonl")


def test_types_validate():
    with pytest.raises(ValueError, match="origin"):
        TestCase("(1,)", None, "bogus")
    with pytest.raises(ValueError, match="entry_point"):
        CodeTask("x", "unit", "function", "p", None, "")
    with pytest.raises(ValueError, match="style"):
        CodeTask("x", "unit", "web", "p", "f", "")
    assert args_source((1,)) == "(1,)" and args_source(([1], "a")) == "([1], 'a')" and args_source(()) == "()"
    assert call_source("f", "([1, 2], 3)") == "f([1, 2], 3)"


def test_generator_is_deterministic_and_covers_both_styles():
    a, b = generate_tasks(30, seed=7, difficulty=2), generate_tasks(30, seed=7, difficulty=2)
    assert a == b and [t.prompt for t in a] == [t.prompt for t in b]
    assert generate_tasks(30, seed=8, difficulty=2) != a
    assert len(TEMPLATES) >= 12 and {t.style for t in a} == {"function", "stdio"}
    assert len({t.task_id for t in a}) == 30
    task = generate_task(np.random.default_rng(0), "rotate", 1)
    assert task.entry_point == "rotate" and len(task.examples) == 2 and "rotate(" in task.prompt
    with pytest.raises(ConfigError, match="difficulty"):
        generate_task(np.random.default_rng(0), "rotate", 9)
    with pytest.raises(ConfigError, match="unknown task kind"):
        generate_task(np.random.default_rng(0), "nope", 1)


def test_merge_intervals_says_what_touching_means_and_its_reference_does_that():
    task = generate_task(np.random.default_rng(0), "merge_intervals", 2)
    assert "[1, 3] and [3, 5] merge into [1, 5]; [1, 3] and [4, 5] stay apart" in task.prompt
    namespace: dict = {}
    exec(task.reference, namespace)  # our own template's source
    merge = namespace["merge_intervals"]
    assert merge([[1, 3], [3, 5]]) == [[1, 5]] and merge([[1, 3], [4, 5]]) == [[1, 3], [4, 5]]


def test_parsing_calls_and_docstring_examples():
    check = "def check(candidate):\n    assert candidate([1, 2], 3) == 1\n    assert abs(candidate(-1.5, x) - 2) < 1e-6\n" \
            "    assert candidate(*args)\n    assert candidate('a)b', k=1)\n    assert candidate([1, 2], 3) == 1\n"
    assert calls_with_literal_args(check, ["candidate"]) == ["([1, 2], 3)"]
    doc = (">>> f([1, 2])\n3\nf('x') == 'y'\nf(3) ➞ True\nround(f([1.5, 2]), 2) # comment\n"
           "def f(x):\nalso f(a) with a name and f((1, 2), {'k': (3,)})")
    assert example_calls(doc, "f") == ["([1, 2],)", "('x',)", "(3,)", "([1.5, 2],)", "((1, 2), {'k': (3,)})"]


def test_humaneval_loader():
    tasks = load_humaneval()
    assert len(tasks) == 164 and len({t.task_id for t in tasks}) == 164
    first = tasks[0]
    assert first.entry_point == "has_close_elements" and first.reference.startswith(first.prompt.split("```python\n")[1][:20])
    assert first.examples[0].input == "([1.0, 2.0, 3.0], 0.5)" and first.examples[0].origin == "example"
    assert sum(t.origin == "dataset" for t in first.tests) == 7 and "def check(candidate)" in first.dataset_tests
    find_zero = tasks[32]
    assert "def poly" in find_zero.setup_code and "def find_zero" not in find_zero.setup_code


def test_mbpp_loader():
    tasks = load_mbpp(MBPP)
    assert len(tasks) == 974
    first = tasks[0]
    assert first.task_id == "mbpp/1" and first.entry_point == "min_cost" and "\r" not in first.reference
    assert "def min_cost(cost, m, n):" in first.prompt and "assert min_cost(" in first.prompt
    assert [t.origin for t in first.tests] == ["example", "dataset", "dataset"]
    assert first.tests[0].input == "([[1, 2, 3], [4, 8, 2], [1, 5, 3]], 2, 2)"


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"task_id": 1, "text": "t", "code": "def f(:", "test_list": ["assert f(1) == 1"]}', "field 'code'"),
    ('{"task_id": 1, "text": "t", "code": "def f(x): return x", "test_list": "assert f(1)"}', "field 'test_list'"),
    ('{"task_id": 1, "text": "t", "code": "def f(x): return x", "test_list": ["assert g(1) == 1"]}', "calls none"),
    ('{"task_id": 1, "code": "def f(x): return x", "test_list": ["assert f(1) == 1"]}', "field 'text'"),
    ('{"task_id": 1, "text": " ", "code": "def f(x): return x", "test_list": ["assert f(1) == 1"]}',
     "field 'text' is blank; it is the task's statement"),
    ('{"task_id": 1, "text": "t", "code": "def f(x): return x", "test_list": ["assert f(1) == 1"], '
     '"challenge_test_list": ["assert f(("]}', "field 'challenge_test_list' holds invalid Python"),
    # Tests are built and cached per id: a second task under an id would be graded with the first's.
    ('{"task_id": 0, "text": "u", "code": "def g(x): return -x", "test_list": ["assert g(1) == -1"]}',
     r"task_id 'mbpp/0' is already used at .*m\.jsonl:1; every task needs its own id"),
])
def test_mbpp_errors_name_file_line_and_field(tmp_path, line, message):
    good = json.dumps({"task_id": 0, "text": "t", "code": "def f(x):\r\n\treturn x", "test_list": ["assert f(1) == 1"],
                       "test_setup_code": "", "challenge_test_list": []})
    path = tmp_path / "m.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DataFormatError, match=rf"m\.jsonl:2: .*{message}"):
        load_mbpp(path)
    path.write_text(good + "\n")
    assert load_mbpp(path)[0].reference == "def f(x):\n\treturn x"
