"""How a task's outputs compare: relaxed only where its asserts or its reference's set order say so."""

from __future__ import annotations

from pathlib import Path

import pytest

from rftgym.envs.code.codec import encode, encoded_equal, equal_as
from rftgym.envs.code.comparison import comparison_of
from rftgym.envs.code.harness import grade
from rftgym.envs.code.tasks import CodeTask, TestCase

MBPP = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "code" / "mbpp.jsonl"


def test_exact_keeps_pythons_order_and_types():
    assert not equal_as((4, 5), (5, 4), "exact")
    assert not equal_as([1, 2], (1, 2), "exact")
    assert equal_as((0.1 + 0.2, 1), (0.3, 1), "exact")  # the float tolerance, as before


def test_sequence_makes_a_list_a_tuples_equal_and_keeps_order():
    assert equal_as([1, 2, 3], (1, 2, 3), "sequence")
    assert not equal_as([1, 2, 3], (3, 2, 1), "sequence")
    assert not equal_as([1, 2], (1, 2, 3), "sequence")
    assert not equal_as([1, 2], {1, 2}, "sequence")  # a set has no order to compare
    assert equal_as(5, 5, "sequence") and not equal_as(5, 5.5, "sequence")


def test_multiset_ignores_order_and_the_container_but_counts_each_item():
    assert equal_as((4, 5), (5, 4), "multiset")
    assert equal_as((4, 5), [5, 4], "multiset") and equal_as((4, 5), {5, 4}, "multiset")
    assert not equal_as((1, 1, 2), (1, 2, 2), "multiset")   # same members, other counts
    assert not equal_as((1, 2), (1, 2, 2), "multiset")
    assert not equal_as((4, 5), (4, 6), "multiset")
    # floats within the tolerance, out of order (0.1 + 0.2 is not 0.3 to the bit)
    assert equal_as([0.3, 1.0], [1.0, 0.1 + 0.2], "multiset")
    assert not equal_as([0.3, 1.0], [1.0, 0.31], "multiset")
    # nested values compare as values_equal does: a tuple inside is not a list
    assert not equal_as([(1, 2)], [[1, 2]], "multiset")


def test_a_long_unordered_output_must_match_item_for_item():
    long = list(range(1000))
    assert equal_as(long, long[::-1], "multiset")
    assert not equal_as([float(i) for i in long], [i + 1e-9 for i in long][::-1], "multiset")  # no search past 300
    assert equal_as([float(i) for i in long], [i + 1e-9 for i in long], "multiset")  # in order: as exact accepts
    assert equal_as([float(i) for i in long], [i + 1e-9 for i in long], "set")
    assert equal_as([float(i) for i in range(50)], [i + 1e-9 for i in range(50)][::-1], "multiset")


def test_an_objects_text_is_no_number_in_any_order():
    from rftgym.envs.code.codec import Opaque

    for how in ("multiset", "set"):
        assert not equal_as((4, 5), (Opaque("5"), Opaque("4")), how)
        assert equal_as((Opaque("<A>"), 1), [1, Opaque("<A>")], how)


def test_set_ignores_duplicates_too():
    assert equal_as((1, 1, 2), [2, 1], "set")
    assert not equal_as((1, 2), [1, 2, 3], "set")
    assert not equal_as((1, 2), [1], "set")
    assert equal_as([0.3, 0.3], [0.1 + 0.2], "set")
    # past 300 items, members must match exactly (no quadratic search on the host)
    long = list(range(1000))
    assert equal_as(long, long[::-1] + [5], "set")
    assert not equal_as([float(i) for i in long], [i + 1e-9 for i in long][::-1], "set")


def test_encoded_values_compare_the_same_way():
    assert encoded_equal(encode((4, 5)), encode((5, 4)), how="multiset")
    assert not encoded_equal(encode((4, 5)), encode((5, 4)))
    assert not encoded_equal(encode((4, 5)), None, how="multiset")


@pytest.mark.parametrize("asserts, comparison", [
    ("assert tuple(candidate([1, 2])) == tuple([1, 2])", "sequence"),
    ("assert list(f(3)) == [1, 2, 3]", "sequence"),
    ("assert sorted(f(3)) == [1, 2, 3]\nassert sorted(f(4)) == [1]", "multiset"),
    ("assert set(f(3)) == set((1, 2))", "set"),
    ("assert frozenset([1]) == frozenset(f(3))", "set"),
    # one bare comparison among wrapped ones: the asserts state nothing, so exact
    ("assert sorted(f(3)) == [1, 2, 3]\nassert f(4) == [1]", "exact"),
    ("assert f(3) == (1, 2)", "exact"),
    # another function's result wrapped says nothing of f's
    ("assert sorted(g(3)) == [1]", "exact"),
])
def test_the_asserts_wrapper_says_how_outputs_compare(asserts, comparison):
    assert comparison_of("def f(x):\n    return [x]\n", "f", asserts, "candidate") == comparison


