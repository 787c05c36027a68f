"""The Search->Evaluate protocol's small pieces: the evaluation format, hints and messages.

An evaluation is ``<evaluate>score: N note</evaluate>``: the body starts with an integer N from 0
to 10 (how useful the last search results are for answering), optionally labelled ``score:``
(or ``score=`` / ``score``) and optionally written ``N/10``, then a short free-text note.
Accepted: ``score: 7 names the birthplace``, ``Score=3/10, off topic``, ``10 - exactly it``,
``**Score:** 7`` (markdown emphasis before the note is read past), ``7 out of 10: close``.
Rejected: ``seven``, ``7.5``, ``7,5``, ``3 (out of 5)``, ``3 of 5``, ``11``, ``-1``, ``1e400``, ``10abc``,
``4/5``, ``5-6``, ``5 to 6``, ``5 or 6``, ``5/10 to 6/10``, ``50%``, ``note first, score: 7``.
"""

from __future__ import annotations

import re

# Lookaheads, not \b: "7.5" (or a decimal comma's "7,5") must fail rather than read as 7, and so
# must "1e400" and "10abc". The last two refuse a fraction of another whole ("4/5", "3 out of 5",
# "3 of 5" are not 4 or 3 out of 10).
# ASCII digits only: \d would also read a fullwidth or Arabic-Indic 7 as a score.
# A range ("5-6", "5 to 6", "5 or 6", "5/10 to 6/10") or a percentage ("5%") is not a score out of
# 10 either; "10 - exactly it" and "7/10 - 3 hits" are. After "/10" only a dash before another
# "N/10", or "to"/"or" before a number, makes a range.
_DASH = r"[-~\u2010-\u2015\u2212\uff0d]+"
# Possessive runs of white space (\s*+): two plain ones side by side backtrack with the square of
# the run's length, and a reply of "7" and 30,000 spaces took seconds.
_EVALUATION = re.compile(r"^\s*+(?:score\s*+[:=]?\s*+)?([0-9]{1,2})"
                         r"(?:\s*+/\s*+10(?!\s*+(?:(?:to\b|or\b)\s*+[0-9]|" + _DASH + r"\s*+[0-9]{1,2}\s*+/\s*+10))"
                         r"|(?!\s*+(?:%|(?:" + _DASH + r"|to\b|or\b)\s*+[0-9])))"
                         r"(?![.,]?[0-9])(?!\w)(?!\s*+/)(?!\s*+(?:\(\s*+)?(?:out\s++)?of\s++(?!10\b)[0-9])",
                         re.IGNORECASE)

VIOLATIONS = ("skipped_evaluation", "malformed_evaluation", "double_search", "answer_before_evaluation")

EVALUATE_REMINDER = ("Begin your next reply with <evaluate>score: N short note</evaluate>, where N is an integer "
                     "from 0 (useless) to 10 (answers the question) rating these results.")
CONTINUE_PROMPT = ("Continue: search with <search>query</search>, or give your final answer in "
                   "<answer>…</answer>.")
ANSWER_PROMPT = "No searches are left: give your final answer in <answer>…</answer>."
# After the results of the search that used up the budget, where a reply would evaluate and search.
LAST_RESULTS = ("That was the last search allowed: after the evaluation, give your final answer in "
                "<answer>…</answer>.")

VIOLATION_MESSAGES = {
    "skipped_evaluation": "your reply did not begin with an evaluation of the search results",
    "malformed_evaluation": "your <evaluate> did not start with an integer score from 0 to 10",
    "double_search": "you searched again before evaluating the previous search results",
    "answer_before_evaluation": "you answered before evaluating the search results",
}
PROTOCOL_RULE = ("The protocol: after every <search>, your very next reply must begin with "
                 "<evaluate>score: N short note</evaluate> (N an integer from 0 to 10); only then may you search "
                 "again or answer.")


# Markdown emphasis around the label or the score ("**Score:** 7", "score: **7/10**"), which small
# models write often, is read past: the head up to the score loses its * and _.
_MARKED_HEAD = re.compile(r"^[^0-9]{0,40}?[0-9]{1,2}(?:[*_\s]*/[*_\s]*10)?[*_]*")
_OUT_OF_TEN = re.compile(r"^\s*(?:out\s+)?of\s+10(?![0-9])", re.IGNORECASE)


def parse_evaluation(body: str) -> tuple[int, str] | None:
    """(score, note) of an evaluation body, or None when it does not start with a 0-10 integer."""
    head = _MARKED_HEAD.match(body)
    if head is not None and re.search(r"[*_]", head.group(0)):
        if re.search(r"[0-9][*_]+[0-9]", body[:head.end() + 1]):
            return None  # "1_0", "1*0": markup between digits is no score (taken out, it would read 10)
        body = re.sub(r"[*_]+", "", head.group(0)) + body[head.end():]
    match = _EVALUATION.match(body)
    if match is None or int(match.group(1)) > 10:
        return None
    note = _OUT_OF_TEN.sub("", body[match.end():]).strip().lstrip(".,;:-\u2013\u2014 ").strip()
    return int(match.group(1)), note


def confidence(score: int) -> str:
    """The hint level of an evaluation score: 0-3 low, 4-6 medium, 7-10 high."""
    return "low" if score <= 3 else "medium" if score <= 6 else "high"


CONFIDENCE_HINTS = {
    "low": "the evidence does not answer the question yet; search again with a different query",
    "medium": "the evidence is partial; search for the missing piece, or answer if it is enough",
    "high": "the evidence looks sufficient; you may answer",
}


# Once no search is left, a hint to search again would contradict the limit.
LAST_HINTS = {
    "low": "the evidence does not answer the question yet, and no searches are left: give your best answer",
    "medium": "the evidence is partial, and no searches are left: give your best answer",
    "high": CONFIDENCE_HINTS["high"],
}


def hint_message(score: int, searches_left: bool = True) -> str:
    level = confidence(score)
    hint = (CONFIDENCE_HINTS if searches_left else LAST_HINTS)[level]
    return f"Evaluation recorded: {score}/10, {level} confidence: {hint}."


def violation_message(kind: str) -> str:
    return f"Protocol violation: {VIOLATION_MESSAGES[kind]}. {PROTOCOL_RULE}"
