"""VerifiableQA tasks: seeded generators, answer checking, and the JSONL loader."""

from __future__ import annotations

import json
import re
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from rftgym.core.errors import DataFormatError
from rftgym.envs.verifiable.grading import LETTERS, is_correct, normalize_text, parse_number
from rftgym.envs.verifiable.tasks import COMPARISON_SIZES, DIFFICULTIES, GENERATORS, Task, generate_task, load_tasks_jsonl

SEEDS = range(250)  # enough to hit choices like "4.5" and "4/5" that read alike without punctuation
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def all_tasks():
    for kind in GENERATORS:
        for difficulty in DIFFICULTIES:
            for seed in SEEDS:
                yield generate_task(np.random.default_rng(seed), kind, difficulty)


TASKS = list(all_tasks())


# ---------------------------------------------------------------- generators

def test_every_kind_and_difficulty_is_generated():
    assert {(t.kind, t.difficulty) for t in TASKS} == {(k, d) for k in GENERATORS for d in DIFFICULTIES}
    for t in TASKS:
        assert t.id.startswith(f"{t.kind}-d{t.difficulty}-")
        assert t.question.strip() and t.answer.strip()


def test_the_reference_answer_is_judged_correct():
    wrong = [t for t in TASKS if not is_correct(t, t.answer)]
    assert wrong == []


def test_multiple_choice_letters_work_and_other_choices_are_wrong():
    mc = [t for t in TASKS if t.choices]
    assert {t.kind for t in mc} == {"sequence", "weekday", "comparison"}
    for t in mc:
        letter = t.answer_letter
        assert t.choices[LETTERS.index(letter)] == t.answer
        for spelled in (letter, letter.lower(), f"({letter})", f"{letter}.", f"{letter})", f"({letter}) {t.answer}",
                        f"{letter}: {t.answer}", f" {t.answer} "):
            assert is_correct(t, spelled), (t, spelled)
        for i, choice in enumerate(t.choices):
            if choice != t.answer:
                assert not is_correct(t, choice), (t, choice)
                assert not is_correct(t, LETTERS[i]), (t, LETTERS[i])
                # the right letter with a wrong choice's text is ambiguous, hence wrong
                assert not is_correct(t, f"({letter}) {choice}"), (t, choice)


def test_choices_are_unique_and_distractors_differ_from_the_answer():
    for t in (t for t in TASKS if t.choices):
        assert len(set(t.choices)) == len(t.choices), t
        assert t.choices.count(t.answer) == 1, t
        expected = COMPARISON_SIZES[t.difficulty] if t.kind == "comparison" else 4
        assert len(t.choices) == expected, t


def test_prompt_lists_the_choices_with_letters():
    t = next(t for t in TASKS if t.choices)
    lines = t.prompt().splitlines()
    assert lines[0] == t.question and lines[1] == ""
    assert lines[2:] == [f"({LETTERS[i]}) {c}" for i, c in enumerate(t.choices)]
    free = next(t for t in TASKS if not t.choices)
    assert free.prompt() == free.question and free.answer_letter is None


def test_arithmetic_answers_are_the_value_of_the_expression():
    for t in (t for t in TASKS if t.kind == "arithmetic"):
        expression = re.fullmatch(r"Compute (.+)\.", t.question).group(1)
        assert re.fullmatch(r"[\d+\-* ()]+", expression)
        assert int(t.answer) == eval(expression)  # digits and operators only, checked above
        assert expression.count(" ") >= 2 * t.difficulty  # difficulty + 1 operands


def test_word_problem_answers_follow_the_story():
    for t in (t for t in TASKS if t.kind == "word_problem"):
        count = int(re.search(r"has (\d+) ", t.question).group(1))
        for sentence in re.findall(r"Then [^.]+\.", t.question):
            if m := re.search(r"gets (\d+) more", sentence):
                count += int(m.group(1))
            elif m := re.search(r"gives away (\d+)", sentence):
                count -= int(m.group(1))
            elif m := re.search(r"multiplied by (\d+)", sentence):
                count *= int(m.group(1))
        assert int(t.answer) == count > 0
        assert len(re.findall(r"Then ", t.question)) == t.difficulty


def test_sequence_answers_continue_the_sequence():
    for t in (t for t in TASKS if t.kind == "sequence"):
        shown = [int(x) for x in re.search(r"next: (.+), \.\.\.\?", t.question).group(1).split(", ")]
        assert len(shown) >= 4
        diffs = {b - a for a, b in zip(shown, shown[1:])}
        if len(diffs) == 1:
            expected = shown[-1] + diffs.pop()
        else:
            ratios = {Fraction(b, a) for a, b in zip(shown, shown[1:])}
            assert len(ratios) == 1, t
            expected = shown[-1] * ratios.pop()
        assert int(t.answer) == expected, t


