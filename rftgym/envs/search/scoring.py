"""Answer scoring as in the official SQuAD v1.1 and HotpotQA evaluation scripts.

Normalization: lower case, remove punctuation, remove the articles a/an/the, collapse white
space. Exact match compares normalized strings; token F1 is the harmonic mean of token precision
and recall over the normalized tokens. HotpotQA's script gives F1 = 0 when either side is
yes/no/noanswer and the two differ, so "yes" never partially matches "yes it is". With several
gold answers the best score counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")

# A refusal answers an unanswerable question (the "hallucination tax" setting). Matched on the
# normalized answer, so "Unknown.", "I don't know" and "cannot be determined" all count.
REFUSAL_PHRASES = ("unknown", "unanswerable", "cannot be determined", "cannot answer", "can not be determined",
                   "not enough information", "insufficient information", "i dont know", "no answer")


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction), normalize_answer(gold)
    if (predicted in _SPECIAL or expected in _SPECIAL) and predicted != expected:
        return 0.0
    predicted_tokens, expected_tokens = predicted.split(), expected.split()
    common = Counter(predicted_tokens) & Counter(expected_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(predicted_tokens)
    recall = same / len(expected_tokens)
    return 2 * precision * recall / (precision + recall)


def best_score(metric: str, prediction: str, golds: Iterable[str]) -> float:
    function = exact_match if metric == "em" else token_f1
    return max((function(prediction, gold) for gold in golds), default=0.0)


# Words a refusal may carry besides its phrase ("it cannot be determined", "the answer is unknown").
_REFUSAL_FILLER = frozenset("it is this that answer question im i am sorry so to be from with given which there here "
                            "are was on based documents information".split())


def is_refusal(answer: str) -> bool:
    """Whether the answer is a refusal and nothing else: a refusal phrase (as whole words), with at
    most filler words around it. "Tulen unknown" or "engineer (cannot answer for sure)" hedge a
    guess and are not refusals; "unknownium" holds no phrase."""
    text = f" {normalize_answer(answer)} "
    found = False
    for phrase in REFUSAL_PHRASES:
        if f" {phrase} " in text:
            found = True
            text = text.replace(f" {phrase} ", " ")
    return found and all(word in _REFUSAL_FILLER for word in text.split())
