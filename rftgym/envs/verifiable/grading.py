"""Grading a VerifiableQA answer: whether the text inside ``<answer>`` says the task's answer.

Numbers compare by value (``parse_number``: "1,234", "3/4", "-5", a LaTeX fraction), choices by
their letter or text, other answers as text up to case, punctuation, articles and spacing, with
their operators and relations kept. Markup around an answer and the words that introduce it are
read past (:func:`unwrapped_answer`); a denied, bounded or rescaled number answers nothing.
"""

from __future__ import annotations

import re
import string
from fractions import Fraction
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .tasks import Task

LETTERS = string.ascii_uppercase


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")
# A number standing on its own: digits glued to letters are part of a word ("CO2", "m2", "2nd",
# "120cm"), and a number is read whole or not at all. Letters or digits on neither side, so that the
# match cannot back off a digit ("120cm" is not 12, "m123" not 23); no ".digit" after it nor
# "digit." before it ("1.2.3", "v3.14" are no numbers); no exponent ("1.5e3", "5e-1").
_NUMBER_TOKEN = re.compile(rf"(?<![^\W_])(?<!\d\.)(?<!\d[eE][-+])(?:{_NUMBER.pattern})(?![^\W_]|\.\d)")
# "minus 3", "negative 3": a sign written as a word.
_SIGN_WORD = re.compile(r"\b(?:minus|negative)\s+(?=[\d.])", re.IGNORECASE)
# Dashes a model or a document writes for a minus sign.
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\ufe63": "-",
                              "\uff0d": "-"})