def test_the_answer_of_a_sequence_question_is_at_no_fixed_rank_among_its_choices():
    # The distractors were nxt-1, nxt+1, nxt+2: the answer was always the second smallest.
    rng = np.random.default_rng(0)
    ranks = Counter()
    for difficulty in DIFFICULTIES:
        for _ in range(200):
            task = generate_task(rng, "sequence", difficulty)
            assert len(set(task.choices)) == 4 and task.answer in task.choices, task
            ranks[sorted(task.choices, key=int).index(task.answer)] += 1
    # Drawn uniformly (it was up to 41% the smallest when the step could be 2 and no choice lay at or
    # below the last term: few numbers lay between it and the answer).
    assert set(ranks) == {0, 1, 2, 3} and min(ranks.values()) > 0.2 * 1000 and max(ranks.values()) < 0.3 * 1000, ranks


def test_the_distances_between_a_sequence_questions_choices_do_not_give_its_answer_away():
    # The distractors were the answer +-1, 2, 3 or the step: the answer was the choice all others lay
    # near, found by either guess below up to 78% of the time where chance is 25%.
    for difficulty in DIFFICULTIES:
        near, hub, smallest_above = 0, 0, 0
        for seed in range(400):
            task = generate_task(np.random.default_rng(seed), "sequence", difficulty)
            shown = [int(x) for x in re.search(r"next: (.+), \.\.\.\?", task.question).group(1).split(", ")]
            choices, answer = [int(c) for c in task.choices], int(task.answer)
            guess = np.random.default_rng(seed + 1)
            closeness = {c: sum(0 < abs(c - other) <= 3 for other in choices) for c in choices}
            most = [c for c in choices if closeness[c] == max(closeness.values())]
            near += most[guess.integers(len(most))] == answer
            offsets = {1, 2, 3, shown[1] - shown[0]}
            hubs = [c for c in choices if all(abs(c - other) in offsets for other in choices if other != c)] or choices
            hub += hubs[guess.integers(len(hubs))] == answer
            # Every choice lies above the last term shown (one at or below it is ruled out at a glance).
            assert min(choices) > shown[-1], task
            above = sorted(c for c in choices if c > shown[-1])
            smallest_above += above[0] == answer
        assert near / 400 < 0.33 and hub / 400 < 0.33, (difficulty, near / 400, hub / 400)
        # "The smallest choice above the last term" is no better than chance (it was right 47% of the
        # time at difficulty 1).
        assert smallest_above / 400 < 0.32, (difficulty, smallest_above / 400)


def test_weekday_answers_count_the_days():
    for t in (t for t in TASKS if t.kind == "weekday"):
        m = re.fullmatch(r"Today is (\w+)\. What day of the week is it (\d+) days? (after|before) today\?", t.question)
        assert m, t.question
        today, offset, direction = DAYS.index(m.group(1)), int(m.group(2)), m.group(3)
        assert t.answer == DAYS[(today + (offset if direction == "after" else -offset)) % 7]
        assert set(t.choices) <= set(DAYS)


def test_comparison_answers_are_the_extreme_value():
    for t in (t for t in TASKS if t.kind == "comparison"):
        values = {c: Fraction(c) for c in t.choices}
        assert len(set(values.values())) == len(values), t  # no two choices with the same value
        pick = max if "largest" in t.question else min
        assert t.answer == pick(values, key=values.get), t


def test_comparison_choices_are_no_rounding_apart():
    # 1/7 beside 0.143 (its rounding) asked which way the rounding went
    for seed in range(3000):
        rng = np.random.default_rng(seed)
        task = generate_task(rng, "comparison", 3 + seed % 3)
        values = sorted(Fraction(c) for c in task.choices)
        assert all(b - a > Fraction(1, 1000) for a, b in zip(values, values[1:])), (seed, task.choices)


def test_comparison_difficulties_differ():
    # Difficulties 3-5 once drew the same numbers for the same seed.
    for seed in range(10):
        tasks = [generate_task(np.random.default_rng(seed), "comparison", d) for d in range(1, 6)]
        assert len({t.choices for t in tasks}) == 5, tasks
        assert [len(t.choices) for t in tasks] == [COMPARISON_SIZES[d] for d in range(1, 6)]
    hardest = [generate_task(np.random.default_rng(s), "comparison", 5) for s in range(30)]
    assert any(Fraction(c) < 0 for t in hardest for c in t.choices)  # signed at 5
    assert all(abs(Fraction(c)) <= 2 for t in hardest for c in t.choices)  # and close together


