"""Trivial answers (a constant, or one builtin on one argument) and how the TCG holds them down."""

from __future__ import annotations

import pytest

from rftgym.envs.code.codec import encode
from rftgym.envs.code.generator import TEMPLATES, generate_task
from rftgym.envs.code.harness import grade_many
from rftgym.envs.code.sandbox import make_sandbox
from rftgym.envs.code.tasks import CodeTask, TestCase, parse_args_source
from rftgym.envs.code.tcg import MAJORITY_SHARE, TCGConfig, _rebalanced, build_tests_many
from rftgym.envs.code.trivial import describe, one_step_programs, trivial_answers


def case(source: str, value, origin: str = "random") -> TestCase:
    return TestCase(source, encode(value), origin)


def test_trivial_answers_name_the_constant_and_each_one_step_answer_that_passes():
    assert trivial_answers(case("([3, 1, 2], 0)", [3, 1, 2])) == (("constant", encode([3, 1, 2])), ("echo", 0))
    assert trivial_answers(case("([3, 1, 2],)", [1, 2, 3])) == (("constant", encode([1, 2, 3])), ("sorted", 0))
    # 3 is the length, the maximum and the first element: all three, in the fixed order.
    assert trivial_answers(case("([3, 1, 2],)", 3)) == (("constant", encode(3)), ("len", 0), ("max", 0))
    assert trivial_answers(case("('abc', 'x')", "cba")) == (("constant", encode("cba")), ("reversed", 0))
    assert trivial_answers(case("([2, 5], 7)", 7)) == (("constant", encode(7)), ("echo", 1), ("sum", 0))
    # A builtin that does not apply (max of an empty list, len of an int) is no answer, not an error;
    # neither is an input that is not a literal tuple.
    assert trivial_answers(case("([], 4)", 0)) == (("constant", encode(0)), ("len", 0), ("sum", 0))
    assert trivial_answers(TestCase("(foo(),)", encode(1), "random")) == (("constant", encode(1)),)
    # Compared as the grader compares (Python's ==, floats within a tolerance): 1 passes for True,
    # 0.1 + 0.2 for 0.3, a tuple not for a list.
    assert ("echo", 0) in trivial_answers(case("(1,)", True))
    assert ("sum", 0) in trivial_answers(case("([0.1, 0.2],)", 0.3))
    assert ("echo", 0) not in trivial_answers(case("((1, 2),)", [1, 2]))


def test_an_answer_that_cannot_be_computed_or_written_out_is_no_answer():
    # sum of two 4,300-digit numbers has more digits than Python will write out as text (its
    # int-to-str limit): not an answer, and no error that would stop the suite's build.
    big = int("9" * 4300)
    answers = trivial_answers(case(f"([{big}, {big}, 3], 1)", big))
    assert ("max", 0) in answers and not any(name == "sum" for name, _ in answers)
    # Over a set, only order-free answers: max of {1, 'a'} raises or not with the set's order,
    # which string hashing sets per process.
    assert trivial_answers(case("({3, 1, 2},)", 3)) == (("constant", encode(3)), ("len", 0))


def test_trivial_answers_read_as_code():
    assert describe(("sorted", 1)) == "return sorted(args[1])"
    assert describe(("constant", '["b",false]')) == 'return <the constant ["b",false]>'
    programs = dict(one_step_programs("f", 2))
    assert "return args[1][::-1]" in programs and len(programs) == 14
    namespace: dict = {}
    exec(programs["return max(args[0])"], namespace)
    assert namespace["f"]([4, 9]) == 9 and namespace["f"]([]) is None  # guarded: None, not an error


def test_random_tests_an_echo_passes_are_dropped_down_to_the_majority_share():
    """A rotation whose random inputs mostly come back unchanged: 10 tests, the dataset's 2 (one
    unchanged) kept, and 7 of the 8 random ones unchanged. Random tests `return items` passes go,
    the last first, until it passes at most 60%: 3 of 5 (one dataset, two random) where it passed 8 of 10."""
    task = CodeTask("t-rot", "unit", "function", "", "rotate", "def rotate(xs, k):\n    return xs[k % len(xs):] + xs[:k % len(xs)]\n")
    tests = (case("([1, 2], 2)", [1, 2], "dataset"), case("([1, 2, 3], 1)", [2, 3, 1], "dataset"),
             *(case(f"([{n}, 9], {2 * n})", [n, 9]) for n in range(1, 7)),
             case("([4, 5, 6], 4)", [5, 6, 4]), case("([7, 8], 6)", [7, 8]))
    kept = _rebalanced(task, tests)
    assert [t.input for t in kept] == ["([1, 2], 2)", "([1, 2, 3], 1)", "([1, 9], 2)", "([2, 9], 4)", "([4, 5, 6], 4)"]
    assert sum(("echo", 0) in trivial_answers(t) for t in kept) == 3


