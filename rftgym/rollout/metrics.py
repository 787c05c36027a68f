"""Summaries of episodes, and the plain-text tables the CLI and benchmarks print."""

from __future__ import annotations

from statistics import mean
from typing import Iterable, Sequence

from ..core.records import Episode


def summarize(episodes: Sequence[Episode]) -> dict[str, float]:
    if not episodes:
        return {"episodes": 0}
    format_errors = [bool(t.info.get("format_error")) for e in episodes for t in e.turns]
    return {
        "episodes": len(episodes),
        "reward": mean(e.total_reward for e in episodes),
        "success": mean(float(e.success) for e in episodes),
        "turns": mean(len(e.turns) for e in episodes),
        "truncated": mean(float(e.truncated) for e in episodes),
        "format_error_rate": mean(format_errors) if format_errors else 0.0,
        "sampled_tokens": mean(e.num_sampled_tokens for e in episodes),
        "prompt_tokens": mean(e.num_prompt_tokens for e in episodes),
    }


def format_table(rows: Iterable[Sequence], headers: Sequence[str]) -> str:
    """A left-aligned text table; floats get 3 significant decimals."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line, rule] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body])
