"""Summaries of episodes, and the plain-text tables the CLI and benchmarks print."""

from __future__ import annotations

import math
import numbers
from statistics import mean
from typing import Iterable, Sequence

import numpy as np

from ..core.records import Episode, Turn


# The keys of summarize() that are means (NaN over nothing): over episodes, but format_error_rate,
# a mean over the turns played.
_MEANS = ("reward", "success", "turns", "truncated", "format_error_rate", "sampled_tokens", "prompt_tokens")


def summarize(episodes: Sequence[Episode]) -> dict[str, float]:
    """The means over ``episodes`` of their reward, success, turns, truncation and tokens (NaN when no
    turn recorded tokens: an API agent's), the share of the turns they played with a format error
    (NaN when they played none), and four counts: ``episodes``, ``context_full`` (episodes ended
    for want of context), ``replies`` (turns played) and ``cut_replies`` (of those, the replies
    that stopped at the token limit, finish_reason "length").

    No episodes have the same keys, the counts 0 and every mean NaN: a mean of nothing is no
    number, and 0 would read as a measured reward or success rate of 0."""
    if not episodes:
        return {"episodes": 0, **{key: math.nan for key in _MEANS}, "context_full": 0, "replies": 0,
                "cut_replies": 0}
    played = [e.played_turns for e in episodes]
    replies, format_errors, cut = turn_counts(episodes)
    recorded = any(t.sampled_ids is not None for e in episodes for t in e.turns)
    # Means are floats even when every value is the same int (statistics.mean([3, 3]) is the int 3),
    # so that a table prints "3.000", not "3", where other rows print "2.500".
    return {
        "episodes": len(episodes),
        "reward": float(mean(e.total_reward for e in episodes)),
        "success": float(mean(float(e.success) for e in episodes)),
        "turns": float(mean(len(turns) for turns in played)),
        "truncated": float(mean(float(e.truncated) for e in episodes)),
        "format_error_rate": format_errors / replies if replies else math.nan,
        "sampled_tokens": float(mean(e.num_sampled_tokens for e in episodes)) if recorded else math.nan,
        "prompt_tokens": float(mean(e.num_prompt_tokens for e in episodes)) if recorded else math.nan,
        "context_full": sum(e.context_full for e in episodes),  # episodes ended for want of context
        "replies": replies,
        "cut_replies": cut,
    }


def turn_counts(episodes: Sequence[Episode]) -> list[int]:
    """``[replies the env played, those with info["format_error"], those cut at the token limit]``
    over ``episodes`` (:attr:`~rftgym.core.records.Episode.played_turns`; a cut reply's
    finish_reason is "length"), as `rftgym eval` and the trainer's metrics count them."""
    played = [t for e in episodes for t in e.played_turns]
    return [len(played), sum(bool(t.info.get("format_error")) for t in played),
            sum(t.finish_reason == "length" for t in played)]


# How an env's own evaluation columns are computed from its info dicts. An env lists them in
# ``metadata["eval_metrics"]`` as (column, info key, reducer) triples.
def _final(episode: Episode, key: str):
    """The episode's final value of ``key``. An episode that ran out of context ended unfinished:
    its env's last report counts (e.g. searches so far), a value never reported counts as 0 (an
    answer never given scores nothing), one the env last reported as None stays None (a metric
    that does not apply to the episode: SearchEvalQA's ``em`` of an unanswerable question), and it
    is no success."""
    if not episode.turns:
        return None
    if episode.context_full:
        if key == "success":
            return False
        # The empty last turn holds what the env's own budget would have reported (see the engine's
        # info_if_cut), else the env's last report counts.
        value = episode.turns[-1].info.get(key)
        before = episode.turns[-2].info if len(episode.turns) > 1 else {}
        if value is None:
            value = before.get(key)
        return value if value is not None or key in before else 0
    return episode.turns[-1].info.get(key)


EVAL_REDUCERS = {
    # mean over the episodes that report it of the value on the final turn (an env reports its
    # final keys on every ending turn, truncated ones too, so that none is left out)
    "final_mean": lambda eps, key: _mean([_final(e, key) for e in eps]),
    # share of episodes whose final value is a true or nonzero number (one not reported, or not a
    # number, is not)
    "final_rate": lambda eps, key: _mean([float(any(_numbers([_final(e, key)]))) for e in eps]),
    # mean and max over every turn of every episode
    "turn_mean": lambda eps, key: _mean([t.info.get(key) for e in eps for t in e.turns]),
    "turn_max": lambda eps, key: max(_numbers(t.info.get(key) for e in eps for t in e.turns), default=None),
}


