from ..core.records import Episode, Turn, read_episodes_jsonl, write_episodes_jsonl
from .engine import RolloutConfig, run_episodes
from .metrics import format_table, summarize

__all__ = ["RolloutConfig", "run_episodes", "summarize", "format_table", "Episode", "Turn", "read_episodes_jsonl",
           "write_episodes_jsonl"]
