"""Multi-objective tasks: several questions in one episode, all to be answered.

* :func:`generate_task`: built-in and seeded, on the search env's generated :class:`World` (no
  files). Difficulty is the number of objectives and the hops per question.
* :func:`compose_task` over questions loaded from HotpotQA-format data
  (:func:`load_question_pool`), with the corpus made by :func:`build_corpus`: the questions' own
  paragraphs plus an optional distractor corpus in any format
  :func:`~rftgym.envs.search.corpora.load_corpus` reads (e.g. 2WikiMultihopQA ``[{title, text}]``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...core.errors import ConfigError
from ...core.values import int_tuple
from ..search.corpora import Document, Question, load_corpus, load_questions
from ..search.world import World

MAX_DRAW_TRIES = 100


@dataclass(frozen=True)
class MemoryTask:
    id: str
    objectives: tuple[Question, ...]  # objective k (1-based in the protocol) is objectives[k - 1]

    @property
    def hops(self) -> tuple[int, ...]:
        return tuple(q.hops for q in self.objectives)

    def prompt(self) -> str:
        count = len(self.objectives)
        lines = [f"Task: answer all {count} questions below." if count > 1 else "Task: answer the question below."]
        lines += [f"{k}. {q.question}" for k, q in enumerate(self.objectives, start=1)]
        return "\n".join(lines)


def _task_id(questions: Sequence[Question]) -> str:
    return "|".join(q.id for q in questions)


def generate_task(world: World, rng: np.random.Generator, objectives: int, hops: Sequence[int]) -> MemoryTask:
    """``objectives`` distinct answerable questions of the world, each with hops drawn from ``hops``."""
    chosen: list[Question] = []
    seen: set[str] = set()
    for _ in range(MAX_DRAW_TRIES * objectives):
        if len(chosen) == objectives:
            break
        h = int(hops[int(rng.integers(len(hops)))])
        question = world.question(rng, h)
        if question.id not in seen:
            seen.add(question.id)
            chosen.append(question)
    if len(chosen) < objectives:
        raise ConfigError(f"could not draw {objectives} distinct questions from a world of "
                          f"{len(world.entities)} entities; raise world_size or lower objectives")
    return MemoryTask("gen-" + _task_id(chosen), tuple(chosen))


def compose_task(pool: Sequence[Question], indices: Sequence[int]) -> MemoryTask:
    """A task whose objectives are ``pool[i]`` for ``i`` in ``indices`` (distinct, in range)."""
    try:  # int() alone would read 1.9 as 1, True as 1 and "12" as 1 and 2
        indices = list(int_tuple(indices))
    except TypeError:
        raise ValueError(f"question_indices must be distinct ints in [0, {len(pool)}), got {indices!r}") from None
    if not indices or len(set(indices)) != len(indices) or not all(0 <= i < len(pool) for i in indices):
        raise ValueError(f"question_indices must be distinct ints in [0, {len(pool)}), got {indices!r}")
    chosen = tuple(pool[i] for i in indices)
    return MemoryTask("data-" + _task_id(chosen), chosen)


def draw_indices(rng: np.random.Generator, pool_size: int, objectives: int) -> list[int]:
    if objectives > pool_size:
        raise ConfigError(f"{objectives} objectives per task but the dataset has {pool_size} questions")
    return [int(i) for i in rng.choice(pool_size, size=objectives, replace=False)]


def load_question_pool(dataset_path: str | os.PathLike) -> list[Question]:
    """Answerable questions from HotpotQA JSON (or the other formats ``load_questions`` reads)."""
    return [q for q in load_questions(dataset_path) if q.answerable and q.answers]


def build_corpus(dataset_path: str | os.PathLike, corpus_path: str | os.PathLike | None = None,
                 max_distractors: int | None = None) -> list[Document]:
    """The dataset's own paragraphs followed by (the first ``max_distractors``) distractor documents,
    less those the dataset already holds (a corpus made from the dataset's contexts, such as
    HotpotQA's, would show each of them twice in a search's results).

    Ids are re-made as ``q<i>`` / ``d<i>`` because the two corpora's ids may collide (2Wiki ids
    are record positions); titles and texts are kept.
    """
    own = load_corpus(dataset_path)
    documents = [Document(f"q{i}", d.title, d.text) for i, d in enumerate(own)]
    if corpus_path is not None:
        held = {(d.title, d.text) for d in own}
        distractors = load_corpus(corpus_path, limit=max_distractors)
        documents += [Document(f"d{i}", d.title, d.text) for i, d in enumerate(distractors)
                      if (d.title, d.text) not in held]
    return documents