def test_generation_is_deterministic_under_the_seed():
    for kind in GENERATORS:
        a = generate_task(np.random.default_rng(123), kind, 3)
        b = generate_task(np.random.default_rng(123), kind, 3)
        assert a == b
        ids = {generate_task(np.random.default_rng(s), kind, 3).id for s in range(20)}
        assert len(ids) == 20


def test_generate_task_rejects_unknown_kind_and_difficulty():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unknown task kind 'poetry'; choose from"):
        generate_task(rng, "poetry", 1)
    for bad in (0, 6):
        with pytest.raises(ValueError, match=r"difficulty must be one of \(1, 2, 3, 4, 5\)"):
            generate_task(rng, "arithmetic", bad)


# ---------------------------------------------------------------- answer checking

def free(answer: str) -> Task:
    return Task("t", "q?", answer)


@pytest.mark.parametrize("answer, given, ok", [
    ("1234", "1,234", True),
    ("1234", "1234", True),
    ("1234", "1234.0", True),
    ("1234", "1 234", False),          # two numbers
    ("1234", "12,34", False),          # not a thousands separator
    ("1234567", "1,234,567", True),
    ("12", "x = 12", True),
    ("12", "x = 12.", True),
    ("12", "The answer is 12 apples", True),
    ("12", "12 or 13", False),
    ("12", "12, 13", False),
    ("12", "", False),
    ("12", "twelve", False),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("-5", "+5", False),
    ("0.75", "3/4", True),
    ("3/4", "0.75", True),
    ("3/4", ".75", True),
    ("3/4", "6/8", True),
    ("3/4", "4/3", False),
    ("3/4", "3/0", False),             # no exception on a zero denominator
    ("12", "1e309", False),
    ("12", "NaN", False),
    ("12", "9" * 5000, False),         # beyond int's digit limit: not an exception
    ("Paris", "paris", True),
    ("Paris", "The Paris.", True),
    ("Paris", "Lyon", False),
    ("H2O", "CO2", False),             # the same number with other words names something else
    ("Apollo 11", "Gemini 11", False),
    ("Apollo 11", "apollo 11.", True),
    ("x = 12", "12", True),            # a quantity: its number alone states it, or with the same words
    ("$18", "18.00", True),
    ("12 apples", "12", True),
    ("12 apples", "12 pears", False),
    ("50%", "50.0", True),
    ("3,000 m", "3000", True),
    ("1.5 hours", "It takes 1.5 hours.", False),  # other words
    ("2", "CO2", False),               # digits inside a word are no number of their own
    ("2", "m2", False),
    ("12 m2", "12", True),             # nor in the unit of a quantity
    ("44 g of CO2", "44", True),
    ("-5", "\u22125", True),           # a minus sign
    ("11", "The answer is 11.", True),
    ("-2", "- 2", True),               # a sign spaced from its number, where no operator can stand
    ("-2", "x = - 2", True),
    ("2", "7 - 5", False),             # an expression is no answer
    ("-2", "5 - 2", False),
    ("Tuesday", "\\boxed{Tuesday}", True),  # the markup a model puts around an answer
    ("Tuesday", "**Tuesday**", True),
    ("Tuesday", "$\\text{Tuesday}$", True),
    ("Tuesday", "The answer is Tuesday", True),
    ("Tuesday", "\\boxed{Monday}", False),
    ("-5", "$\\boxed{-5}$", True),
    ("Paris", "`Paris`", True),
    ("-5", "$- 5$", True),             # one reply is right for one sign only (it was for both)
    ("5", "$- 5$", False),
    ("-5", "The answer is \u2212 5", True),
    ("5", "The answer is \u2212 5", False),
    ("5", "The answer is - 5", False),  # the prefix does not eat a spaced minus
    ("-5", "Answer - 5", True),
    # a number is read whole or not at all: the match never backs off a digit glued to a letter
    ("12", "120cm", False), ("1", "12cm", False), ("3", "30cm", False), ("23", "m123", False),
    ("1.5", "1.5e3", False), ("1", "5e-1", False), ("14", "v3.14", False), ("3", "1.2.3", False),
    ("-3", "\u20133", True), ("3", "\u20133", False),  # an en dash written for a minus is one
    ("-3", "\u2014 3", True), ("3", "Answer\u20143", True),  # so is an em dash, where no word stands before it
    ("3", "3\u20135", False),  # a range is no answer
    ("5", "not 5", False), ("5", "It isn't 5", False), ("5", "never equal to 5", False),  # a denied number
    ("5", "Not sure, but 5", True), ("5", "No. 5", True), ("12", "12 (no remainder)", True),  # no denial of it
    ("5", "x = 5, none left over", True), ("5", "nothing but 5", True),
    ("not 5", "not 5", True),  # an answer that denies is said by denying
    # a quantity's number compares by value: dropping punctuation made these the same text
    ("$3.50", "350", False), ("$3.50", "$350", False), ("$3.50", "3.50", True), ("3.5 kg", "35 kg", False),
    ("-5 degrees", "5 degrees", False), ("x = -3", "x = 3", False), ("-3 m/s", "3 m/s", False),
    ("12.5%", "125%", False), ("1/2 cup", "12 cup", False), ("2.5 hours", "25 hours", False),
    # words that give the number a sign, a scale or a bound
    ("3", "minus 3", False), ("3", "negative 3", False), ("3", "3 below zero", False),
    ("-3", "minus 3", True), ("-3", "Negative 3", True), ("-42", "--42", False), ("-42", "-(-42)", False),
    ("100", "100 thousand", False), ("5", "less than 5", False), ("5", "at least 5", False),
    ("5", "5 or more", False), ("5", "over 5", False), ("at least 5", "at least 5", True),
    # a number denied after it, and hedges that deny nothing
    ("42", "42 is wrong", False), ("42", "42 is not right", False), ("42", "42 isn't it", False),
    ("42", "I'm not sure but 42", True), ("42", "I don't know, but 42", True), ("12", "12 is correct", True),
    ("12", "12 is the right answer", True), ("12", "13 is the right answer", False),
    # a bare number states a quantity whose other words are a unit or a name, not one that a symbol
    # or a bound makes another value
    ("\\sqrt{3}", "3", False), ("\u03c0/2", "2", False), ("\\pi/2", "2", False), ("e^2", "2", False),
    ("(-\\infty, 2)", "2", False), ("x > 2", "2", False), ("5 below zero", "5", False), ("5!", "5", False),
    ("(-\\infty, 2)", "[2, \\infty)", False),
    ("-3 m/s", "-3", True), ("12 light-years", "12", True), ("-5 \u00b0C", "-5", True), ("x = 5", "5", True),
    # text compares with its operators, relations and the separators between digits
    ("x+1", "x-1", False), ("a-b", "a+b", False), ("-\\infty", "\\infty", False), ("10^6", "106", False),
    ("(1,2)", "12", False), ("3 - 2i", "3 + 2i", False), ("x > 2", "x < 2", False), ("12:30", "1230", False),
    ("2^10", "210", False), ("(1, 2]", "(1, 2)", False), ("x > 2", "x > 2", True), ("x+1", "x + 1", True),
    ("Paris", "(Paris)", True), ("x+1", "(x+1)", True), ("12:30", "12:30", True),
    # a relation, a function or a scale of the number, written in symbols or words
    ("42", "sqrt(42)", False), ("42", "\u221a42", False), ("42", "42 squared", False), ("42", "42 cubed", False),
    ("42", "log 42", False), ("42", "42 hundredths", False), ("2", "x^2", False), ("42", "< 42", False),
    ("42", "> 42", False), ("42", "\u2264 42", False), ("42", ">= 42", False), ("42", "42+", False),
    ("42", "\u2260 42", False), ("42", "!= 42", False), ("42", "\\neq 42", False),
    # a denial around markup, in "cannot", or by a word after or before the number
    ("42", "It cannot be 42", False), ("42", "**not** 42", False), ("42", "not **42**", False),
    ("42", "not (42)", False), ("42", "not \\boxed{42}", False), ("42", "42 (incorrect)", False),
    ("42", "42 \u2014 wrong", False), ("42", "wrong: 42", False), ("42", "**42**", True), ("7", "3 + 4 = 7", False),
    # LaTeX for a plain number
    ("-11/6", "-\\frac{11}{6}", True), ("-11/6", "\\frac{-11}{6}", True), ("-11/6", "$\\boxed{-\\frac{11}{6}}$", True),
    ("0.5", "\\dfrac{1}{2}", True), ("\\frac{1}{2}", "0.5", True), ("11/6", "-\\frac{11}{6}", False),
    ("12345", "12{,}345", True), ("12345", "\\boxed{12{,}345}", True), ("12345", "12\\,345", True),
    ("1234", "12{,}34", False),
])
def test_is_correct_on_free_answers(answer, given, ok):
    assert is_correct(free(answer), given) is ok