@pytest.mark.parametrize("body, comparison", [
    ("res = tuple(set(a) & set(b))\n    return (res)", "multiset"),                 # MBPP 2
    ("return list(set.intersection(*map(set, a)))", "multiset"),                  # MBPP 111
    ("return (list(list(set(a)-set(b)) + list(set(b)-set(a))))", "multiset"),     # MBPP 769
    ("return tuple(set(a + b))", "multiset"),
    ("s = {x for x in a}\n    return [x * 2 for x in s]", "multiset"),
    ("return list(map(str, set(a).union(b)))", "multiset"),
    ("common = set(a).intersection(b)\n    out = list(common)\n    return out", "multiset"),
    ("return tuple(sorted(set(a) & set(b)))", "exact"),   # sorted: the order is stated
    ("return set(a) & set(b)", "exact"),                   # a set compares without order already
    ("return [x for x in a if x in set(b)]", "exact"),     # a's order, not the set's
    ("return list(a) + list(b)", "exact"),
    # put in order in place, or rebound to a sorted copy: no set's order is returned
    ("res = list(set(a))\n    res.sort()\n    return res", "exact"),
    ("res = list(set(a))\n    res.reverse()\n    return res", "exact"),
    ("s = set(a)\n    s = sorted(s)\n    return list(s)", "exact"),
    # a set's order on one branch, grown by concatenation, or after a first empty binding: still a set's
    ("res = tuple(set(a))\n    for x in b:\n        res = res + (x,)\n    return res", "multiset"),
    ("res = list(set(a))\n    res += list(b)\n    return res", "multiset"),
    ("res = []\n    if a:\n        res = list(set(a) & set(b))\n    return res", "multiset"),
    ("res = [x for x in a]\n    return res", "exact"),
    # what a function nested in it returns is not its result
    ("def g(c):\n        return list(set(c))\n    return sorted(g(a))", "exact"),
    ("g = lambda c: list(set(c))\n    return sorted(g(a))", "exact"),
])
def test_a_reference_that_returns_a_sets_order_compares_as_a_multiset(body, comparison):
    assert comparison_of(f"def f(a, b):\n    {body}\n", "f", "assert f((1, 2), (2, 3)) == (2,)") == comparison


def test_the_asserts_win_over_the_reference():
    reference = "def f(a, b):\n    return tuple(set(a) & set(b))\n"
    assert comparison_of(reference, "f", "assert set(f((1,), (1,))) == {1}") == "set"


def test_unreadable_code_compares_exactly():
    assert comparison_of("def f(:\n", "f", "assert (") == "exact"
    assert comparison_of("def g(a):\n    return tuple(set(a))\n", "f", None) == "exact"  # no such function


def test_a_task_refuses_an_unknown_comparison():
    with pytest.raises(ValueError, match="compare_as must be one of"):
        CodeTask(task_id="t", source="s", style="function", prompt="p", entry_point="f", reference="",
                 compare_as="sorted")


def test_mbpp_tasks_built_from_a_set_grade_another_order_as_correct_and_a_wrong_answer_as_wrong(sandbox):
    if not MBPP.exists():
        pytest.skip(f"MBPP file not found at {MBPP}")
    from rftgym.envs.code.datasets import load_mbpp

    tasks = {task.task_id: task for task in load_mbpp(MBPP)}
    assert tasks["mbpp/2"].compare_as == "multiset" and tasks["mbpp/3"].compare_as == "exact"
    task = tasks["mbpp/2"].with_tests([TestCase("((3, 16, 15, 4), (23, 16, 18, 4))", encode((16, 4)), "random")])
    sorted_order = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n"
    assert grade(task, sorted_order, sandbox).passed == 1
    one_missing = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))[:1]\n"
    assert grade(task, one_missing, sandbox).passed == 0


def test_humaneval_checks_that_wrap_the_result_in_tuple_accept_a_tuple():
    from rftgym.envs.code.datasets import load_humaneval

    comparisons = {task.task_id: task.compare_as for task in load_humaneval()}
    assert comparisons["HumanEval/33"] == comparisons["HumanEval/37"] == "sequence"
    assert comparisons["HumanEval/0"] == "exact"


def test_a_zero_of_the_polynomial_is_any_zero():
    from rftgym.envs.code.comparison import DOMAINS, PROPERTIES

    is_zero, promised = PROPERTIES["zero_of_polynomial"], DOMAINS["zero_of_polynomial"]
    cubic = ([-6, 11, -6, 1],)  # (x - 1)(x - 2)(x - 3)
    assert is_zero(cubic, 1.0) and is_zero(cubic, 3) and is_zero(cubic, 2.00000001)
    assert not is_zero(cubic, 2.5) and not is_zero(cubic, 2.001)   # |p(2.001)| = 0.001
    assert not any(is_zero(cubic, bad) for bad in (True, float("inf"), float("nan"), "1", None, [1.0], 1e200))
    # a huge int is a float that overflows, not thousands of exact powers worked out on the host
    assert not is_zero(([1] + [0] * 2998 + [1],), 10**307) and not is_zero(([1, 1],), 10**400)
    assert not is_zero(([float("inf"), float("-inf")],), 1.0)
    assert promised(([1, 2],)) and promised(([-6, 11, -6, 1],))
    assert not promised(([1, 2, 3],)) and not promised(([1, 0],)) and not promised(([],))


def test_humaneval_32_passes_any_zero_and_builds_tests_in_its_domain(sandbox, tmp_path):
    from rftgym.envs.code.datasets import load_humaneval
    from rftgym.envs.code.tasks import parse_args_source
    from rftgym.envs.code.tcg import TCGConfig, build_tests

    task = next(t for t in load_humaneval() if t.task_id == "HumanEval/32")
    assert task.output_property == "zero_of_polynomial"
    one = task.with_tests([TestCase("([-6, 11, -6, 1],)", encode(1.0), "random")])
    returns = "def find_zero(xs):\n    return {}\n"
    assert grade(one, returns.format(3.0), sandbox).passed == 1       # another zero than the reference's
    assert grade(one, returns.format(2.5), sandbox).passed == 0
    built = build_tests(task, TCGConfig(cache_dir=str(tmp_path)), sandbox)
    assert len(built.tests) >= 5
    assert all(len(parse_args_source(t.input)[0]) % 2 == 0 for t in built.tests)  # no odd coefficient counts
    assert grade(built, task.reference, sandbox).pass_rate == 1.0
