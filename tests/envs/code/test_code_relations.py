"""Relations between arguments that every example shows, kept by generated inputs (.relations)."""

from __future__ import annotations

import random

from rftgym.envs.code.inputs import ValueModel
from rftgym.envs.code.relations import (Distinct, LengthIs, MinLength, SameLength, Shaped, conform,
                                        observed_relations)
from rftgym.envs.code.tasks import CodeTask, TestCase, args_source
from rftgym.envs.code.tcg import TCGConfig, candidate_inputs


def test_the_relations_every_example_holds_are_found():
    # MBPP's f(arr, n) with n == len(arr) in every assert; the items all differ (3 + 5 + 1 of them)
    # (and it is never shortened below the shortest example's length by dropping repeats)
    assert observed_relations([([1, 2, 3], 3), ([4, 5, 6, 7, 8], 5), ([9], 1)]) == \
        (Distinct(0), MinLength(0, 1), LengthIs(target=1, sized=0, offset=0))
    # f(arr, low, high) called with high == len(arr) - 1
    assert LengthIs(2, 0, -1) in observed_relations([([3, 1, 2], 0, 2), ([5, 4], 0, 1)])
    # HumanEval 160: len(operator) == len(operand) - 1; HumanEval 11: two strings of one length
    assert SameLength(0, 1, -1) in observed_relations([(["+", "*", "-"], [2, 3, 4, 5]), (["//", "*"], [7, 3, 4])])
    assert observed_relations([("010", "110"), ("1", "1"), ("0101", "0000")]) == \
        (SameLength(0, 1, 0), MinLength(0, 1), MinLength(1, 1))
    # HumanEval 67: one sentence shape around its numbers
    assert observed_relations([("5 apples and 6 oranges", 19), ("100 apples and 1 oranges", 120)]) == \
        (Shaped(0, ("", " apples and ", " oranges"), 100),)


def test_what_one_example_or_a_counterexample_shows_is_no_relation():
    assert observed_relations([([1, 2, 3], 3)]) == ()  # one example: no telling
    assert observed_relations([([1, 2, 3], 3), ([4, 5], 7)]) == ()  # n is another length once
    assert observed_relations([([1, 1, 2, 3], 9), ([4, 5, 6], 8)]) == ()  # a repeat: not "all different"
    assert observed_relations([([1, 2], 7), ([4, 3], 8)]) == ()  # too few items to say "all different"
    assert observed_relations([("5 apples", 1), ("5 pears", 2)]) == ()  # two shapes
    assert observed_relations([(True, [1]), (True, [2])]) == ()  # a bool is no length
    assert observed_relations([]) == ()
    # Items that differ in values of one length: a pair's fields (HumanEval 52's four numbers), not "no repeats"
    assert observed_relations([((1, 5),), ((2, 8),), ((3, 9),)]) == ()
    assert observed_relations([([1, 2, 3, 4], 5), ([9, 8, 7, 6], 5)]) == ()
    # A long number is no sentence's count (and int() of over 4,300 digits raises)
    assert observed_relations([("n=" + "9" * 5000,), ("n=" + "8" * 5000,)]) == ()


def test_inputs_are_mended_to_hold_them_or_dropped():
    rng = random.Random(0)
    relations = (Distinct(0), LengthIs(1, 0, 0))
    assert conform(([1, 1, 2, 5], 0), relations, rng) == ([1, 2, 5], 3)  # the repeat dropped, n set after
    assert conform(("ab", "c"), (SameLength(0, 1, 0),), rng) == ("a", "c")  # the longer one cut
    assert conform((["*", "+", "-"], [2]), (SameLength(0, 1, -1),), rng) == ([], [2])
    assert conform((["*"], [2, 3, 4]), (SameLength(0, 1, -1),), rng) == (["*"], [2, 3])
    shaped = Shaped(0, ("", " apples and ", " oranges"), 100)
    assert conform(("3 x 4", 19), (shaped,), rng) == ("3 apples and 4 oranges", 19)  # its numbers kept
    filled = conform(("g6lao", 2), (shaped,), rng)[0]
    assert filled.startswith("6 apples and ") and filled.endswith(" oranges")
    assert 0 <= int(filled.split()[3]) <= 151
    assert conform((5, 3), relations, rng) is None  # not a list: no mending makes it one
    # dropping repeats takes no value below the shortest example's length: such an input is dropped
    assert conform(([4, 4, 4], 3), (Distinct(0), MinLength(0, 2), LengthIs(1, 0, 0)), rng) is None
    assert conform(([4, 4, 5], 3), (Distinct(0), MinLength(0, 2), LengthIs(1, 0, 0)), rng) == ([4, 5], 2)
    many = [[i] for i in range(1000)] + [[0]]  # unhashable items, too many to compare pairwise: dropped
    assert conform((many,), (Distinct(0),), rng) is None
    assert conform(([[1], [2], [1]],), (Distinct(0),), rng) == ([[1], [2]],)
    assert conform(([1, 2],), relations, rng) is None  # too few arguments
    assert conform((1, 2), (), rng) == (1, 2)


def test_generated_inputs_keep_the_examples_relations(tmp_path):
    task = CodeTask("t-n-len", "unit", "function", "", "f", "def f(arr, n):\n    return max(arr[:n])\n",
                    examples=(TestCase("([3, 1, 2], 3)", None, "example"),),
                    tests=(TestCase("([5, 4, 9, 7], 4)", None, "dataset"), TestCase("([8, 6], 2)", None, "dataset")))
    candidates = candidate_inputs(task, TCGConfig(cache_dir=str(tmp_path), n_random=30, n_edge=10))
    generated = [eval(source) for source, origin in candidates if origin in ("edge", "random")]
    assert len(generated) >= 10
    assert all(n == len(arr) and len(set(arr)) == len(arr) for arr, n in generated), generated
    # an edge n (0, 1, ...) beside the first example's list is mended back to that example: none is left
    assert ([3, 1, 2], 3) not in generated


def test_operator_strings_are_drawn_from_those_seen_and_one_item_edges_need_an_example_of_one():
    model = ValueModel()
    for value in ("+", "**", "//"):
        model.observe(value)
    rng = random.Random(0)
    assert {model.sample(rng) for _ in range(40)} == {"+", "**", "//"} and model.edges() == ["**"]
    words = ValueModel()
    for value in ("ab", "+"):
        words.observe(value)
    assert words.tokens == []  # a word among them: strings of their characters, as before
    lists = ValueModel()
    for value in ([1, 2], [3, 4, 5]):
        lists.observe(value)
    assert lists.edges() == []  # neither [] nor [x]: every example had two items or more
    lists.observe([7])
    assert lists.edges() == [[lists.items.sample(random.Random(0))]]


def test_numbers_past_what_sampling_reads_are_no_crash(tmp_path):
    rng = random.Random(0)
    shaped = Shaped(0, ("", " apples and ", " oranges"), 6)
    mended = conform(("9" * 5000 + " apples and 1 oranges", 3), (shaped,), rng)  # (int() of it raises)
    assert mended is not None and shaped.holds(mended) and len(mended[0]) < 40
    # Examples beyond float range: their own tests, and no generated ones (the ranges overflowed).
    for values in ((10**400, 1), (-1e308, 1e308, 1)):
        examples = [args_source((v,)) for v in values]
        task = CodeTask("t-huge", "unit", "function", "", "f", "def f(x):\n    return x\n",
                        examples=tuple(TestCase(e, None, "example") for e in examples))
        assert [s for s, _ in candidate_inputs(task, TCGConfig(cache_dir=str(tmp_path)))][:len(examples)] == \
            examples
