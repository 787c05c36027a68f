"""Evaluation during training: the policy's greedy episodes on fixed seeds."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace

import gymnasium as gym
import torch

from ..agents.hf_policy import HFPolicy
from ..rollout import RolloutConfig, run_episodes
from ..core.errors import warn_caller
from ..rollout.metrics import env_metrics, metric_spec_problem, reducers_view
from .config import TrainConfig
from .distributed import Distributed, full_parameters


# What the evaluation reports itself (as eval_<name>): no env column may take one of these names.
OWN_METRICS = ("reward_mean", "success_rate", "sampled_tokens_mean", "seconds")


def declared_columns(metadata: dict, whose: str, checked_by_eval: bool = True) -> tuple[tuple[str, str, str], ...]:
    """The evaluation columns an env's ``metadata`` declares (``eval_metrics``); a malformed
    declaration is warned about (naming ``whose`` env) and gives none, as training goes on.
    ``checked_by_eval``: whether ``rftgym eval`` can run the env (it is registered), and say so too."""
    spec = metadata.get("eval_metrics", ())
    problem = metric_spec_problem(spec, OWN_METRICS, "the evaluation's own")
    if problem is not None:
        also = "; `rftgym eval` refuses it" if checked_by_eval else ""
        warn_caller(f"{whose}: metadata['eval_metrics'] is malformed ({problem}), so the evaluation during training "
                    f"reports none of its columns{also}")
        return ()
    return tuple(tuple(entry) for entry in spec)


def columns_of_made_env(make_env: Callable[[], gym.Env]) -> tuple[tuple[str, str, str], ...]:
    """:func:`declared_columns` of the env ``make_env`` makes: its class's metadata where
    ``make_env`` is the class, else that of one env made and closed for it."""
    if isinstance(make_env, type) and isinstance(getattr(make_env, "metadata", None), dict):
        return declared_columns(make_env.metadata, f"the env make_env makes ({make_env.__name__})", False)
    env = make_env()
    try:
        return declared_columns(env.unwrapped.metadata, f"the env make_env made ({type(env.unwrapped).__name__})",
                                False)
    finally:
        env.close()


def evaluate_policy(make_env: Callable[[], gym.Env], policy: HFPolicy, model, config: TrainConfig,
                    ranks: Distributed, autocast=nullcontext,
                    env_columns: Sequence[tuple[str, str, str]] = ()) -> dict[str, float | None]:
    """The policy's greedy episodes on the evaluation seeds (``eval_seed`` onwards, shared out over
    the ranks): their mean reward, success rate and sampled tokens, over all ranks, and the env's
    own columns (``env_columns``: its ``metadata["eval_metrics"]``, as `rftgym eval` prints them),
    each as ``eval_<column>`` (None where no episode reported it).

    It leaves training as it was: the sampling settings and every random state (the policy's
    sampler, torch's global ones) are restored, so a run with evaluation trains exactly as one
    without, and a resumed run as an uninterrupted one."""
    started = time.perf_counter()
    seeds = ranks.shard(list(range(config.eval_seed, config.eval_seed + config.eval_episodes)))
    sampling, sampler_state = policy.sampling, policy._generator.get_state()
    devices = [policy.device] if policy.device.type == "cuda" else []
    model.eval()
    try:
        policy.sampling = replace(sampling, temperature=0.0, top_p=1.0, top_k=0)  # (greedy reads neither)
        # FSDP: every rank gathers the parameters, also one without seeds.
        def rollout():  # on this rank alone; an error stops every rank (Distributed.together)
            with torch.random.fork_rng(devices=devices), autocast(), full_parameters(model):
                return run_episodes(make_env, policy, seeds, config=RolloutConfig(num_envs=config.rollout_batch_size)) \
                    if seeds else []

        episodes = ranks.together(rollout)
    finally:
        policy.sampling = sampling
        policy._generator.set_state(sampler_state)
        policy.clear_prefix_cache()  # stale after the next update (FSDP: unseen by the cache's fingerprint)
    n, reward, wins, tokens = ranks.sum_floats([len(episodes), sum(e.total_reward for e in episodes),
                                                sum(e.success for e in episodes),
                                                sum(e.num_sampled_tokens for e in episodes)])
    metrics = {"eval_reward_mean": reward / n, "eval_success_rate": wins / n, "eval_sampled_tokens_mean": tokens / n}
    if env_columns:  # (its reducers need every episode: a mean over those that report a key, a max)
        views = [reducers_view(e, env_columns) for e in episodes]  # (not their texts and tokens)
        everyone = [e for part in ranks.gather_objects(views) for e in part]
        metrics.update({f"eval_{column}": value for column, value in env_metrics(everyone, env_columns).items()})
    return {**metrics, "eval_seconds": time.perf_counter() - started}