# LaTeX a model writes for a plain number: \frac{11}{6} (\dfrac, \tfrac) for 11/6, with either
# sign; 12{,}345 and 12\,345 for 12,345.
_LATEX_FRACTION = re.compile(r"(?<![\d.])\\[dt]?frac\s*\{\s*([-+\u2212]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
# A mixed number, 2\frac{1}{3}: 7/3 (read as 2 and then 1/3, it was 21/3).
_LATEX_MIXED = re.compile(r"(?<![\d.])([-+\u2212]?)(\d+)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
# Degrees: 42^\circ, 42^{\circ} as 42\u00b0.
_LATEX_DEGREES = re.compile(r"\^\s*+(?:\{\s*+\\circ\s*+\}|\\circ(?![a-z]))")
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|\\,)(?=\d{3}(?!\d))")


def plain_latex(text: str) -> str:
    """``text`` with the LaTeX of plain numbers written plainly (``\\frac{-11}{6}`` -> ``-11/6``,
    ``2\\frac{1}{3}`` -> ``7/3``, ``12{,}345`` -> ``12,345``, ``42^\\circ`` -> ``42\u00b0``); other LaTeX is
    left as it is."""
    text = _LATEX_MIXED.sub(_mixed_number, text)
    return _LATEX_DEGREES.sub("\u00b0", _LATEX_THOUSANDS.sub(",", _LATEX_FRACTION.sub(r"\1/\2", text)))


def _mixed_number(match: re.Match) -> str:
    sign, whole, numerator, denominator = match.groups()
    if int(denominator) == 0:
        return match.group(0)
    return f"{sign}{int(whole) * int(denominator) + int(numerator)}/{denominator}"


_PUNCTUATION = frozenset(string.punctuation)
# A sign parted from its number by spaces, where it cannot be an operator ("- 5", "x = - 5";
# not "7 - 5").
_SPACED_SIGN = re.compile(r"(?:^|(?<=[=:(\[]))\s*([-+])\s+(?=[\d.])")
# Markup a model puts around its answer: \boxed{…}, \text{…}, \mathbf{…}, \(…\), \[…\], $…$, **…**, *…*, `…`.
_WRAPPERS = (re.compile(r"\\boxed\s*\{(.*)\}", re.DOTALL),
             re.compile(r"\\(?:text|math)(?:bf|rm|it|sf)?\s*\{(.*)\}", re.DOTALL),
             re.compile(r"\\\((.*)\\\)", re.DOTALL), re.compile(r"\\\[(.*)\\\]", re.DOTALL),
             re.compile(r"(\$\$?)(.*?)\1", re.DOTALL), re.compile(r"(\*\*|__|\*|_|`{1,3})(.*?)\1", re.DOTALL))
# Words that introduce an answer rather than being part of it ("Option B", "The answer is: B").
# ("So the answer is", and in bold: "**Answer:**")
_ANSWER_PREFIX = re.compile(r"(?:so,?\s++)?[*_]*+(?:the\s+)?(?:(?:final|correct|right)\s+)?(?:answer|option|choice)"
                            r"(?:\s+is)?[*_]*+\s*(?:[:]|-(?!\s*[\d.]))?[*_]*+\s+|"
                            r"(?:so,?\s++)?[*_]*+(?:the\s+)?(?:(?:final|correct|right)\s+)?(?:answer|option|choice)"
                            r"(?:\s+is)?[*_]*+\s*:[*_]*+\s*", re.IGNORECASE)
# A sentence's end after the answer ("**B**.", "\boxed{12}!"), read past like the markup.
_SENTENCE_END = re.compile(r"(?<=[^\s.!])\s*+[.!]++\Z")  # (from a run's start only: linear)
# ... and after it: "B is correct", "12 is the right answer", "**B** is the answer".
_ANSWER_SUFFIX = re.compile(r"(?<!\s)\s++is\s++(?:the\s++)?(?:(?:correct|right)(?:\s++(?:answer|option|choice))?"
                            r"|(?:final\s++)?(?:answer|option|choice))\s*+\.?", re.IGNORECASE)
# An arrow that leads to the answer: "=> 42", "-> B".
_ARROW = re.compile(r"(?:=>|->|\u2192|\u21d2|\u27f9)\s*+")


def unwrapped_answer(text: str) -> str:
    """``text`` without the markup around it (``\\boxed{B}``, ``**Tuesday**``, ``$-5$``) and a
    leading "Option", "Choice" or "The answer is": what is left is what the reply answers."""
    text = text.strip()
    for _ in range(8):  # markup may nest: $\boxed{5}$
        before = text
        for pattern in _WRAPPERS:
            match = pattern.fullmatch(text)
            if match:
                text = match.group(match.lastindex).strip()
                break
        prefix = _ANSWER_PREFIX.match(text)
        if prefix and prefix.end() < len(text):
            text = text[prefix.end():].strip()
        end = _SENTENCE_END.search(text)
        if end and not _NUMBER_TOKEN.search(text[max(0, end.start() - 1):]):  # ("12." stays a number's text)
            text = text[:end.start()].strip()
        arrow = _ARROW.match(text)
        if arrow and arrow.end() < len(text):
            text = text[arrow.end():].strip()
        suffix = _ANSWER_SUFFIX.search(text)
        if suffix and suffix.end() == len(text) and suffix.start() > 0:
            text = text[:suffix.start()].strip()
        if text == before:
            break
    return text


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation, articles and extra whitespace (SQuAD-style)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def parse_number(text: str) -> Fraction | None:
    """The single number in ``text`` ("1,234", "-3.5", "3/4", "x = 12."; a minus sign U+2212 and
    the dashes written for one, en dash among them, are a minus, as are the words "minus" and
    "negative"), or None if there is not exactly one (an answer listing several numbers is not an
    answer). Digits inside a word ("CO2", "m2", "120cm") are not a number of their own, nor is a
    number in exponent notation ("1.5e3")."""
    text = _SIGN_WORD.sub("-", _SPACED_SIGN.sub(r"\1", text.translate(_MINUS_SIGNS)))
    found = _NUMBER_TOKEN.findall(text)
    if len(found) != 1:
        return None
    try:
        return Fraction(found[0].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _same_choice(given: str, choice: str) -> bool:
    """Whether ``given`` names ``choice``. A choice that holds a number compares by its value,
    because dropping punctuation would make "4.5" and "4/5", "$3.50" and "$350", "-5 degrees" and
    "5 degrees" the same text: a bare number with any words around it ("12 apples" says 12), a
    quantity with the same words or none (:func:`_same_quantity`)."""
    if _NUMBER.fullmatch(choice.strip()):
        value = parse_number(choice)
        return value is not None and parse_number(given) == value
    if parse_number(choice) is not None:
        return _same_quantity(given, choice)
    return _same_text(given, choice)


def _same_quantity(given: str, expected: str) -> bool:
    """Whether ``given`` states the quantity ``expected`` holds ("$18", "12 apples", "x = 5"): the
    same single number, alone or with the same words around it. Other words around the same number
    name something else: "Gemini 11" is not "Apollo 11", nor "CO2" "H2O"."""
    value = parse_number(expected)
    if value is None or parse_number(given) != value:
        return False
    given = _SIGN_WORD.sub("-", given)   # "minus 5 degrees" states -5 degrees: the sign is no word of it
    rest = _NUMBER_TOKEN.sub(" ", given)
    if not normalize_text(rest):
        return _stated_by_its_number(expected)
    expected_rest = _NUMBER_TOKEN.sub(" ", expected)
    return normalize_text(rest) == normalize_text(expected_rest) and _math_marks(rest) == _math_marks(expected_rest)


# A unit's slash or hyphen between letters ("m/s", "light-years"): part of its words.
_UNIT_JOINER = re.compile(r"(?<=[^\W\d_])[/-](?=[^\W\d_])")


def _stated_by_its_number(expected: str) -> bool:
    """Whether the number of the quantity ``expected`` alone states it: only words (a unit or a
    name: "12 apples", "x = 5", "-3 m/s") and currency or degree signs stand around it, no symbol
    that makes it another value ("\\sqrt{3}", "x > 2", "5!", "e^2", "\u03c0/2") and no bound or scale
    ("5 below zero")."""
    if _VALUE_CHANGED.search(expected.translate(_MINUS_SIGNS)):
        return False
    rest = _UNIT_JOINER.sub(" ", _NUMBER_TOKEN.sub(" ", _SIGN_WORD.sub("-", expected.translate(_MINUS_SIGNS))))
    return all((ch.isalnum() and ch not in "\u03c0\u03a0") or ch.isspace() or ch in "$\u20ac\u00a3\u00a5=:,.%\u00b0'"
               for ch in rest)


# Signs that make text another answer, which dropping punctuation would lose ("x+1" and "x-1",
# "10^6" and "106", "x > 2" and "x < 2", "(1,2)" and "12", "12:30" and "1230"): operators and
# relations; a minus or hyphen unless it joins two words ("Jean-Paul"); a comma, point or colon
# between digits; brackets are compared apart (:func:`_same_text`).
_MATH_MARK = re.compile(r"[+*/^<>=|!\u2260\u2264\u2265\u221a\u221e\u03c0%]|(?<![^\W\d_])-|-(?![^\W\d_])"
                        r"|(?<=\d)[.:](?=\d)|(?<=\d),(?=\s*+\d)")
# What says nothing of an answer's value, left out before its marks are compared: emphasis
# (**Tuesday**), LaTeX's math delimiters \( \) \[ \] and $, and a sentence's closing punctuation.
# Emphasis is a whole run of markers with text on its inner side only ("x * 2", "x ** 2" stay marks);
# a closing "!" or "?" only after a word ("5!" is a factorial).
_TEXT_MARKUP = re.compile(r"\\[()\[\]]|\$|(?<![^\s(])[*_`]++(?=[^\s*_`])|(?<=[^\s*_`])[*_`]++(?![^\s.,;:!?)])"
                          r"|(?<![.!?])(?:(?<=[^\W\d_]{2})[!?]++|\.++)\s*+$")
_BRACKET = re.compile(r"[()\[\]{}]")


def _math_marks(text: str) -> str:
    return "".join(_MATH_MARK.findall(_bare(text)))


def _bare(text: str) -> str:
    """``text`` without :data:`_TEXT_MARKUP` (its dashes as minus signs)."""
    return _TEXT_MARKUP.sub(" ", text.translate(_MINUS_SIGNS))


def _same_text(given: str, expected: str) -> bool:
    """Whether ``given`` says ``expected``, up to case, punctuation, articles and spacing. An
    ``expected`` with nothing left after that ("A", "?", "+") is compared less loosely, or every
    reply without words ("!!!", "the") would say it: up to case, spacing and the punctuation around
    it ("(A)", "a." say "A"), and where that leaves nothing ("?"), as it is."""
    normal = normalize_text(expected)
    if normal:
        # Brackets count where the answer has some ("(1, 2]" is no "(1, 2)"); else "(Paris)" says Paris.
        brackets = _BRACKET.findall(_bare(expected))
        return normalize_text(given) == normal and _math_marks(given) == _math_marks(expected) and \
            (not brackets or _BRACKET.findall(_bare(given)) == brackets)
    core = _collapse(expected).strip(string.punctuation + " ")
    if core:
        return _collapse(given).strip(string.punctuation + " ") == core
    return _collapse(given) == _collapse(expected)


def _collapse(text: str) -> str:
    return " ".join(text.split()).casefold()


def _choice_index(answer: str, choices: Sequence[str]) -> int | None:
    """The index of the choice ``answer`` names, or None when it names none or is ambiguous."""
    stripped = answer.strip()
    # A letter first ("(B) 42", "B, 42", "[B]"), or after the choice's text ("42 (B)").
    match = re.fullmatch(r"[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:,\u2013\u2014-]?(?:\s+.*)?", stripped, flags=re.DOTALL) \
        or re.search(r"(?<=.)[(\[]\s*+([A-Za-z])\s*+[)\]]\s*+\.?\Z", stripped, flags=re.DOTALL)
    letter_index = None
    if match and match.group(1).upper() in LETTERS[: len(choices)]:
        letter_index = LETTERS.index(match.group(1).upper())
        if match.start(1) <= 1:  # after the letter: its bracket and a separator (a dash glued to a number is its sign)
            rest = re.sub(r"^\s*[)\]]?\s*(?:[.:,]|[\u2013\u2014-](?=\s))?", "", stripped[match.end(1):]).strip()
        else:  # before it: the bracket that opens it
            rest = re.sub(r"\s*[(\[]\s*$", "", stripped[:match.start(1)]).strip()
        # "(B) 42" is fine; "(B) 17" when B is 42 names a different choice and is ambiguous.
        if not rest or _same_choice(rest, choices[letter_index]):
            return letter_index
    # The whole answer may be a choice's text that happens to start with a one-letter word
    # ("a dog" when the dog is choice C).
    exact = [i for i, choice in enumerate(choices) if _collapse(choice) == _collapse(stripped)]
    if len(exact) == 1:
        return exact[0]
    if letter_index is not None:
        return None
    matches = [i for i, choice in enumerate(choices) if _same_choice(stripped, choice)]
    return matches[0] if len(matches) == 1 else None


def is_correct(task: Task, given: str) -> bool:
    """Whether the text inside <answer> answers ``task``: as it is, or without the markup and
    the words that introduce it (:func:`unwrapped_answer`). Where the two readings hold different
    numbers, only the one without markup counts: "$- 5$" reads 5 as it is and -5 unwrapped, and
    one reply must not be right for both."""
    given = plain_latex(given)
    unwrapped = unwrapped_answer(given)
    readings = (given, unwrapped) if parse_number(given) == parse_number(unwrapped) else (unwrapped,)
    return any(_answers(task, text) for text in dict.fromkeys(readings))


# A number denied ("not 5", "isn't 5", "never equal to 5", "5 is wrong"): the reply holds 5 and
# does not answer it. Only "not", "never" and "n't" up to two words before a number deny it ("No. 5"
# and "12 (no remainder)" answer their numbers; "not sure but 5" and "I don't know, 5" hedge), or
# "is not", "is wrong" and the like right after it.
_HEDGE = r"(?!\s+(?:sure|certain|know)\b)"
# (possessive where two runs could share characters: a long run of spaces or stars took seconds)
_MARKUP = r"[\s*_`(\[{$]*+(?:\\(?:boxed|text)\s*+\{[\s*_`(\[{$]*+)?"  # "not **42**", "not \boxed{42}"
# (and "not (B) 42": a choice's letter before its number)
_DENIED_NUMBER = re.compile(rf"(?:\b(?:not|never|cannot)\b{_HEDGE}|n['\u2019]t\b{_HEDGE})[*_`]*+(?:\s+[a-z]+){{0,2}}?"
                            rf"{_MARKUP}(?:[A-Za-z]\s*+\)\s*+)?[-+$\u2212]?\d"
                            r"|\d%?\s+(?:is|was|would\s+be)\s*(?:not\b|n['\u2019]t\b|wrong\b|incorrect\b|false\b)"
                            r"|\d%?\s+(?:isn|wasn)['\u2019]t\b"
                            # "42 (incorrect)", "42 - wrong"; "wrong: 42"
                            r"|\d%?[*_`)\]}$]*+\s*+[(\[,;:\u2013\u2014-]?\s*+(?:wrong|incorrect|false)\b"
                            r"|\b(?:wrong|incorrect)\s*+[:\u2013\u2014-]\s*+[-+$]?\d", re.IGNORECASE)
# Words that make a stated number another value or a bound: "less than 5", "at least 5", "5 or
# more", "100 thousand", "3 below zero", and a second sign ("--42", "-(-42)").
_VALUE_CHANGED = re.compile(r"\b(?:less|more|fewer|greater|higher|lower|bigger|smaller)\s+than\b|\bat\s+(?:least|most)\b"
                            r"|\bup\s+to\b|\bor\s+(?:more|less|fewer|greater|higher|lower|above|below|over|under)\b"
                            r"|\b(?:over|under|above|below|nearly|almost)\s*[-+$]?\d|\bbelow\s+zero\b"
                            r"|\d\s+(?:hundred|thousand|million|billion|trillion|dozen)s?\b|[-+]\s*+(?:\(\s*+)?[-+]\s*+\d"
                            # a relation or a function of the number: "< 5", "!= 5", "\\neq 5", "5+", "\\sqrt{5}",
                            # "x^5", "5 squared", "log 5", "5 hundredths", "5!"
                            r"|[<>\u2264\u2265\u2260\u221a^]|!=|\\(?:neq?|[lg]eq?|[lg]t|sqrt|log|ln)(?![a-z])"
                            r"|\d\s*\+(?!\s*[\d(.])|\b(?:sqrt|log|ln|squared|cubed|(?:ten|hundred|thousand)ths?)\b"
                            r"|\d\s*+!(?!=)",  # a factorial: 5! is 120
                            re.IGNORECASE)


# LaTeX's text and font commands, read as their text where a denial is looked for ("\\text{not } 5").
_LATEX_TEXT = re.compile(r"\\(?:text|math)(?:bf|rm|it|sf)?\s*+\{([^{}]*+)\}")


def _answers(task: Task, given: str) -> bool:
    if _DENIED_NUMBER.search(_LATEX_TEXT.sub(r"\1", given)) and not _DENIED_NUMBER.search(task.answer):
        return False
    dashed = given.translate(_MINUS_SIGNS)
    if _VALUE_CHANGED.search(dashed) and not _VALUE_CHANGED.search(task.answer.translate(_MINUS_SIGNS)):
        return False
    if task.choices:
        index = _choice_index(given, [plain_latex(choice) for choice in task.choices])
        return index is not None and task.choices[index] == task.answer
    expected = plain_latex(task.answer)
    if _collapse(given) == _collapse(expected):  # the answer as it is written ("5!", "x > 2")
        return True
    return _same_choice(given, expected) or _same_quantity(given, expected)
