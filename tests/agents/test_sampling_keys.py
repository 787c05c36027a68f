"""Keyed sampling: the sampler's arithmetic by hand, keys, and an episode's samples that do not
depend on what shares its batch (policy, both decode paths, rollout engine, trainer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import SayAEnv

from rftgym.agents.fast_decode import inverse_cdf_sample
from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.agents.sampling_keys import check_key, episode_keys, keyed_seed, keyed_uniforms
from rftgym.core.errors import ConfigError
from rftgym.rollout import RolloutConfig, run_episodes

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13, 14], [1, 4]]
HOT = SamplingConfig(max_new_tokens=10, temperature=1.3, top_p=0.95, seed=11)


# ---------------------------------------------------------------- the sampler, by hand


def test_inverse_cdf_takes_the_first_token_whose_cumulative_probability_exceeds_the_draw():
    # probabilities 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0
    logp = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)).repeat(7, 1)
    draws = torch.tensor([0.0, 0.49, 0.5, 0.79, 0.81, 0.95, 0.999999], dtype=torch.float64)
    assert inverse_cdf_sample(logp, draws).tolist() == [0, 0, 1, 1, 2, 3, 3]


def test_inverse_cdf_never_takes_a_filtered_token():
    # token 1 filtered out (-inf): cumulative 0.5, 0.5, 0.95, 1.0 over what is left (renormalised)
    logp = torch.tensor([[np.log(0.5), -np.inf, np.log(0.45), np.log(0.05)]] * 4, dtype=torch.float64)
    draws = torch.tensor([0.4999, 0.5, 0.9499, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(logp, draws).tolist() == [0, 2, 2, 3]
    # the last token filtered: a draw just below 1 must not run past the total into it
    last_out = torch.tensor([[np.log(0.5), np.log(0.5), -np.inf]], dtype=torch.float64)
    assert inverse_cdf_sample(last_out, torch.tensor([1 - 2**-53], dtype=torch.float64)).tolist() == [1]


def test_inverse_cdf_refuses_draws_of_another_shape():
    with pytest.raises(ValueError, match="one uniform per row"):
        inverse_cdf_sample(torch.zeros(3, 4), torch.rand(3, 4))


# ---------------------------------------------------------------- keys


def test_episode_keys_name_the_task_seed_and_its_repeat():
    keys = episode_keys([5, 5, None, 7, 5, -2])
    assert keys == [(1, 5, 0), (1, 5, 1), (3, 2), (1, 7, 0), (1, 5, 2), (2, 2, 0)]
    assert episode_keys([np.int64(4)]) == [(1, 4, 0)]


def test_keys_are_checked():
    assert check_key([1, np.int32(2)]) == (1, 2)
    with pytest.raises(ValueError, match="non-negative ints"):
        check_key((1, -1))
    with pytest.raises(TypeError, match="sequence of non-negative ints"):
        check_key("12")
    with pytest.raises(ValueError, match="non-negative ints"):
        check_key((1.5,))


def test_a_row_of_keyed_uniforms_is_the_same_in_any_batch():
    a, b = (1, 5, 0, 0), (1, 5, 1, 0)
    both = keyed_uniforms(9, [a, b], 6)
    assert both.shape == (2, 6)
    np.testing.assert_array_equal(both[1], keyed_uniforms(9, [b], 6)[0])
    np.testing.assert_array_equal(both[0], keyed_uniforms(9, [b, a], 6)[1])
    assert not np.array_equal(both[0], both[1])
    assert not np.array_equal(both[0], keyed_uniforms(10, [a], 6)[0])
    assert ((both >= 0) & (both < 1)).all()
    assert 0 <= keyed_seed(9, a) < 2**31 and keyed_seed(9, a) != keyed_seed(9, b)


# ---------------------------------------------------------------- the policy


def fast_twin(policy: HFPolicy) -> HFPolicy:
    policy.fast_decode = False
    return HFPolicy(policy.model, policy.tokenizer, sampling=policy.sampling, name="fast", fast_decode=True)


def test_a_keyed_reply_is_the_same_alone_in_any_order_and_batch_size(make_char_policy):
    policy = make_char_policy()
    policy.sampling = HOT
    keys = [(1, i, 0, 0) for i in range(len(PROMPTS))]
    together = [r.sampled_ids for r in policy.generate(PROMPTS, sample_keys=keys)]
    alone = [policy.generate([p], sample_keys=[k])[0].sampled_ids for p, k in zip(PROMPTS, keys)]
    reversed_ = [r.sampled_ids for r in policy.generate(PROMPTS[::-1], sample_keys=keys[::-1])][::-1]
    small = [r.sampled_ids for r in policy.generate(PROMPTS, SamplingConfig(**{**HOT.__dict__, "max_batch_size": 1}),
                                                    sample_keys=keys)]
    assert together == alone == reversed_ == small
    assert len({tuple(ids) for ids in together}) > 1
    # another key, or another seed, samples otherwise
    other_key = policy.generate(PROMPTS[:1], sample_keys=[(1, 0, 1, 0)])[0].sampled_ids
    other_seed = policy.generate(PROMPTS[:1], SamplingConfig(**{**HOT.__dict__, "seed": 12}),
                                 sample_keys=keys[:1])[0].sampled_ids
    assert together[0] != other_key and together[0] != other_seed


def test_both_decode_paths_sample_the_same_tokens_for_the_same_keys(make_char_policy):
    generic = make_char_policy()
    generic.sampling = HOT
    fast = fast_twin(generic)
    keys = [(2, i) for i in range(len(PROMPTS))]
    ours, theirs = fast.generate(PROMPTS, sample_keys=keys), generic.generate(PROMPTS, sample_keys=keys)
    assert fast._fast[1] is not None  # the fast path ran
    assert [r.sampled_ids for r in ours] == [r.sampled_ids for r in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_without_a_seed_keys_do_not_fix_the_samples(make_char_policy):
    policy = make_char_policy()
    policy.sampling = SamplingConfig(**{**HOT.__dict__, "seed": None, "max_new_tokens": 24})
    runs = {tuple(policy.generate(PROMPTS[:1], sample_keys=[(1, 0)])[0].sampled_ids) for _ in range(4)}
    assert len(runs) > 1


def test_keys_must_match_the_prompts(make_char_policy):
    policy = make_char_policy()
    policy.sampling = HOT
    with pytest.raises(ValueError, match="2 sample keys for 1 prompts"):
        policy.generate(PROMPTS[:1], sample_keys=[(1,), (2,)])
    with pytest.raises(ConfigError, match="seed must be None or an integer"):
        SamplingConfig(seed=-1)


# ---------------------------------------------------------------- the rollout engine


class CountDownEnv(SayAEnv):
    """Three turns of "say something"; the reward is the reply's length (so replies matter)."""

    def reset(self, *, seed=None, options=None):
        context, info = super().reset(seed=seed)
        self.left, self.context = 3, context
        return context, info

    def step(self, action):
        self.left -= 1
        self.context = self.context.appended(self.ids.message("assistant", action),
                                           self.ids.message("user", "again"))
        return self.context, float(len(action)), self.left == 0, False, {}