def test_normalize_text():
    assert normalize_text("  The U.S.A., an   Answer!\n") == "usa answer"
    assert normalize_text("A") == ""


@pytest.mark.parametrize("text, value", [
    ("1,234", Fraction(1234)), ("-3.5", Fraction(-7, 2)), ("3/4", Fraction(3, 4)), ("x = 12.", Fraction(12)),
    ("-.5", Fraction(-1, 2)), ("1 and 2", None), ("none", None), ("5/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def mc(answer: str, *choices: str) -> Task:
    return Task("t", "q?", answer, tuple(choices))


@pytest.mark.parametrize("given, ok", [
    ("B", True), ("b", True), ("(B)", True), ("( B )", True), ("B.", True), ("B:", True), ("(B) 42", True),
    ("B) 42", True), ("B 42.", True), ("42", True), (" 42 ", True), ("42.0", True),
    ("(B) 17", False),     # the right letter with the text of another choice
    ("(C) 42", False),     # the wrong letter with the right text
    ("A", False), ("17", False), ("(Z)", False), ("E", False), ("B or C", False), ("", False),
    ("**B**", True), ("\\boxed{B}", True), ("Option B", True), ("option (B)", True), ("Choice: B", True),
    ("The answer is B", True), ("The answer is: (B) 42", True), ("**A**", False), ("Option C", False),
    ("Option", False), ("not 42", False),  # a choice's number denied names no choice
    # the letter with the text after a separator or before it, in brackets; words saying it is the one
    ("B, 42", True), ("B - 42", True), ("B \u2014 42", True), ("42 (B)", True), ("[B]", True), ("B is correct", True),
    ("The correct option is B", True), ("B is the correct answer", True), ("42 (C)", False), ("C, 42", False),
    ("[A]", False), ("A is correct", False), ("B, 17", False),
])
def test_is_correct_on_multiple_choice(given, ok):
    assert is_correct(mc("42", "17", "42", "99", "7"), given) is ok


def test_choice_text_starting_with_a_one_letter_word():
    t = mc("a dog", "cat", "bird", "a dog")
    assert is_correct(t, "a dog") and is_correct(t, "A dog") and is_correct(t, "C")
    assert not is_correct(t, "A") and not is_correct(t, "a cat")


def test_choices_holding_a_quantity_compare_by_its_value():
    t = mc("3.5 kg", "3.5 kg", "7 kg", "1 kg")
    assert is_correct(t, "3.5 kg") and is_correct(t, "A") and not is_correct(t, "35 kg")
    t2 = mc("-5 \u00b0C", "-5 \u00b0C", "10 \u00b0C")
    assert is_correct(t2, "-5 \u00b0C") and not is_correct(t2, "5 \u00b0C")


def test_numeric_choices_compare_by_value_not_by_stripped_text():
    # "4.5" and "4/5" both read "45" once punctuation is dropped
    t = mc("4.5", "0.5", "4/5", "4.5")
    assert is_correct(t, "4.5") and is_correct(t, "C") and is_correct(t, "9/2")
    assert not is_correct(t, "4/5") and not is_correct(t, "0.8")
    t2 = mc("11/2", "1/12", "11/2")
    assert is_correct(t2, "11/2") and not is_correct(t2, "1/12")


def test_an_answer_without_words_must_be_given_as_it_is():
    """Normalizing drops punctuation and articles; were an answer left empty by that matched by
    any reply left empty, "!!!" or "the" would be right."""
    letter = Task("t", "Which grade?", "A")
    assert all(is_correct(letter, given) for given in ("A", " a ", "(A)", "A.", "'a'"))
    assert not any(is_correct(letter, given) for given in ("the", "!!!", "an", "", "B", "AA"))
    question = Task("t", "Which sign ends a question?", "?")
    assert is_correct(question, "?") and not any(is_correct(question, given) for given in ("!!!", "the", "."))
    operator = mc("+", "+", "-", "*")
    assert is_correct(operator, "+") and is_correct(operator, "A") and not is_correct(operator, "-")
    assert not any(is_correct(operator, given) for given in ("the", "!!!", "?"))


def test_an_answer_may_write_its_choice_another_way(tmp_path):
    path = write(tmp_path / "c.jsonl", [{"question": "q", "choices": ["1.0", "2.5"], "answer": 1.0},
                                        {"question": "r", "choices": [1.0, 2.5], "answer": "2.50"},
                                        {"question": "s", "choices": ["Paris", "Rome"], "answer": "paris"}])
    assert [t.answer for t in load_tasks_jsonl(path)] == ["1.0", "2.5", "Paris"]


def test_numbers_in_files_are_read_as_a_reply_would_write_them(tmp_path):
    path = write(tmp_path / "n.jsonl", [{"question": "q", "answer": 1e20}, {"question": "r", "answer": 2.0},
                                        {"question": "s", "answer": 1e-7}, {"question": "t", "choices": [1.5, 2e3],
                                                                            "answer": 2000}])
    tasks = load_tasks_jsonl(path)
    assert [t.answer for t in tasks] == ["100000000000000000000", "2", "0.0000001", "2000"]
    assert tasks[3].choices == ("1.5", "2000")
    assert is_correct(tasks[0], "100000000000000000000") and is_correct(tasks[2], "0.0000001")


def test_text_choices_that_normalize_alike_are_ambiguous():
    t = mc("U.S.", "US", "U.S.", "UK")
    assert is_correct(t, "U.S.") and is_correct(t, "B")
    assert not is_correct(t, "us.")  # could be A or B


# ---------------------------------------------------------------- JSONL loader

def write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return str(path)


def test_loader_reads_a_good_file(tmp_path):
    path = write(tmp_path / "qa.jsonl", [
        {"question": " What is 2+2? ", "answer": 4, "id": "q1"},
        "",
        {"question": "Capital of France?", "choices": ["Lyon", "Paris", "Nice"], "answer": "Paris",
         "kind": "geo", "difficulty": 2},
        {"question": "Pick the even one.", "choices": [3, 8], "answer": "(b)"},
        {"question": "Pick B.", "choices": ["x", "y"], "answer": "B"},
    ])
    tasks = load_tasks_jsonl(path)
    assert [t.id for t in tasks] == ["q1", "qa-3", "qa-4", "qa-5"]
    assert tasks[0] == Task("q1", "What is 2+2?", "4", None, "custom", 0)
    assert tasks[1].choices == ("Lyon", "Paris", "Nice") and tasks[1].answer == "Paris"
    assert (tasks[1].kind, tasks[1].difficulty, tasks[1].answer_letter) == ("geo", 2, "B")
    assert tasks[2].choices == ("3", "8") and tasks[2].answer == "8"  # letter mapped to its choice
    assert tasks[3].answer == "y"
    assert all(is_correct(t, t.answer) for t in tasks)


def test_loader_accepts_a_byte_order_mark_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"question": "q", "answer": "a"}\r\n{"question": "r", "answer": "b"}\r\n')
    assert [t.answer for t in load_tasks_jsonl(path)] == ["a", "b"]


@pytest.mark.parametrize("lines, line_no, message", [
    ([{"question": "q", "answer": "a"}, "{not json"], 2, "not valid JSON"),
    (["[1, 2]"], 1, "expected a JSON object, got list"),
    ([{"answer": "a"}], 1, "'question' must be a non-empty string"),
    # Another dataset's records (MBPP's): the expected fields, and the ones found.
    ([{"task_id": 1, "text": "Write a function", "code": "def f(): pass"}], 1,
     re.escape("a task is {question, answer, choices?, id?}, e.g. {\"question\": \"2+2?\", \"answer\": \"4\"}); "
               "the record has 'task_id', 'text', 'code'")),
    ([{"question": "   ", "answer": "a"}], 1, "'question' must be a non-empty string"),
    ([{"question": "q"}], 1, "'answer' must be a non-empty string or number; the record has 'question'"),
    ([{"question": "q", "answers": ["4"]}], 1, "non-empty string or number; the record has 'question', 'answers'"),
    # "A" is the text of choice B and the letter of choice A: either reading could be meant
    ([{"question": "q", "answer": "A", "choices": ["B", "A"]}], 1,
     "'answer' 'A' is both a choice's text and the letter of another choice \\(A: 'B'\\)"),
    ([{"question": "q", "answer": True}], 1, "'answer' must be a non-empty string or number"),
    ([{"question": "q", "answer": " "}], 1, "'answer' must be a non-empty string or number"),
    (['{"question": "q", "answer": NaN}'], 1, "'answer' is nan, which no reply can equal"),
    (["", {"question": "q", "answer": "z", "choices": ["x", "y"]}], 2, "neither one of the choices nor a choice letter \\(A-B\\)"),
    ([{"question": "q", "answer": "C", "choices": ["x", "y"]}], 1, "neither one of the choices"),
    ([{"question": "q", "answer": "x", "choices": ["x"]}], 1, "'choices' must be a list of at least 2"),
    ([{"question": "q", "answer": "x", "choices": "xy"}], 1, "'choices' must be a list of at least 2"),
    ([{"question": "q", "answer": "x", "choices": ["x", None]}], 1, "'choices' must be a list of at least 2"),
    ([{"question": "q", "answer": "x", "choices": ["x", True]}], 1, "'choices' must be a list of at least 2"),
    (['{"question": "q", "answer": "x", "choices": ["x", NaN]}'], 1, "'choices' must be a list .* got \\['x', nan\\]"),
    ([{"question": "q", "answer": "a", "kind": ["a"]}], 1, "'kind' must be a non-empty string .* got \\['a'\\]"),
    ([{"question": "q", "answer": "x", "choices": ["x", "x", "y"]}], 1, "'choices' has duplicates"),
    ([{"question": "q", "answer": "x", "choices": [str(i) for i in range(27)]}], 1, "at most 26 choices"),
    # Choices that differ only in case or spacing can never be named by their text.
    ([{"question": "q", "answer": "x", "choices": ["Paris", "x", "paris "]}], 1,
     "'choices' has duplicates \\('Paris' and 'paris ', up to case and spacing\\)"),
    ([{"question": "q", "answer": "0.5", "choices": ["1/2", "0.50", "3"]}], 1,
     "'choices' has duplicates \\('1/2' and '0.50' are the same number, and numbers are graded by value\\)"),
    ([{"question": "q", "answer": "1/0"}], 1, "'answer' '1/0' reads as a number but has no value"),
    ([{"question": "q", "answer": "a", "difficulty": "3"}], 1, "'difficulty' must be an integer .* got '3'"),
    ([{"question": "q", "answer": "a", "difficulty": True}], 1, "'difficulty' must be an integer"),
    ([{"question": "q", "answer": "a", "id": None}], 1, "'id' must be a non-empty string or an integer, got None"),
    ([{"question": "q", "answer": "a", "id": "t1"}, {"question": "r", "answer": "b", "id": "t1"}], 2,
     "task id 't1' is also the id of line 1"),
])
def test_loader_rejects_bad_lines_naming_file_and_line(tmp_path, lines, line_no, message):
    path = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFormatError, match=message) as excinfo:
        load_tasks_jsonl(path)
    assert str(excinfo.value).startswith(f"{path}:{line_no}: ")


@pytest.mark.parametrize("record, shape", [
    ({"id": "test_0", "question": "who?", "golden_answers": ["Ada"]}, "a record with 'golden_answers' is an NQ-style"),
    ({"question": "who?", "answer": ["Ada", "Ada Lovelace"]}, "a record whose 'answer' is a list is an NQ-open-style"),
])
def test_an_open_domain_question_file_is_named_and_sent_to_search_eval_qa(tmp_path, record, shape):
    path = write(tmp_path / "nq.jsonl", [record])
    with pytest.raises(DataFormatError) as excinfo:
        load_tasks_jsonl(path)
    assert str(excinfo.value) == (
        f"{path}:1: 'answer' must be a non-empty string or number ({shape} question file, for "
        "rftgym/SearchEvalQA-v0: --env-arg dataset_path=FILE with --env-arg corpus_path=CORPUS, the documents its "
        "questions are searched in)")


def test_loader_rejects_invalid_utf8_naming_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "a"}\n{"question": "caf\xe9", "answer": "a"}\n')
    with pytest.raises(DataFormatError, match="not UTF-8") as excinfo:
        load_tasks_jsonl(path)
    assert str(excinfo.value).startswith(f"{path}:2: ")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_loader_rejects_a_file_without_tasks(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataFormatError, match="has no tasks") as excinfo:
        load_tasks_jsonl(path)
    assert str(excinfo.value).startswith(str(path))