def _numbers(values) -> list[float]:
    """The numbers among ``values`` as floats: Python's and numpy's, 0-d arrays included, bools as
    0/1; anything else (None, text, lists, larger arrays) is not a number and is left out."""
    kept = []
    for value in values:
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if isinstance(value, (numbers.Real, np.bool_)):
            try:
                kept.append(float(value))
            except OverflowError:  # an int past float's range
                kept.append(math.inf if value > 0 else -math.inf)
    return kept


def _mean(values) -> float | None:
    """The mean of the numbers among ``values``; None when there are none."""
    kept = _numbers(values)
    return mean(kept) if kept else None


def metric_spec_problem(spec, reserved: Sequence[str] = (), reserved_as: str = "") -> str | None:
    """What is wrong with an env's ``metadata["eval_metrics"]``, or None: it is a sequence of
    ``(column, info key, reducer)`` string triples, the reducer one of ``EVAL_REDUCERS``, each
    column named once and by none of the ``reserved`` names (the reader's own columns, which
    ``reserved_as`` describes)."""
    if isinstance(spec, (str, bytes, dict)) or not isinstance(spec, (list, tuple)):
        return f"it is {type(spec).__name__}, not a tuple of (column, info key, reducer) triples"
    for entry in spec:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(isinstance(x, str) for x in entry)):
            return f"the entry {entry!r} is not a (column, info key, reducer) triple of strings"
        if entry[2] not in EVAL_REDUCERS:
            return f"the entry {tuple(entry)!r} names the reducer {entry[2]!r}; choose from {', '.join(EVAL_REDUCERS)}"
    columns = [entry[0] for entry in spec]
    taken = sorted({c for c in columns if columns.count(c) > 1 or c in reserved})
    if taken:
        own = f" or as one of {reserved_as} ({', '.join(reserved)})" if reserved else ""
        return f"it names the column(s) {', '.join(taken)} twice{own}; give each column a name of its own"
    return None


def env_metrics(episodes: Sequence[Episode], spec: Iterable[tuple[str, str, str]]) -> dict[str, float | None]:
    """The env-specific columns of an evaluation (see ``EVAL_REDUCERS``)."""
    out = {}
    for column, key, reducer in spec:
        if reducer not in EVAL_REDUCERS:
            raise ValueError(f"unknown eval reducer {reducer!r}; choose from {sorted(EVAL_REDUCERS)}")
        out[column] = EVAL_REDUCERS[reducer](episodes, key) if episodes else None
    return out


def reducers_view(episode: Episode, spec: Iterable[tuple[str, str, str]]) -> Episode:
    """``episode`` cut down to what ``env_metrics`` reads of it for ``spec``: each turn's reward,
    ending and finish reason, and of its info the keys ``spec`` names (no messages, text or
    tokens), so that an evaluation's episodes can be sent between processes for the columns."""
    keys = {key for _, key, _ in spec} | {"success"}
    turns = [Turn(index=t.index, context_ids=(), action="", reward=t.reward, terminated=t.terminated,
                  truncated=t.truncated, info={k: t.info[k] for k in keys if k in t.info},
                  finish_reason=t.finish_reason) for t in episode.turns]
    return Episode(env_id=episode.env_id, seed=episode.seed, messages={}, turns=turns, final_context_ids=())


def format_table(rows: Iterable[Sequence], headers: Sequence[str]) -> str:
    """A left-aligned text table; floats get 3 decimal places, and NaN (a mean of nothing, a count
    nothing recorded) shows as "-". Every row has one cell per header: a row of another length is a
    ValueError naming it (the table would shift or drop its cells), and a caller with nothing to
    show puts "-" in the cell, as the CLI does."""
    def cell(value) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    body = [[cell(v) for v in row] for row in rows]
    for number, row in enumerate(body):
        if len(row) != len(headers):
            raise ValueError(f"format_table: rows[{number}] has {len(row)} cells for {len(headers)} headers "
                             f"({', '.join(headers)}): {row}; give each row one cell per header")
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line, rule] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body])