def sampled(episodes):
    return [[turn.sampled_ids for turn in episode.turns] for episode in episodes]


def test_an_episode_samples_the_same_whatever_num_envs_and_its_neighbours(make_char_policy):
    policy = make_char_policy()
    policy.sampling = SamplingConfig(**{**HOT.__dict__, "max_new_tokens": 6})
    seeds = [0, 1, 2, 0, 3]
    one = run_episodes(CountDownEnv, policy, seeds, config=RolloutConfig(num_envs=1))
    three = run_episodes(CountDownEnv, policy, seeds, config=RolloutConfig(num_envs=3))
    assert sampled(one) == sampled(three)
    # episode 1 alone (as `rftgym eval --seed 1 --episodes 1`) replays its run among the others
    assert sampled(run_episodes(CountDownEnv, policy, [1])) == sampled(one)[1:2]
    # a repeated task seed (a GRPO group) samples apart, and so does each turn
    assert sampled(one)[0] != sampled(one)[3]
    assert len({tuple(ids) for ids in sampled(one)[0]}) > 1
    # keys of the caller's own (the trainer's: step, task, member) sample afresh
    own = run_episodes(CountDownEnv, policy, seeds, sample_keys=[(1, i) for i in range(len(seeds))])
    assert sampled(own) != sampled(one)
    with pytest.raises(ConfigError, match="sample_keys has 1 entries for 5 seeds"):
        run_episodes(CountDownEnv, policy, seeds, sample_keys=[(1,)])
    with pytest.raises(ConfigError, match=r"sample_keys\[1\] is a sequence of non-negative ints"):
        run_episodes(CountDownEnv, policy, seeds[:2], sample_keys=[(1,), (-1,)])