def test_loader_rejects_a_missing_file_or_a_directory(tmp_path):
    with pytest.raises(DataFormatError, match="no such file"):
        load_tasks_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DataFormatError, match="a directory, not a file"):
        load_tasks_jsonl(tmp_path)


def test_unwrapping_runs_of_delimiters_takes_linear_time():
    # "$" * N took cubic time (6.7 s at N=2000): a reply could stall the env.
    from rftgym.envs.verifiable.grading import unwrapped_answer

    for text in ("$" * 100_000 + "x", "`" * 100_000 + "x", "*" * 100_000 + "x"):
        assert unwrapped_answer(text)  # returns at all; the suite's timeout would catch a stall


def test_a_sign_before_a_long_run_of_spaces_is_read_in_linear_time():
    # "-" and 32,000 spaces took 6 s in the double-sign check: a reply could stall the env.
    assert not is_correct(free("5"), "-" + " " * 100_000 + "x")   # returns at all, and is wrong
    assert is_correct(free("-5 degrees"), "minus 5 degrees") and not is_correct(free("5 degrees"), "minus 5 degrees")


@pytest.mark.timeout(20)
def test_denials_and_choice_letters_are_read_in_linear_time_in_long_replies():
    # A digit, "not" or a letter before a long run of spaces or stars took seconds at 20,000
    # characters (two runs of the pattern could share them): a reply could stall the env.
    for text in ("1" + " " * 100_000, "not" + "*" * 100_000, "42" + " " * 100_000 + "\n",
                 "x" + " " * 100_000 + "(B", "B" + " " * 100_000 + "is correct", "!" * 100_000 + "x",
                 "The answer is " + "." * 100_000 + "x"):
        is_correct(free("42"), text)
        is_correct(mc("42", "17", "42"), text)


