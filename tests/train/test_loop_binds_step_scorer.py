"""train() binds CodeTCG's step_scorer="rollout[:N]" (from --env-arg or a saved TrainConfig) to the
policy under training, as rftgym eval binds it to its agent (envs.common.with_policy_options)."""

from __future__ import annotations

import warnings

import pytest
from support import train_config

from rftgym.envs.code.process import PolicyRollouts, RolloutStepScorer
from rftgym.train.loop import train


def test_train_scores_pseudocode_with_the_policy_it_trains(tmp_path, make_char_policy, monkeypatch):
    import gymnasium

    from rftgym.envs.code import env as code_env

    made = []
    real_make = gymnasium.make
    monkeypatch.setattr(gymnasium, "make", lambda *args, **kwargs: made.append(kwargs) or real_make(*args, **kwargs))
    # A random tiny model writes no plan: every reply reads as a two-step one, so that the scorer runs.
    monkeypatch.setattr(code_env, "parse_pseudocode", lambda parsed, action: (["take x", "add one"], None))
    scored = []
    real_call = RolloutStepScorer.__call__

    def spy(scorer, task, steps):
        scores = real_call(scorer, task, steps)
        scored.append((scorer, scores))
        return scores

    monkeypatch.setattr(RolloutStepScorer, "__call__", spy)
    env_kwargs = {"dataset": "generated", "pseudocode": True, "step_scorer": "rollout:2", "process_weight": 0.5,
                  "tcg": {"cache_dir": str(tmp_path / "tcg"), "n_random": 4}}
    cfg = train_config(tmp_path, steps=1, env_id="rftgym/CodeTCG-v0", env_kwargs=env_kwargs, group_size=2,
                       tasks_per_step=1, max_new_tokens=6, filter_zero_variance=False)
    policy = make_char_policy(max_position_embeddings=16384)  # one token per character: long prompts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(cfg, policy=policy)
    # gymnasium's copy of each env's spec shares the policy, not a copy of the model, nor fails on it
    assert not [w for w in caught if "copying the environment spec" in str(w.message)]
    assert history[0]["updates"] >= 1
    assert made and all(isinstance(kwargs["step_scorer"], PolicyRollouts) for kwargs in made)
    assert all(kwargs["step_scorer"].agent is policy and kwargs["require_isolation"] for kwargs in made)
    # Each episode's plan was scored over the policy under training, 2 samples per prefix.
    assert len(scored) == 2
    assert all(scorer.agent is policy and scorer.samples == 2 and scores == pytest.approx([0.0, 0.0])
               for scorer, scores in scored)
    assert cfg.env_kwargs["step_scorer"] == "rollout:2"  # the config keeps the string it saves


def test_a_resumed_run_scores_its_plans_with_the_completions_of_the_uninterrupted_run(tmp_path, make_char_policy,
                                                                                    monkeypatch):
    """The scorer samples from the policy under training without sample keys, from the policy's own
    generator: the checkpoint keeps that generator's state, so the step after a resume samples the
    scorer's completions (and trains) as the uninterrupted run did."""
    from rftgym.envs.code import env as code_env
    from rftgym.envs.code import process

    monkeypatch.setattr(code_env, "parse_pseudocode", lambda parsed, action: (["take x", "add one"], None))
    completions = []
    real_replies = process.replies_with_room

    def recording(replies, why):
        completions.append([r.text for r in replies])
        return real_replies(replies, why)

    monkeypatch.setattr(process, "replies_with_room", recording)
    env_kwargs = {"dataset": "generated", "pseudocode": True, "step_scorer": "rollout", "process_weight": 0.5,
                  "tcg": {"cache_dir": str(tmp_path / "tcg"), "n_random": 4}}

    def run(name, steps, resume=False):
        cfg = train_config(tmp_path, name, steps=steps, env_id="rftgym/CodeTCG-v0", env_kwargs=env_kwargs,
                           group_size=2, tasks_per_step=1, max_new_tokens=6, filter_zero_variance=False,
                           save_every=1, learning_rate=1e-2)
        return train(cfg, policy=make_char_policy(max_position_embeddings=16384), resume=resume)

    straight = run("straight", 3)
    per_step = len(completions) // 3
    assert per_step == 2 and len(set(map(tuple, completions))) > 1  # one plan per episode; samples differ
    last_step = completions[-per_step:]
    run("resumed", 2)
    completions.clear()
    resumed = run("resumed", 3, resume=True)
    assert completions == last_step
    assert resumed[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-5, abs=1e-7)