def test_agents_without_keyed_sampling_are_not_passed_keys():
    from rftgym.agents.base import Agent, AgentReply

    class Plain(Agent):
        def act(self, contexts):  # no sample_keys parameter: a user's agent of before
            return [AgentReply(text="hi") for _ in contexts]

    episodes = run_episodes(CountDownEnv, Plain(), [0, 1], config=RolloutConfig(num_envs=2))
    assert [len(e.turns) for e in episodes] == [3, 3]


def test_a_subclass_that_overrides_act_without_keys_is_not_passed_keys():
    from rftgym.agents.base import Agent, AgentReply
    from rftgym.agents.scripted import RandomTextAgent

    class HalfScripted(RandomTextAgent):
        def act(self, contexts):  # the parent's keys are not taken here
            return [AgentReply(text="<answer>1</answer>") for _ in contexts]

    class Forwarding(RandomTextAgent):
        def act(self, contexts, **keyed):
            return super().act(contexts, **keyed)

    assert not HalfScripted.keyed_sampling and Forwarding.keyed_sampling and RandomTextAgent.keyed_sampling
    episodes = run_episodes(CountDownEnv, HalfScripted(), [0, 1], config=RolloutConfig(num_envs=2))
    assert [e.turns[0].action for e in episodes] == ["<answer>1</answer>"] * 2
    with pytest.raises(TypeError, match="Claims sets keyed_sampling = True, but its act.. has no sample_keys"):
        class Claims(Agent):
            keyed_sampling = True

            def act(self, contexts):
                return []

    class KeyedBase(Agent):  # abstract: its subclasses write act, and are checked then
        keyed_sampling = True

    with pytest.raises(TypeError, match="Concrete sets keyed_sampling = True"):
        class Concrete(KeyedBase):
            keyed_sampling = True

            def act(self, contexts):
                return []


def test_keys_that_pad_or_split_alike_still_have_streams_of_their_own():
    # SeedSequence pads with zeros and cuts ints into 32-bit words; the encoding must not.
    rows = keyed_uniforms(0, [(5,), (5, 0), (5, 0, 0), (0, 5), ()], 4)
    assert len({tuple(row) for row in rows}) == 5
    assert not np.array_equal(keyed_uniforms(2**32 + 9, [(5,)], 4), keyed_uniforms(9, [(1 + 5 * 2**32,)], 4))
    assert not np.array_equal(keyed_uniforms(9, [(2**32,)], 4), keyed_uniforms(9, [(0, 1)], 4))
    # an agent's own (unkeyed) stream is apart from any reply's key
    from rftgym.agents.sampling_keys import UNKEYED, training_keys

    assert keyed_seed(7, (3,), UNKEYED) != keyed_seed(7, (3,))
    # training and the engine's default keys never coincide
    assert not set(training_keys(1, [5, 6], 2)) & set(episode_keys([5, 6, 5, 6]))
    assert training_keys(2, [7], 2) == [(4, 2, 7, 0), (4, 2, 7, 1)]


def test_a_model_with_nan_logits_is_an_error_not_a_sample(make_char_policy):
    from rftgym.core.errors import AgentError

    policy = make_char_policy()
    with torch.no_grad():
        policy.model.lm_head.weight.fill_(float("nan"))
    for sampling in (HOT, SamplingConfig(max_new_tokens=4, temperature=0.0)):
        with pytest.raises(AgentError, match="NaN or infinite logits"):
            policy.generate(PROMPTS, sampling)
