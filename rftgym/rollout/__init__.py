from .engine import RolloutConfig, run_episodes
from .metrics import format_table, summarize

__all__ = ["RolloutConfig", "run_episodes", "summarize", "format_table"]