def test_rebalancing_goes_on_to_the_answer_that_dominates_what_is_left():
    """f(s, k) answers 5, 0 or len(s). 17 random tests: 2 that neither `return 0` nor
    `return len(args[0])` passes (W), 3 only the len passes (Z), 8 both pass (X: s empty), 4 only 0
    passes (Y). 0 passes 12 of 17: the last Ys and one X go (7 of 12). Then len passes 10 of 12: Xs
    go, the last first, down to 3 of 5, where neither passes more than 60%. By hand: W W Z Z Z."""
    task = CodeTask("t-two", "unit", "function", "", "f", "def f(s, k):\n    return 5 if k in (2, 4) else 0 if k % 2 else len(s)\n")
    w = [case(f"('ab', {k})", 5) for k in (2, 4)]
    z = [case(f"('abc', {k})", 3) for k in (6, 8, 10)]
    x = [case(f"('', {k})", 0) for k in range(11, 19)]
    y = [case(f"('ab', {k})", 0) for k in (21, 23, 25, 27)]
    kept = _rebalanced(task, tuple(w + z + x + y))
    assert kept == tuple(w + z)
    # One round alone (as before the loop) would have left len passing 10 of 12.
    assert sum(("len", 0) in trivial_answers(t) for t in w + z + x[:7]) == 10


def test_an_answer_with_nothing_to_drop_does_not_stop_the_next_one_being_held_down():
    """22 tests: 8 edge tests that a constant, an echo and sorted all pass, 6 edge ones only the
    constant passes, 6 random ones the echo and sorted pass, 2 random ones nothing passes. The
    constant (14 of 22) has no random test to drop; the echo (14 of 22) then loses random tests,
    the last first, down to 60%: 12 of 20."""
    task = CodeTask("t-pair", "unit", "function", "", "f", "def f(xs, i):\n    return [1, 2] if i < 14 else xs if i < 40 else [0]\n")
    tests = ([case(repr(([1, 2], i)), [1, 2], "edge") for i in range(8)]
             + [case(repr(([5], i)), [1, 2], "edge") for i in range(8, 14)]
             + [case(repr(([k, k + 9], 20 + k)), [k, k + 9]) for k in range(10, 16)]
             + [case(repr(([k], 40 + k)), [0]) for k in range(20, 22)])
    kept = _rebalanced(task, tuple(tests))
    assert kept == tuple(tests[:18] + tests[20:])
    assert sum(("echo", 0) in trivial_answers(t) for t in kept) == 12 and len(kept) == 20


def test_an_answer_that_passes_every_test_does_not_hide_the_next_one():
    """f is len: `return len(args[0])` passes all 10 tests (it is the solution) and cannot be held
    down; `return 3` passes 8 and is, down to 60%: 3 of 5 (the last 3-letter words go)."""
    task = CodeTask("t-len", "unit", "function", "", "f", "def f(s):\n    return len(s)\n")
    tests = ([case("('hello',)", 5), case("('world',)", 5)]
             + [case(f"({word!r},)", 3) for word in ("abc", "def", "ghi", "jkl", "mno", "pqr", "stu", "vwx")])
    kept = _rebalanced(task, tuple(tests))
    assert [t.input for t in kept] == ["('hello',)", "('world',)", "('abc',)", "('def',)", "('ghi',)"]


@pytest.fixture(scope="module")
def sandbox():
    with make_sandbox() as box:
        yield box


def test_no_trivial_answer_passes_most_of_a_generated_task(sandbox, tmp_path):
    """Three tasks of every function-style generated template at the lowest difficulty (where inputs are smallest
    and rotations, intervals and k-th elements most often degenerate): no constant and no one-step
    answer passes more than MAJORITY_SHARE of its suite, and the reference passes it all."""
    import numpy as np

    rng = np.random.default_rng(11)
    tasks = [generate_task(rng, kind, 1) for kind in sorted(TEMPLATES) for _ in range(3)]
    tasks = [t for t in tasks if t.style == "function"]
    built = build_tests_many(tasks, TCGConfig(cache_dir=str(tmp_path)), sandbox)
    constants = ("False", "True", "0", "1", "[]", "''", "None", "{}")
    jobs, labels = [], []
    for task in built:
        assert len(task.tests) >= 10, task.task_id
        arity = len(parse_args_source(task.tests[0].input))
        programs = [(f"return {c}", f"def {task.entry_point}(*args, **kwargs):\n    return {c}\n") for c in constants]
        programs += one_step_programs(task.entry_point, arity) + [("reference", task.reference)]
        jobs += [(task, source) for _, source in programs]
        labels += [(task.entry_point, label) for label, _ in programs]
    results = grade_many(jobs, sandbox)
    too_much = {label: round(r.pass_rate, 2) for label, r in zip(labels, results)
                if label[1] != "reference" and r.pass_rate > MAJORITY_SHARE}
    assert not too_much
    assert all(r.pass_rate == 1.0 for label, r in zip(labels, results) if label[1] == "reference")


def test_trivial_answers_compare_as_the_task_grades():
    """Under a multiset comparison (a result in a set's order), echoing the argument passes where
    its items are the answer's in another order: the suite's check must see that as grading does."""
    test = TestCase("((3, 1, 2),)", encode((1, 2, 3)), "random")
    assert ("echo", 0) not in trivial_answers(test)
    assert ("sorted", 0) not in trivial_answers(test)   # a list, and the answer a tuple
    assert {("echo", 0), ("sorted", 0), ("reversed", 0)} <= set(trivial_answers(test, "multiset"))
