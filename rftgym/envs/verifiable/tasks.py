"""Verifiable tasks: a seeded generator and a JSONL loader (grading: :mod:`.grading`).

The generator makes arithmetic and multiple-choice reasoning tasks with difficulty levels 1-5
(after RLVR math and OpenRFT's domain multiple-choice setting). Every task has one checkable
answer. Files in JSONL ``{"question", "choices"?, "answer", "id"?}`` are loaded by
:func:`load_tasks_jsonl`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from ...core.errors import DataFormatError
from ...core.jsonl import read_jsonl
from ...core.values import is_int
from .grading import _NUMBER, LETTERS, _collapse, _same_choice, parse_number

DIFFICULTIES = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answer: str
    choices: tuple[str, ...] | None = None
    kind: str = "custom"
    difficulty: int = 0

    @property
    def answer_letter(self) -> str | None:
        if self.choices is None:
            return None
        return LETTERS[self.choices.index(self.answer)]

    def prompt(self) -> str:
        if not self.choices:
            return self.question
        lines = [self.question, ""]
        lines += [f"({LETTERS[i]}) {c}" for i, c in enumerate(self.choices)]
        return "\n".join(lines)


# ---------------------------------------------------------------- generators

def _arithmetic(rng: np.random.Generator, difficulty: int) -> tuple[str, str, None]:
    operands = difficulty + 1
    magnitude = 10 ** min(1 + difficulty // 2, 3)
    ops = ["+", "-"] if difficulty == 1 else ["+", "-", "*"]
    terms = [str(int(rng.integers(1, magnitude)))]
    for _ in range(operands - 1):
        op = ops[int(rng.integers(len(ops)))]
        value = int(rng.integers(1, 13 if op == "*" else magnitude))
        terms += [op, str(value)]
    expression = " ".join(terms)
    if difficulty >= 4 and operands >= 3:
        # Parenthesise the first two terms so that precedence matters.
        expression = f"({' '.join(terms[:3])}) " + " ".join(terms[3:])
    value = eval(expression, {"__builtins__": {}}, {})  # our own digits and operators only
    return f"Compute {expression}.", str(value), None


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon")
_ITEMS = ("apples", "stamps", "marbles", "books", "coins", "shells", "pencils", "cards")


def _word_problem(rng: np.random.Generator, difficulty: int) -> tuple[str, str, None]:
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    item = _ITEMS[int(rng.integers(len(_ITEMS)))]
    count = int(rng.integers(5, 10 * difficulty + 10))
    sentences = [f"{name} has {count} {item}."]
    for _ in range(difficulty):
        kind = int(rng.integers(3))
        if kind == 0:
            k = int(rng.integers(1, 10 * difficulty + 1))
            sentences.append(f"Then {name} gets {k} more.")
            count += k
        elif kind == 1 and count > 1:
            k = int(rng.integers(1, count))
            sentences.append(f"Then {name} gives away {k}.")
            count -= k
        else:
            k = int(rng.integers(2, 4))
            sentences.append(f"Then the number of {item} is multiplied by {k}.")
            count *= k
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), str(count), None


MIN_SEQUENCE_STEP = 4  # an arithmetic sequence's least step (its answer lies this far above the last term)


def _mc_choices(rng: np.random.Generator, correct: str, distractors: list[str], n: int) -> tuple[str, ...]:
    unique = [d for d in dict.fromkeys(distractors) if d != correct][: n - 1]
    options = unique + [correct]
    order = rng.permutation(len(options))
    return tuple(options[i] for i in order)


def _sequence(rng: np.random.Generator, difficulty: int) -> tuple[str, str, tuple[str, ...]]:
    start = int(rng.integers(1, 10 * difficulty))
    if difficulty <= 2 or rng.random() < 0.5:
        # At least MIN_SEQUENCE_STEP: room for three choices between the last term and the answer.
        step = int(rng.integers(MIN_SEQUENCE_STEP, MIN_SEQUENCE_STEP + 1 + 3 * difficulty))
        seq = [start + step * i for i in range(5)]
        nxt = start + step * 5
    else:
        ratio = int(rng.integers(2, 4))
        seq = [start * ratio**i for i in range(5)]
        nxt = start * ratio**5
    shown = seq[: 3 + min(difficulty, 2)] if difficulty < 3 else seq[:4]
    if len(shown) < 5:
        nxt = seq[len(shown)]
    # The choices are evenly spaced (by 1, 2 or 3) around the answer at a rank drawn uniformly, all
    # above the last term shown (one at or below it is ruled out at a glance): neither the answer's
    # distances to the others nor its place among them gives it away ("the smallest choice above the
    # last term" is right a quarter of the time). The spacing is drawn before the rank, from those
    # that leave the lowest choice above the last term at any rank.
    gap = nxt - shown[-1]
    spacing = int(rng.choice([s for s in (1, 2, 3) if 3 * s < gap]))
    rank = int(rng.integers(4))
    values = [nxt + (i - rank) * spacing for i in range(4) if i != rank]
    distractors = [str(v) for v in values]
    choices = _mc_choices(rng, str(nxt), distractors, 4)
    return f"What number comes next: {', '.join(map(str, shown))}, ...?", str(nxt), choices


_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _weekday(rng: np.random.Generator, difficulty: int) -> tuple[str, str, tuple[str, ...]]:
    today = int(rng.integers(7))
    offset = int(rng.integers(1, 4 + 12 * difficulty))
    direction = "after" if difficulty < 3 or rng.random() < 0.5 else "before"
    answer = _DAYS[(today + (offset if direction == "after" else -offset)) % 7]
    distractors = [_DAYS[(today + k) % 7] for k in rng.permutation(7).tolist()]
    choices = _mc_choices(rng, answer, distractors, 4)
    question = f"Today is {_DAYS[today]}. What day of the week is it {offset} day{'s' if offset > 1 else ''} {direction} today?"
    return question, answer, choices


# Per difficulty: how many numbers to compare, and for 3-5 the fractions they are drawn from
# (largest denominator; numerators span +-spread around 0, or 1..spread when positive only).
COMPARISON_SIZES = {1: 3, 2: 4, 3: 4, 4: 5, 5: 6}
_FRACTIONS = {3: (8, 15, False), 4: (12, 25, False), 5: (16, 2, True)}
NEAR_TIE = Fraction(1, 1000)  # comparison choices lie further apart than this


def _comparison(rng: np.random.Generator, difficulty: int) -> tuple[str, str, tuple[str, ...]]:
    n = COMPARISON_SIZES[max(1, min(difficulty, 5))]
    if difficulty >= 3:
        # Fractions and decimals make the comparison non-trivial; values are read back from the
        # labels so that a rounded decimal is compared as shown. At 5 the values are signed and
        # lie within 2 of 0, so they are close together.
        max_den, spread, signed = _FRACTIONS[min(difficulty, 5)]
        labels: list[str] = []
        while len(labels) < n:
            den = int(rng.integers(2, max_den + 1))
            num = int(rng.integers(-spread * den, spread * den + 1)) if signed else int(rng.integers(1, spread + 1))
            if num % den == 0:
                continue
            label = f"{num}/{den}" if rng.random() < 0.6 else f"{num / den:.3f}".rstrip("0").rstrip(".")
            # Apart by more than a 3-decimal rounding: "0.143" beside "1/7" would ask which way
            # the rounding went, not which number is the smallest.
            if all(abs(Fraction(label) - Fraction(x)) > NEAR_TIE for x in labels):
                labels.append(label)
        values = [Fraction(x) for x in labels]
    else:
        ints = rng.choice(np.arange(1, 100 * difficulty + 10), size=n, replace=False).tolist()
        values = [Fraction(v) for v in ints]
        labels = [str(v) for v in ints]
    want_largest = bool(rng.random() < 0.5)
    best = max(range(n), key=lambda i: values[i]) if want_largest else min(range(n), key=lambda i: values[i])
    word = "largest" if want_largest else "smallest"
    choices = _mc_choices(rng, labels[best], [labels[i] for i in range(n) if i != best], n)
    return f"Which of these numbers is the {word}?", labels[best], choices


GENERATORS: dict[str, Callable[[np.random.Generator, int], tuple[str, str, tuple[str, ...] | None]]] = {
    "arithmetic": _arithmetic,
    "word_problem": _word_problem,
    "sequence": _sequence,
    "weekday": _weekday,
    "comparison": _comparison,
}


def generate_task(rng: np.random.Generator, kind: str, difficulty: int) -> Task:
    if kind not in GENERATORS:
        raise ValueError(f"unknown task kind {kind!r}; choose from {sorted(GENERATORS)}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty}")
    question, answer, choices = GENERATORS[kind](rng, difficulty)
    serial = int(rng.integers(0, 2**31))
    return Task(f"{kind}-d{difficulty}-{serial:08x}", question, answer, choices, kind, difficulty)


# ---------------------------------------------------------------- JSONL loader

def load_tasks_jsonl(path: str | Path) -> list[Task]:
    """Load ``{"question", "choices"?, "answer", "id"?}`` lines. ``answer`` may be the text of a
    choice or its letter; errors name the file and line and say what each field must be."""
    path = Path(path)
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for line_no, record in read_jsonl(path, "one {question, choices?, answer} object per line"):
        task = _task_from_record(record, f"{path}:{line_no}", default_id=f"{path.stem}-{line_no}")
        if task.id in first_line:  # results are reported by task id
            raise DataFormatError(f"{path}:{line_no}: task id {task.id!r} is also the id of line "
                                  f"{first_line[task.id]}; give each task its own id")
        first_line[task.id] = line_no
        tasks.append(task)
    if not tasks:
        raise DataFormatError(f"{path}: the file has no tasks; add lines like "
                              '{"question": "2+2?", "answer": "4"}')
    return tasks


def _task_from_record(record, where: str, default_id: str) -> Task:
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question, answer, choices = record.get("question"), record.get("answer"), record.get("choices")
    if not isinstance(question, str) or not question.strip():
        found = f"; the record has {', '.join(repr(k) for k in list(record)[:8])}" if record else "; the record is empty"
        raise DataFormatError(f"{where}: 'question' must be a non-empty string (a task is {{question, answer, "
                              f"choices?, id?}}, e.g. {{\"question\": \"2+2?\", \"answer\": \"4\"}}){found}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DataFormatError(f"{where}: 'answer' is {answer}, which no reply can equal; give a finite number or a string")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = _number_text(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DataFormatError(f"{where}: 'answer' must be a non-empty string or number{_other_dataset(record)}")
    if _NUMBER.fullmatch(answer.strip()) and parse_number(answer) is None:
        raise DataFormatError(f"{where}: 'answer' {answer!r} reads as a number but has no value (a zero "
                              "denominator); give the number it stands for")
    if choices is not None:
        if not isinstance(choices, list) or len(choices) < 2 or not all(
                isinstance(c, str) or (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c))
                for c in choices):
            raise DataFormatError(f"{where}: 'choices' must be a list of at least 2 strings (or finite numbers), got "
                                  f"{choices!r}")
        if len(choices) > len(LETTERS):
            raise DataFormatError(f"{where}: at most {len(LETTERS)} choices are supported")
        choices = tuple(c if isinstance(c, str) else _number_text(c) for c in choices)
        # Choices equal up to case and spacing could never be told apart by their text.
        seen: dict[str, str] = {}
        for choice in choices:
            if _collapse(choice) in seen:
                raise DataFormatError(f"{where}: 'choices' has duplicates ({seen[_collapse(choice)]!r} and "
                                      f"{choice!r}, up to case and spacing); each choice must be different")
            seen[_collapse(choice)] = choice
        # Numbers are graded by value: "1/2" and "0.50" would be one answer naming two choices.
        values: dict[Fraction, str] = {}
        for choice in choices:
            value = parse_number(choice) if _NUMBER.fullmatch(choice.strip()) else None
            if value is not None and value in values:
                raise DataFormatError(f"{where}: 'choices' has duplicates ({values[value]!r} and {choice!r} are the "
                                      "same number, and numbers are graded by value); each choice must be different")
            if value is not None:
                values[value] = choice
        letter = answer.strip().strip("()").upper()
        if answer in choices and len(letter) == 1 and letter in LETTERS[: len(choices)] \
                and choices[LETTERS.index(letter)] != answer:
            raise DataFormatError(f"{where}: 'answer' {answer!r} is both a choice's text and the letter of another "
                                  f"choice ({letter}: {choices[LETTERS.index(letter)]!r}); give the answer as the "
                                  "text of a choice that is no letter, or reorder the choices")
        if answer not in choices:
            # The answer may write a choice another way ("1.0" for a choice 1, "paris" for "Paris").
            same = [c for c in choices if _same_choice(answer, c)]
            if len(letter) == 1 and letter in LETTERS[: len(choices)]:
                answer = choices[LETTERS.index(letter)]
            elif len(same) == 1:
                answer = same[0]
            else:
                raise DataFormatError(f"{where}: 'answer' {answer!r} is neither one of the choices nor a choice letter "
                                      f"(A-{LETTERS[len(choices) - 1]})")
    task_id = record.get("id", default_id)
    if not isinstance(task_id, (str, int)) or isinstance(task_id, bool) or not str(task_id).strip():
        raise DataFormatError(f"{where}: 'id' must be a non-empty string or an integer, got {task_id!r}")
    difficulty = record.get("difficulty", 0)
    if not is_int(difficulty):
        raise DataFormatError(f"{where}: 'difficulty' must be an integer (0 = unrated), got {difficulty!r}")
    kind = record.get("kind", "custom")
    if not isinstance(kind, str) or not kind.strip():
        raise DataFormatError(f"{where}: 'kind' must be a non-empty string (the task's kind, reported per kind), got "
                              f"{kind!r}")
    return Task(str(task_id), question.strip(), answer, choices, kind, int(difficulty))


def _other_dataset(record: dict) -> str:
    """The note for a record of an open-domain QA file (a list of accepted answers: NQ's
    ``golden_answers``, or NQ-open's ``answer``) given as tasks: SearchEvalQA reads such files.
    For any other record, the keys it has (an ``answers`` where ``answer`` was meant)."""
    if "golden_answers" in record:
        shape = "a record with 'golden_answers' is an NQ-style question file"
    elif isinstance(record.get("answer"), list):
        shape = "a record whose 'answer' is a list is an NQ-open-style question file"
    else:
        return f"; the record has {', '.join(repr(k) for k in list(record)[:8])}" if record else "; the record is empty"
    return (f" ({shape}, for rftgym/SearchEvalQA-v0: --env-arg dataset_path=FILE with --env-arg "
            "corpus_path=CORPUS, the documents its questions are searched in)")


def _number_text(value: int | float) -> str:
    """A JSON number as the text a reply would give: 1e+20 as 100000000000000000000, 1e-07 as
    0.0000001 (an exponent is not read as a number when grading), 2.0 as 2."""
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return format(Decimal(repr(value)), "f")
    return str(value)