@pytest.mark.parametrize("answer, given, ok", [
    # markup and a sentence's end say nothing of a text answer's value
    ("Tuesday", "**Tuesday**.", True), ("Tuesday", "*Tuesday*.", True), ("Tuesday", "The answer is **Tuesday**.", True),
    ("Tuesday", "Tuesday!", True), ("Tuesday", "\\(Tuesday\\)", True), ("Paris", "\\[Paris\\]", True),
    ("x+1", "\\(x+1\\)", True), ("x*y", "x*y", True), ("x*y", "xy", False),
    # an arrow leads to the answer; degrees are a unit
    ("42", "=> 42", True), ("42", "-> 42", True), ("Tuesday", "=> Tuesday", True),
    ("42", "\\boxed{42^\\circ}", True), ("42", "$42^{\\circ}$", True), ("42", "42^2", False),
    # a mixed number is its whole value
    ("7/3", "2\\frac{1}{3}", True), ("7", "2\\frac{1}{3}", False), ("-3/2", "-1\\frac{1}{2}", True),
    # operators are no emphasis, and "!" after a number is a factorial
    ("x * 2", "x ** 2", False), ("x ** 2", "x * 2", False), ("x*y", "x**y", False), ("2 * x", "2 x", False),
    ("n! - 1", "n - 1", False), ("n!/2", "n/2", False), ("(n-1)!", "(n-1)", False), ("x!y", "xy", False),
    ("the Eiffel Tower", "the **Eiffel** Tower", True), ("Paris", "Paris?", True),
    ("5", "5!", False), ("5", "\\boxed{5!}", False), ("5!", "5!", True), ("x > 2", "x > 2", True),
    # denials written with LaTeX text commands or before a choice's letter
    ("5", "\\mathbf{not} 5", False), ("5", "\\text{not } 5", False), ("5", "5 \\text{ is wrong}", False),
])
def test_markup_arrows_degrees_and_mixed_numbers(answer, given, ok):
    assert is_correct(free(answer), given) is ok


