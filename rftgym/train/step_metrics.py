"""A training step's statistics of its episodes and samples, summed over every rank's share of
the step: the rollout's half of a metrics row (the loop adds the timings, the learning rate and
the update's own numbers)."""

from __future__ import annotations

import numpy as np

from ..rollout.metrics import turn_counts
from .batching import BatchStats
from .config import TrainConfig


def rollout_metrics(ranks, episodes, batch_stats: BatchStats, prefill: tuple, rollout_seconds: float,
                    config: TrainConfig) -> dict:
    """The rewards, lengths, turns and advantages of this step's ``episodes`` and samples over all
    ranks; ``prefill``: the rollout's (prompt tokens asked, tokens prefilled, bytes evicted, bytes
    held) of the prefix cache."""
    rewards = [e.total_reward for e in episodes]
    sums = ranks.sum_floats([
        len(episodes), sum(rewards), sum(r * r for r in rewards), sum(e.success for e in episodes),
        sum(e.context_full for e in episodes), sum(e.num_sampled_tokens for e in episodes),
        *turn_counts(episodes), *prefill,
        batch_stats.groups_kept, batch_stats.episodes_masked_overlong, batch_stats.samples,
        batch_stats.trained_tokens, batch_stats.groups, batch_stats.groups_uniform,
        batch_stats.advantage_sum,
        batch_stats.pcar_spans, batch_stats.pcar_factor_sum, batch_stats.pcar_factor_sq_sum])
    (n, r_sum, r_sq, wins, full, tokens, turns, format_errors, cut, asked, prefilled, evicted, held, kept,
     masked, n_samples, n_tokens, n_groups, uniform, advantage_sum, *pcar_sums) = sums
    lengths, advantages = extremes(ranks, [e.num_sampled_tokens for e in episodes], batch_stats)
    metrics = {
        "reward_mean": r_sum / n,
        "reward_std": float(np.sqrt(max(0.0, r_sq / n - (r_sum / n) ** 2))),
        "success_rate": wins / n,
        "context_full_rate": full / n,  # episodes ended because the context had no room for a reply
        "sampled_tokens_mean": tokens / n,
        "sampled_tokens_min": lengths[0],
        "sampled_tokens_max": lengths[1],
        "turns_mean": turns / n,
        # over the replies the env played (None when none was: every episode out of context at
        # once; 0 would read as a measured rate)
        "format_error_rate": format_errors / turns if turns else None,
        "cut_reply_rate": cut / turns if turns else None,  # replies that reached max_new_tokens
        "groups_kept": int(kept),
        # groups whose rewards were all equal: no signal under a group baseline
        "uniform_group_rate": uniform / n_groups if n_groups else None,
        "advantage_mean": advantage_sum / n_tokens if n_tokens else None,  # over trained tokens
        "advantage_min": advantages[0],
        "advantage_max": advantages[1],
        "samples": int(n_samples),
        "trained_tokens": int(n_tokens),
        "rollout_seconds": rollout_seconds,
        "rollout_tokens_per_second": tokens / rollout_seconds if rollout_seconds > 0 else None,
    }
    if asked:  # the rollout went through prefix reuse (the generic decode loop)
        metrics["prefill_saved_share"] = 1.0 - prefilled / asked
        # Bytes of states freed to stay within each rank's --prefix-cache-mb, and those held at the
        # rollout's end, summed over ranks: a later prompt that begins with evicted tokens prefills
        # them again.
        metrics["prefix_evicted_mb"] = evicted / 2**20
        metrics["prefix_held_mb"] = held / 2**20
    if config.filter_overlong:
        metrics["episodes_masked_overlong"] = int(masked)
    if config.algo == "pcar":
        metrics.update(pcar_metrics(pcar_sums, int(kept) * config.group_size))
    return metrics


def extremes(ranks, lengths: list[int], stats: BatchStats) -> tuple[tuple, tuple]:
    """(least, greatest) sampled tokens of an episode, and of a trained token's advantage, over
    every rank's share of the step (None where no rank had any)."""
    mine = (min(lengths, default=None), max(lengths, default=None),
            (stats.advantage_min, stats.advantage_max) if stats.trained_tokens else (None, None))
    shares = ranks.gather_objects(mine) if ranks.world_size > 1 else [mine]
    low = [s[0] for s in shares if s[0] is not None]
    high = [s[1] for s in shares if s[1] is not None]
    advantage = [s[2] for s in shares if s[2][0] is not None]
    return ((min(low, default=None), max(high, default=None)),
            (min((a[0] for a in advantage), default=None), max((a[1] for a in advantage), default=None)))


def pcar_metrics(sums: list[float], episodes: int) -> dict[str, float | None]:
    """PCAR's step metrics from ``[scored spans, factor sum, factor sum of squares]`` over the kept
    groups' ``episodes``: scored spans per episode, and the rescaling factors' mean and spread
    (1 and 0 when no group's scores varied, i.e. PCAR trained as GRPO; None when no group was
    kept: the step trained nothing, and a window of rows averages the steps that did). The mean is
    1 wherever no factor is floored at pcar_delta (a group's standardized scores average 0): the
    spread is what tells how much PCAR rescaled."""
    if not episodes:
        return dict.fromkeys(("pcar_scores_per_episode", "pcar_factor_mean", "pcar_factor_std"))
    spans, total, squares = sums
    mean = total / spans if spans else 1.0
    return {"pcar_scores_per_episode": spans / episodes,
            "pcar_factor_mean": mean,
            "pcar_factor_std": float(np.sqrt(max(0.0, squares / spans - mean * mean))) if spans else 0.0}
