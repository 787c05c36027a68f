"""Mutation operators and the quality report."""

from __future__ import annotations

import pytest

from rftgym.envs.code.mutants import make_mutants, quality_report, summarize
from rftgym.envs.code.sandbox import make_sandbox
from rftgym.envs.code.tasks import CodeTask, TestCase
from rftgym.envs.code.tcg import TCGConfig, build_tests


def _bodies(source, entry="f"):
    return {m.split("\n", 1)[1].strip() for m in make_mutants(source, entry)}


@pytest.mark.parametrize("line, expected", [
    ("return a + b", {"return a - b"}),
    ("return a * b", {"return a + b", "return a // b"}),
    ("return a < b", {"return a <= b", "return a > b"}),
    ("return a == b", {"return a != b"}),
    ("return a and b", {"return a or b"}),
    ("return not a", {"return a"}),
    ("return a in b", {"return a not in b"}),
    ("return 0", {"return 1", "return -1"}),
    ("return list(range(a))", {"return list(range(a + 1))", "return list(range(a - 1))"}),
])
def test_each_operator(line, expected):
    assert _bodies(f"def f(a, b):\n    {line}\n") == expected


def test_mutants_are_distinct_compile_and_skip_other_functions_and_docstrings():
    source = 'def helper(x):\n    return x + 1\n\ndef f(a):\n    """doc 1"""\n    return helper(a) + 0\n'
    mutants = make_mutants(source, "f")
    assert len(mutants) == len(set(mutants)) == 3   # + -> -, 0 -> 1, 0 -> -1
    assert all("return x + 1" in m and "doc 1" in m for m in mutants)
    for m in mutants:
        compile(m, "m", "exec")
    assert len(make_mutants(source, "f", max_mutants=2)) == 2


def test_quality_report_kills_with_generated_tests(tmp_path):
    task = CodeTask("t-max", "unit", "function", "", "largest",
                    "def largest(xs: list) -> int:\n    best = xs[0]\n    for x in xs[1:]:\n"
                    "        if x > best:\n            best = x\n    return best\n",
                    examples=(TestCase("([1, 5, 3],)", None, "example"),))
    with make_sandbox() as sandbox:
        built = build_tests(task, TCGConfig(cache_dir=str(tmp_path)), sandbox)
        [row] = quality_report([built], sandbox)
    assert row.reference_pass_rate == 1.0 and row.mutants >= 5
    assert row.killed >= row.killed_dataset and row.killed > row.mutants // 2
    summary = summarize([row])
    assert summary["reference_pass_pct"] == 100.0 and summary["mutation_score_tcg_pct"] >= summary["mutation_score_dataset_pct"]