def test_a_choice_given_with_markup_and_an_arrow():
    t = mc("Tuesday", "Monday", "Tuesday", "Friday")
    right = ("**Tuesday**.", "=> B", "-> Tuesday", "Tuesday (B).", "**B**.", "\\boxed{B}.", "The answer is **B**.",
             "B!", "`B`.", "\\mathbf{Tuesday}", "**Answer:** Tuesday", "So the answer is Tuesday.", "So, the answer is B.",
             "**Tuesday** is the answer", "\\( \\boxed{Tuesday} \\)", "\\[B\\]")
    assert [given for given in right if not is_correct(t, given)] == []
    wrong = ("**Monday**.", "=> A", "Tuesday (C).", "**A**.", "\\boxed{C}.", "So the answer is A.", "**Monday** is the answer",
             "\\( \\boxed{Friday} \\)", "A!")
    assert [given for given in wrong if is_correct(t, given)] == []
    assert is_correct(free("12"), "12.") and is_correct(free("1.5"), "1.5.") and not is_correct(free("15"), "1.5.")
    assert is_correct(t, "**Answer**: B") and is_correct(t, "**Answer**: Tuesday")
    numbered = mc("92", "17", "92", "99")
    assert not any(is_correct(numbered, given) for given in ("not (B) 92", "So the answer is not (B) 92", "=> not (B) 92"))
